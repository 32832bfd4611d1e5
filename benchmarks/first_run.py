"""Issue 37's measurements of the report's first run (docs/benchmarks.md, "Issue 37"):

    python -m benchmarks.first_run grid        # CPU seconds per low-bit setting, one thread, 2 x 64 tokens
    python -m benchmarks.first_run load-cache  # memory loading the default model from its cache
    python -m benchmarks.first_run load-gguf   # memory dequantizing its GGUF file (the first run's load)

CPU seconds on one thread, not wall time: they hold on a machine other jobs share.
"""

from __future__ import annotations

import sys
import time

import torch

from massive_lens import load_model
from massive_lens.core.budget import weight_bytes
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.models.offline import DEFAULT, load_gguf
from massive_lens.report.memory import PeakMemory

GRID = ["W8A8", "W4A16", "W4A4", "W4A4+hadamard", "W4A4+hadamard+kvsink"]


def grid() -> None:
    import massive_lens.quant.api as api

    torch.set_num_threads(1)
    model = load_model(None)
    tokens = sequences(ModelView(model), None, 64, 4)
    evaluate = api._Run.evaluate

    def timed(run, setting, bits):
        start = time.process_time()
        out = evaluate(run, setting, bits)
        print(f"{setting.name}: {time.process_time() - start:.1f} CPU s", flush=True)
        return out

    api._Run.evaluate = timed
    api.quantize_grid(model, tokens[:2], settings=GRID, seq_len=64, n_seqs=2, calibration=tokens[2:])
    start = time.process_time()
    with torch.no_grad():
        model(tokens[:2])
    print(f"a plain forward of the same tokens: {time.process_time() - start:.1f} CPU s")


def load(gguf: bool) -> None:
    with PeakMemory() as peak:
        model = load_gguf(DEFAULT.source.path(DEFAULT.name))[0] if gguf else load_model(None)
    print(f"added {(peak.peak_bytes - peak.start_bytes) / weight_bytes(model):.2f}x the weights "
          f"({weight_bytes(model) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    {"grid": grid, "load-cache": lambda: load(False), "load-gguf": lambda: load(True)}[sys.argv[1]]()
