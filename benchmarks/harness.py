"""The benchmark harness: one timing policy, one memory policy, one table.

Timing: the cases of one area run interleaved (A, B, C, A, B, C, ...) after one warm-up
call each, ``repeats`` rounds, and each case's time is the **median** of its rounds, so
load changes on a shared machine hit all cases alike. Every row is a *cost ratio*: the
measured case over its baseline, lower is better, with a goal ``ratio <= goal``.

Memory: peak resident memory a case adds above the loaded model, measured in a fresh
subprocess per case (``python -m benchmarks --memory AREA:CASE --models NAME``).

Models: every model-based area runs on each model of ``--models`` (default: both offline
models, SmolLM2-135M-Instruct and Qwen2.5-Coder-1.5B-Instruct), one model loaded at a time.
A case's batch is cut (:func:`fit_batch`) so that one forward pass costs at most ``WORK``
parameter-tokens: the same shapes on a small model, fewer sequences on a large one, so a
round takes seconds on a CPU for any model size. Ratios compare a case with its baseline on
the same model and batch, so they stay comparable across models.

    python -m benchmarks                       # prints the table
    python -m benchmarks --write docs/benchmarks.md  # the rows measured replace theirs there (write_table)
    python -m benchmarks --models default --areas origin --repeats 1
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from massive_lens.report.memory import release_free_memory

WORK = 3e11  # parameter-tokens one forward pass of a case may cost (see fit_batch)

ROOT = Path(__file__).resolve().parents[1]  # `python -m benchmarks` runs from the checkout


@dataclass(frozen=True)
class Row:
    """One measurement: ``ratio`` = cost of the case / cost of its baseline (lower is better)."""

    area: str
    name: str
    ratio: float
    goal: float | None  # the ratio must stay <= goal; None: a reference row (no goal)
    detail: str
    model: str = ""  # the model measured ("" for model-free areas)

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "reference"
        return "ok" if self.ratio <= self.goal else "over goal"


def fit_batch(model: Any, n_seqs: int, seq_len: int, work: float = WORK) -> int:
    """How many of ``n_seqs`` sequences of ``seq_len`` tokens one forward pass may take so that
    it costs at most ``work`` parameter-tokens (at least one sequence).

    >>> import torch
    >>> fit_batch(torch.nn.Linear(1000, 1000), n_seqs=4, seq_len=512, work=1e9)
    1
    >>> fit_batch(torch.nn.Linear(10, 10), n_seqs=4, seq_len=512, work=1e9)
    4
    """
    params = sum(p.numel() for p in model.parameters())
    return max(1, min(n_seqs, int(work // (params * seq_len))))


def median_times(cases: dict[str, Callable[[], Any]], repeats: int = 5,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per case, the cases interleaved after one warm-up call each."""
    for call in cases.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, call in cases.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields[field].split()[0]) / 1024


def resident_mb() -> float:
    """This process's resident memory now, in MB (after collecting garbage)."""
    release_free_memory()
    return _status_mb("VmRSS")


def peak_memory_of(call: Callable[[], Any]) -> float:
    """Peak resident MB that ``call()`` adds in this process (reset the high-water mark first)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident size
    base = _status_mb("VmRSS")
    call()
    return _status_mb("VmHWM") - base


def memory_in_subprocess(area: str, case: str, model: str = "default") -> float:
    """:func:`peak_memory_of` the case on ``model`` (a name for ``load_model``), in a fresh
    interpreter (so earlier cases leave no trace)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--memory", f"{area}:{case}", "--models", model],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"memory run of {area}:{case} on {model} failed:\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


TABLE_HEAD = "| model | area | measurement | ratio | goal (ratio <=) | verdict | detail |"


def to_markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", TABLE_HEAD, "|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = "-" if r.goal is None else f"{r.goal:g}"
        lines.append(f"| {r.model or '-'} | {r.area} | {r.name} | {r.ratio:.2f} | {goal} | {r.verdict} | {r.detail} |")
    return "\n".join(lines) + "\n"


def write_table(path: Path, rows: list[Row], header: str) -> None:
    """Write the table into ``path``: a new file holds a title and the table; an existing one keeps its
    title and everything after its table (the notes and the issues' sections), and every row of an area or
    model not measured this time; a row measured again (the same model, area and measurement) is replaced
    where it stood, a new one appended. What stood between the title and the table is this run's header."""
    fresh = to_markdown(rows, header).splitlines()
    if not path.exists():
        path.write_text("# Benchmarks\n\n" + "\n".join(fresh) + "\n")
        return
    lines = path.read_text().splitlines()
    if TABLE_HEAD not in lines:
        raise SystemExit(f"{path} has no benchmark table to update; write to a new file instead")
    head, body = lines.index(TABLE_HEAD) + 2, fresh.index(TABLE_HEAD) + 2  # the first row of each
    end = head
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    new = {_key(line): line for line in fresh[body:]}
    kept = [new.pop(_key(line), line) for line in lines[head:end]]
    title = [lines[0], ""] if lines[0].startswith("# ") else []
    path.write_text("\n".join([*title, *fresh[:body], *kept, *new.values(), *lines[end:]]) + "\n")


def _key(line: str) -> tuple[str, ...]:
    """A table row's model, area and measurement."""
    return tuple(cell.strip() for cell in line.strip().strip("|").split("|")[:3])
