"""The report's low-bit section: a small grid of 4-bit settings, with a rotation and kept sinks.

:func:`lowbit_section` runs :func:`~massive_lens.quant.quantize_grid` on the first evaluation
sequences (2, or 4 with ``full``; at most ``LOWBIT_LEN`` tokens each: every setting is one
pass that rotates and quantizes every weight again, so the section is kept short), with the
report's calibration sequences for the static ranges. The settings (``LOWBIT``): W8A8, W4A4,
W4A4 with a randomized Hadamard rotation, and the same with the sinks kept in full precision
(KVSink); W4A16 too with ``full``. A model the rotation cannot apply to gets the grid without
the rotated settings, a line saying why, and the kept sinks without the rotation.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from massive_lens.quant import quantize_grid
from massive_lens.quant.cli import COLUMNS
from massive_lens.report.inputs import Inputs
from massive_lens.report.render import Section

# (settings, evaluation sequences) by ``full``: every setting is one pass that rotates and quantizes
# every weight again; W4A16 is the one the light default leaves out
LOWBIT = {False: (("W8A8", "W4A4", "W4A4+hadamard", "W4A4+hadamard+kvsink"), 2),
          True: (("W8A8", "W4A16", "W4A4", "W4A4+hadamard", "W4A4+hadamard+kvsink"), 4)}
LOWBIT_GRID = LOWBIT[True][0]
LOWBIT_LEN = 64  # tokens of each sequence


def lowbit_section(inputs: Inputs, s: Section) -> None:
    """The grid's summary, figure and table (per-token activations, round-to-nearest). A setting
    the model cannot run (a rotation on a post-norm model) is named with the reason; the kept
    sinks are then shown without the rotation, so the section keeps the row its title promises."""
    grid_settings, n_seqs = LOWBIT[inputs.settings.full]
    tokens = inputs.eval_tokens[:n_seqs, :LOWBIT_LEN]
    calib = inputs.calib_tokens[:n_seqs, : tokens.shape[1]]
    options = dict(seq_len=tokens.shape[1], n_seqs=len(tokens), calibration=calib)
    grid = quantize_grid(inputs.model, tokens, settings=list(grid_settings), **options)
    if any("kvsink" in name for name, _ in grid.skipped):  # the kept sinks without the rotation
        extra = quantize_grid(inputs.model, tokens, settings=["W4A4+kvsink"], **options)
        grid = replace(grid, frame=pd.concat([grid.frame, extra.frame], ignore_index=True),
                       tokens=pd.concat([grid.tokens, extra.tokens], ignore_index=True))
    for name, why in grid.skipped:
        s.note(f"{name} was left out: {why}")
    more = "" if inputs.settings.full else " (full=True, `--full`: W4A16 too, on 4 sequences)"
    s.text(f"{len(tokens)} evaluation sequences of {tokens.shape[1]} tokens{more}, static ranges from {len(calib)} "
           "calibration sequences; per-channel weights, per-token activations (dynamic: one scale per token, so "
           "this W8A8 differs from the W8A8 of the section above, whose activations have one static scale per "
           "tensor), round-to-nearest (no GPTQ). "
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
