"""The report's low-bit section: a small grid of 4-bit settings, with a rotation and kept sinks.

:func:`lowbit_section` runs :func:`~massive_lens.quant.quantize_grid` on the first evaluation
sequences (at most ``LOWBIT_SEQS``, at most ``LOWBIT_LEN`` tokens each: every setting is one
pass that rotates and quantizes every weight again, so the section is kept short), with the
report's calibration sequences for the static ranges. The settings are ``LOWBIT_GRID``: W8A8,
W4A16, W4A4, W4A4 with a randomized Hadamard rotation, and the same with the sinks kept in
full precision (KVSink). A model the rotation cannot apply to gets the grid without the rotated
settings, and a line saying why.
"""

from __future__ import annotations

from massive_lens.errors import MassiveLensError
from massive_lens.quant import quantize_grid
from massive_lens.quant.cli import COLUMNS
from massive_lens.report.render import Section
from massive_lens.report.sections import Inputs

LOWBIT_GRID = ("W8A8", "W4A16", "W4A4", "W4A4+hadamard", "W4A4+hadamard+kvsink")
LOWBIT_SEQS = 4  # evaluation sequences the grid reads
LOWBIT_LEN = 64  # tokens of each


def lowbit_section(inputs: Inputs, s: Section) -> None:
    """The grid's summary, figure and table (per-token activations, round-to-nearest)."""
    tokens = inputs.eval_tokens[:LOWBIT_SEQS, :LOWBIT_LEN]
    calib = inputs.calib_tokens[:LOWBIT_SEQS, : tokens.shape[1]]
    options = dict(seq_len=tokens.shape[1], n_seqs=len(tokens), calibration=calib)
    settings = list(LOWBIT_GRID)
    try:
        grid = quantize_grid(inputs.model, tokens, settings=settings, **options)
    except MassiveLensError as exc:
        if "rotation" not in str(exc):
            raise
        s.note(f"The rotated settings were left out: {exc}")
        grid = quantize_grid(inputs.model, tokens, settings=[x for x in settings if "+" not in x], **options)
    s.text(f"{len(tokens)} evaluation sequences of {tokens.shape[1]} tokens, static ranges from {len(calib)} "
           "calibration sequences; per-token activations, per-channel weights, round-to-nearest (no GPTQ). "
           "+hadamard rotates the residual stream (QuaRot's fusion, simulated layer by layer); +kvsink keeps the "
           "sink tokens' activations, keys and values in full precision (KVSink). `massive-lens quantize` runs "
           "larger grids (docs/quantization.md).")
    s.pre(grid.summary())
    s.figure(grid.plot(), "loss gap per setting (95% bootstrap interval over sequences) and the relative "
             "activation error at sink, massive and other tokens")
    frame = grid.to_frame()
    s.table(frame[[c for c in COLUMNS if c in frame]],
            "per setting: loss and its gap to full precision with the interval, perplexity ratio, the activation "
            "error per token group, and the largest input, kurtosis and top-1/median the quantizer sees")
