"""The paper's Table 3: every intervention judged by perplexity on the same sequences.

Each intervention of :data:`~massive_lens.interventions.registry.REGISTRY` is evaluated on
the *same* token sequences as the untouched model, with the perplexity ratio and a paired
95% bootstrap interval over sequences (the per-sequence log-ratio is resampled, so the
interval reflects how consistently a setting hurts, not how hard the sequences are).
Calibration statistics (means) must come from text other than the evaluation text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.fmt import ratio as _num
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import intervention_bars
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.calibration import Calibration, calibrate, describe_source
from massive_lens.interventions.registry import REGISTRY, SETTINGS
from massive_lens.metrics import bootstrap_mean, perplexity


@dataclass(frozen=True)
class InterventionTable(Result):
    """The paper's Table 3. ``to_frame()`` columns: ``setting``, ``perplexity``, ``ratio``
    (perplexity / original), ``ratio_low``, ``ratio_high`` (paired 95% bootstrap interval
    over sequences), ``accuracy``, ``n_seqs``, ``description``."""

    frame: pd.DataFrame
    model_name: str
    corpus: str
    calibration: str
    seq_len: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        n_seqs = int(self.frame["n_seqs"].iloc[0])
        lines = [f"{self.model_name}: interventions judged by perplexity on {self.corpus} "
                 f"({n_seqs} sequences of {self.seq_len} tokens; calibration: {self.calibration})",
                 f"{'setting':<24}{'perplexity':>12}{'ratio':>10}{'95% interval':>22}{'accuracy':>10}"]
        for r in self.frame.itertuples():
            interval = f"[{_num(r.ratio_low)}, {_num(r.ratio_high)}]"
            lines.append(f"{r.setting:<24}{_num(r.perplexity):>12}{_num(r.ratio):>10}{interval:>22}{r.accuracy:>10.1%}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Perplexity ratio per setting (log scale) with its 95% interval."""
        return intervention_bars(self.frame, ax=ax, title=f"{self.model_name}: interventions")


def run_interventions(
    model: Any,
    corpus: Corpus | Tensor = None,
    *,
    calibration: Corpus | Calibration = None,
    settings: Sequence[str] = SETTINGS,
    seq_len: int = 128,
    n_seqs: int = 32,
    batch_size: int = 8,
    calibration_seqs: int = 16,
    progress: bool = True,
) -> InterventionTable:
    """Evaluate each intervention of ``settings`` on the same sequences of ``corpus``.

    Args:
        model: a TransformerLens-style model.
        corpus: the evaluation text (a file, text, ``hf:`` name, token tensor; None: the
            offline default text).
        calibration: where means are measured (a corpus, None for the offline default
            text, or a :class:`~massive_lens.interventions.Calibration`); should be other
            text than ``corpus`` (this is not checked).
        settings: names from :data:`~massive_lens.interventions.SETTINGS` (default: all);
            ``original`` is always evaluated, as the baseline of the ratios.
        seq_len: tokens per sequence (default 128), for text input (evaluation and
            calibration).
        n_seqs: evaluation sequences (default 32), for text input.
        batch_size: sequences per forward pass (default 8).
        calibration_seqs: calibration sequences (default 16), for text input.
        progress: show progress bars.

    Returns:
        An :class:`InterventionTable` (one row per setting, in the order of ``settings``).

    Raises:
        MassiveLensError: if ``settings`` is empty or names an unknown setting, a setting
            that edits massive activations (``zero``, ``mean``, ``control``) finds none in the
            calibration text, or the model or a corpus is unusable (see :func:`~massive_lens.perplexity`).

    >>> from massive_lens import tiny_model
    >>> text = "The cat sat. A dog ran. " * 40
    >>> table = run_interventions(tiny_model("llama"), text, calibration=text[::-1], seq_len=16, n_seqs=2,
    ...                           settings=["original", "sink_attention_removed"], progress=False)
    >>> list(table.to_frame()["setting"])
    ['original', 'sink_attention_removed']
    """
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        raise MassiveLensError(f"unknown settings {unknown or settings}; choose from {SETTINGS}")
    view = ModelView(model)
    tokens = sequences(view, corpus, seq_len, n_seqs)
    calib = calibrate(model, calibration, seq_len=seq_len, n_seqs=calibration_seqs, progress=progress)
    results = {s: perplexity(model, tokens, batch_size=batch_size, hooks=REGISTRY[s].build(model, calib),
                             progress=progress)
               for s in dict.fromkeys(["original", *settings])}
    base = results["original"].per_seq
    rows = []
    for setting in settings:
        res = results[setting]
        diff = res.per_seq - base
        low, high = bootstrap_mean(diff)
        rows.append(dict(setting=setting, perplexity=res.perplexity, ratio=math.exp(float(diff.mean())),
                         ratio_low=math.exp(low), ratio_high=math.exp(high), accuracy=res.accuracy,
                         n_seqs=len(base), description=REGISTRY[setting].description))
    return InterventionTable(pd.DataFrame(rows), view.name, describe_source(corpus),
                             f"{calib.source}, {calib.n_seqs} sequences", int(tokens.shape[1]))
