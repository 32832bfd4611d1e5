"""The low-bit grid's peak memory against the model's weights (issue 24's goal: at most 1.5x).

``python -m benchmarks --memory quantize:grid --models NAME`` runs :func:`measure` in a fresh
interpreter: :func:`~massive_lens.quant.quantize_grid` with the settings of docs/quantization.md's
grid and one static per-tensor setting with kept sinks (a calibration pass, the sinks of the
calibration text), on ``N_SEQS`` WikiText-2 test sequences of 128 tokens, ranges from WikiText-2
valid. The peak is judged as the report's is (:mod:`benchmarks.report`): the process's resident
high-water mark while the grid ran, less what the interpreter and libraries held before the
model was loaded, over the weights. The output also carries the grid's table (its rows are what
``massive-lens quantize`` prints for the same options).
"""

from __future__ import annotations

import time
from typing import Any

from massive_lens.core.budget import weight_bytes
from massive_lens.core.corpora import data_file
from massive_lens.quant import quantize_grid
from massive_lens.report.memory import PeakMemory

SETTINGS = ("W8A8", "W4A16", "W4A4", "W4A4+orthogonal", "W4A4+hadamard", "W4A4+hadamard+kvsink",
            "W4A4KV4+hadamard", "W4A4KV4@tensor+hadamard+kvsink")
N_SEQS, SEQ_LEN = 4, 128


def measure(model: Any) -> dict[str, Any]:
    """Run the grid on ``model`` (loaded by the caller); its peak, the weights, its time and rows."""
    with PeakMemory() as peak:
        start = time.perf_counter()
        grid = quantize_grid(model, data_file("wikitext-2/test.txt"), calibration=data_file("wikitext-2/valid.txt"),
                             settings=SETTINGS, seq_len=SEQ_LEN, n_seqs=N_SEQS)
        seconds = time.perf_counter() - start
    return {"peak": float(peak.peak_bytes), "weights": float(weight_bytes(model)), "seconds": seconds,
            "summary": grid.summary(), "fp_loss": grid.fp_loss, "rows": grid.to_frame().to_dict("records")}
