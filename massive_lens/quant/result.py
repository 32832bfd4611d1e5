"""The result of a low-bit grid: one row per setting, and the per-token error behind it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from massive_lens.quantize import LowBitGrid

GROUPS = ("sink", "massive", "other")


@dataclass(frozen=True)
class Quantization(LowBitGrid):
    """Loss, perplexity, quantization error and outlier statistics of one model under low-bit settings.

    ``to_frame()``: one row per setting: ``setting``, ``weights``, ``activations``, ``kv`` (bits,
    16 = full precision), ``granularity``, ``symmetric``, ``rotation``, ``keep_sinks``, ``loss``,
    ``gap`` with its 95% bootstrap interval over sequences ``gap_low``, ``gap_high``, ``perplexity``,
    ``ppl_ratio`` (``exp(gap)``), ``err_sink``, ``err_massive``, ``err_other`` (mean relative
    activation quantization error ``|q(x) - x| / |x|`` of the residual readers' inputs, per token
    group), ``max_abs``, ``kurtosis``, ``top1_median`` (what the activation quantizer sees: the
    largest ``|x|``, the mean non-excess kurtosis per token, the largest top-1/median of one input),
    ``n_seqs``, ``rotation_error`` (the rotated model's largest relative logit error before quantization).
    :attr:`tokens` is the per-token table: ``setting``, ``seq``, ``pos``, ``group``
    (``sink``, ``massive`` or ``other``), ``error``.
    """

    tokens: pd.DataFrame  # after LowBitGrid's model_name, frame and fp_loss (to_frame and gaps are its own)
    skipped: tuple[tuple[str, str], ...] = ()  # (setting, why) of the settings that cannot run on this model

    def summary(self) -> str:
        parts = []
        for r in self.frame.itertuples():
            sink = "" if math.isnan(r.err_sink) else f", error at sinks {r.err_sink:.2f} vs other {r.err_other:.2f}"
            parts.append(f"  {r.setting}: loss {r.loss:.3f} (gap {r.gap:+.3f} [{r.gap_low:+.3f}, {r.gap_high:+.3f}], "
                         f"perplexity x{r.ppl_ratio:.2f}); quantizer sees max |x| {r.max_abs:.3g}, kurtosis "
                         f"{r.kurtosis:.1f}{sink}")
        n = int(self.frame.n_seqs.iloc[0]) if len(self.frame) else 0
        parts += [f"  {name}: not run: {why}" for name, why in self.skipped]
        return (f"{self.model_name}: loss {self.fp_loss:.3f} in full precision over {n} sequences; round-to-nearest "
                "(no GPTQ):\n" + "\n".join(parts))

    def plot(self, ax: Any = None) -> Any:
        """The loss gap per setting with its interval, and the activation error per token group."""
        import matplotlib.pyplot as plt

        ax = ax if ax is not None else plt.subplots(figsize=(7, 3.5))[1]
        f = self.frame
        x = range(len(f))
        ax.bar(x, f.gap, color="tab:gray", label="loss gap (nats)",
               yerr=[(f.gap - f.gap_low).clip(lower=0), (f.gap_high - f.gap).clip(lower=0)], capsize=3)
        ax.set_xticks(list(x), f.setting, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("loss - full precision (nats)")
        twin = ax.twinx()
        for group, marker in zip(GROUPS, "o^s", strict=True):
            twin.plot(list(x), f[f"err_{group}"], marker, label=f"error at {group} tokens")
        twin.set_ylabel("relative activation error")
        twin.legend(fontsize=7, loc="upper left")
        ax.set_title(f"{self.model_name}: low-bit settings")
        return ax
