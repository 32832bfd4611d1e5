"""What every section of the report reads: the options (:class:`ReportOptions` and its
``DEFAULT``, ``FULL`` and ``QUICK`` presets) and :class:`Inputs`, the model, the text and the
corpus sequences tokenized once for all sections."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from torch import Tensor

from massive_lens.core.budget import weight_bytes
from massive_lens.core.corpora import sequences
from massive_lens.core.fmt import short
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

# The sections a report may leave out (``skip=``), by key; the model section always runs.
SKIPPABLE = ("massive", "origin", "attention", "sinks", "circuit", "interventions", "quantization", "lowbit")


@dataclass(frozen=True)
class ReportOptions:
    """What the report runs, and on how much text; every field is a
    :func:`~massive_lens.write_report` option of the same name (and a ``massive-lens report``
    flag).

    Attributes:
        seq_len: tokens per corpus sequence (scan, evaluation and calibration).
        n_seqs: evaluation sequences: the intervention table, quantization, and the causal
            check of the origin (its first ``min(4, n_seqs)``).
        scan_seqs: corpus sequences the scan reads.
        calibration_seqs: calibration sequences (intervention means and sinks, quantization scales).
        verify: check the origin story causally (zero the named neurons and weights).
        dim: the hidden dimension to trace (None: that of the text's largest massive entry).
        pos: the token position to trace (None: that of the text's largest massive entry).
        layer: the layer of the landscape, attention and magnitude figures (None: the layer
            of the headline activation, the text's largest token-specific massive value).
        skip: keys of sections to leave out, among ``SKIPPABLE`` (a comma-separated string
            or a sequence); a skipped section shows one line saying so.
        full: the full settings of the costly steps: the origin's causal check measures
            perplexity on 4 evaluation sequences of ``seq_len`` tokens (else 2 of 64), the low-bit
            grid has 5 settings on 4 sequences (else 4 on 2), and the half-precision fix is
            searched by running the model in each dtype (else none is recommended).
    """

    seq_len: int = 128
    n_seqs: int = 4
    scan_seqs: int = 4
    calibration_seqs: int = 4
    verify: bool = True
    dim: int | None = None
    pos: int | None = None
    layer: int | None = None
    skip: str | Sequence[str] = ()
    full: bool = False

    def __post_init__(self) -> None:
        skip = self.skip.split(",") if isinstance(self.skip, str) else self.skip
        if not isinstance(skip, (list, tuple)) or not all(isinstance(k, str) for k in skip):
            raise MassiveLensError(f"skip takes section keys among {SKIPPABLE}, got {self.skip!r}")
        skip = tuple(k.strip() for k in skip if k.strip())
        unknown = sorted(set(skip) - set(SKIPPABLE))
        if unknown:
            raise MassiveLensError(f"skip: unknown section key(s) {unknown}; the keys are {', '.join(SKIPPABLE)}")
        object.__setattr__(self, "skip", skip)
        sizes = dict(seq_len=self.seq_len, n_seqs=self.n_seqs, scan_seqs=self.scan_seqs,
                     calibration_seqs=self.calibration_seqs)
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad or self.seq_len < 2:
            raise MassiveLensError(f"report sizes must be whole numbers >= 1 (seq_len >= 2), got {bad or sizes}")
        for name in ("dim", "pos", "layer"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise MassiveLensError(f"{name} must be an int or None, got {value!r}")
        if self.layer is not None and self.layer < 0:
            raise MassiveLensError(f"layer must be >= 0, got {self.layer}")
        for name in ("verify", "full"):
            if not isinstance(getattr(self, name), bool):
                raise MassiveLensError(f"{name} must be True or False, got {getattr(self, name)!r}")


DEFAULT = ReportOptions()  # minutes on the default model on 2 CPU cores
FULL = ReportOptions(n_seqs=8, scan_seqs=8, full=True)
QUICK = ReportOptions(seq_len=32, n_seqs=2, scan_seqs=4, calibration_seqs=2, verify=False)


def describe(corpus: Any) -> str:
    """A short name for a corpus: its file name, ``hf:`` spec, "the offline default text",
    "a token tensor", or the start of a literal text."""
    if corpus is None:
        return "the offline default text"
    if isinstance(corpus, Tensor):
        return "a token tensor"
    if isinstance(corpus, os.PathLike) or (isinstance(corpus, str) and (corpus.startswith("hf:") or _is_file(corpus))):
        return str(corpus)
    if isinstance(corpus, str):
        return f"the text {short(corpus, 30)!r}"
    return f"a {type(corpus).__name__} of texts"


def _is_file(text: str) -> bool:
    try:
        return "\n" not in text and len(text) < 4096 and Path(text).expanduser().is_file()
    except (OSError, ValueError):
        return False


class Inputs:
    """What every section reads: the model, the text, the corpus, the calibration corpus and
    the settings; ``progress`` shows the bars of the long sections' own steps (the interventions)."""

    def __init__(self, model: Any, text: str, corpus: Any, settings: ReportOptions, calibration: Any = None,
                 progress: bool = False):
        self.model, self.text, self.corpus, self.settings = model, text, corpus, settings
        self.calibration, self.progress = calibration, progress
        self.view = ModelView(model)
        view = self.view
        for name, value, size in (("layer", settings.layer, view.n_layers), ("dim", settings.dim, view.d_model)):
            if value is not None and not 0 <= value < size:
                raise MassiveLensError(f"{name}={value} is out of range for {self.view.name}: 0 <= {name} < {size}")

    @cached_property
    def tokens(self) -> Tensor:
        """The corpus sequences, tokenized once: evaluation sequences first, then (without a
        separate calibration corpus) the calibration ones (disjoint text); the scan reads the
        first ``scan_seqs``."""
        s = self.settings
        calib = s.calibration_seqs if self.calibration is None else 0
        return sequences(self.view, self.corpus, s.seq_len, max(s.scan_seqs, s.n_seqs + calib))

    @cached_property
    def batch_size(self) -> int:
        """Sequences per forward pass: as many (1 to 8) as keep one pass's float32 logits under
        a tenth of the weights' size, so the report's peak memory stays near the weights."""
        logits = self.settings.seq_len * int(getattr(self.view.cfg, "d_vocab", 0) or 1) * 4
        return max(1, min(8, weight_bytes(self.model) // (10 * logits)))

    @property
    def eval_tokens(self) -> Tensor:
        return self.tokens[: self.settings.n_seqs]

    @cached_property
    def calib_tokens(self) -> Tensor:
        s = self.settings
        if self.calibration is not None:
            return sequences(self.view, self.calibration, s.seq_len, s.calibration_seqs)
        calib = self.tokens[s.n_seqs: s.n_seqs + s.calibration_seqs]
        if len(calib) == 0:
            raise MassiveLensError(f"the corpus gives {len(self.tokens)} sequences of {s.seq_len} tokens, none left "
                                   f"for calibration after the {s.n_seqs} evaluation ones; give more text, lower "
                                   "n_seqs or seq_len, or pass calibration=")
        return calib

    @property
    def eval_source(self) -> str:
        """What the evaluation sequences are, in words (counts as really used)."""
        return f"{len(self.eval_tokens)} sequences of {self.settings.seq_len} tokens from {describe(self.corpus)}"

    @property
    def calib_source(self) -> str:
        """What the calibration sequences are, in words (counts as really used)."""
        if self.calibration is not None:
            return f"{len(self.calib_tokens)} sequences from {describe(self.calibration)}"
        return (f"{len(self.calib_tokens)} sequences from {describe(self.corpus)}, the ones after the evaluation "
                "sequences (disjoint text)")
