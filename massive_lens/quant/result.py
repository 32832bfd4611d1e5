"""The results of quantization: outlier statistics with the W8A8 gap, the round-to-nearest grid,
and the low-bit grid (one row per setting, and the per-token error behind it).

:class:`OutlierReport` (:func:`~massive_lens.quant.measure_outliers`), :class:`LowBitGrid`
(:func:`~massive_lens.quant.lowbit_grid`) and :class:`Quantization`
(:func:`~massive_lens.quant.quantize_grid`), which extends the grid's table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from massive_lens.core.charts import profile_axes
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result

GROUPS = ("sink", "massive", "other")
DESTROYED = 10.0  # a setting whose perplexity exceeds this many times the reference is destroyed


@dataclass(frozen=True, kw_only=True)
class OutlierReport(Result):
    """Outlier and quantization statistics of one model on one corpus.

    ``to_frame()`` has one row per layer: ``layer``, ``max_inf_norm``, ``top1``, ``median``,
    ``ratio`` (top-1/median), ``kurtosis``, ``first_token_norm_ratio``, ``sink_share``, ``sink_mass``
    (the mean over heads of the attention to the first token);
    :attr:`totals` aggregates them with the losses into one dict. :attr:`tensors`: one row per
    quantized tensor, weight and activation input (``tensor``, ``layer``, ``kind``,
    ``row_dispersion``, ``col_dispersion``, ``underflow`` at the W8A8 scale:
    :mod:`massive_lens.quant.dispersion`); None in results saved before it was measured.
    """

    model_name: str
    frame: pd.DataFrame
    sink_metric: float
    fp_loss: float
    w8a8_loss: float
    per_channel: bool
    tensors: pd.DataFrame | None = None

    def worst_tensors(self, n: int = 3) -> pd.DataFrame:
        """The ``n`` tensors with the largest column dispersion, then the ``n`` with the largest
        underflow (empty when :attr:`tensors` was not measured).

        Args:
            n: how many of each.

        Returns:
            Rows of :attr:`tensors`, each once.
        """
        if self.tensors is None or not len(self.tensors):
            return pd.DataFrame()
        t = self.tensors
        picks = [t.nlargest(n, "col_dispersion"), t.nlargest(n, "underflow")]
        return pd.concat(picks).drop_duplicates(["tensor", "kind"])

    @property
    def gap(self) -> float:
        """W8A8 loss minus full-precision loss."""
        return self.w8a8_loss - self.fp_loss

    @property
    def totals(self) -> dict[str, float]:
        """max_inf_norm, max_ratio, mean_kurtosis, sink_metric, first_token_norm_ratio,
        fp_loss, w8a8_loss, gap."""
        return dict(
            max_inf_norm=float(self.frame["max_inf_norm"].max()),
            max_ratio=float(self.frame["ratio"].max()),
            mean_kurtosis=float(self.frame["kurtosis"].mean()),
            sink_metric=self.sink_metric,
            first_token_norm_ratio=float(self.frame["first_token_norm_ratio"].max()),
            fp_loss=self.fp_loss, w8a8_loss=self.w8a8_loss, gap=self.gap,
        )

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        row = pd.Series(self.totals)
        kind = "per-channel" if self.per_channel else "per-tensor"
        return (
            f"{self.model_name}: max |act| {row.max_inf_norm:.1f}, top-1/median up to "
            f"{row.max_ratio:.0f}x, mean kurtosis {row.mean_kurtosis:.1f}, sink metric "
            f"{row.sink_metric:.0%}; loss {self.fp_loss:.3f} -> W8A8 ({kind} weights, per-tensor static activations) "
            f"{self.w8a8_loss:.3f} (gap {self.gap:+.3f})" + self._worst_text()
        )

    def _worst_text(self) -> str:
        if self.tensors is None or not len(self.tensors):
            return ""
        t = self.tensors

        def name(r: Any) -> str:
            return f"{r.tensor} ({r.kind})"

        disp = t.loc[t.col_dispersion.fillna(-1).idxmax()]
        under = t.loc[t.underflow.fillna(-1).idxmax()]
        return (f"; worst column dispersion {disp.col_dispersion:.3g}x at {name(disp)} "
                f"(row {disp.row_dispersion:.3g}x), most underflow {100 * under.underflow:.4g}% at {name(under)}")

    def plot(self, ax: Any = None) -> Any:
        """Max inf-norm and median magnitude per layer (log scale)."""
        return profile_axes(self.frame, ["max_inf_norm", "median"], ax=ax,
                            title=f"{self.model_name}: block outputs")


@dataclass(frozen=True, kw_only=True)
class LowBitGrid(Result):
    """Loss of one model under round-to-nearest fake quantization at several bit widths.

    ``to_frame()``: one row per setting: ``setting`` (``"W<w>A<a>"``, 16 = not quantized),
    ``w_bits``, ``a_bits``, ``activations`` (``"per-token"`` or ``"per-tensor"``), ``loss``,
    ``fp_loss`` and ``gap`` (loss minus full precision, nats per token).
    """

    model_name: str
    frame: pd.DataFrame
    fp_loss: float

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def gaps(self) -> dict[str, float]:
        """``{setting: gap}``."""
        return dict(zip(self.frame.setting, self.frame.gap, strict=True))

    def summary(self) -> str:
        kind = self.frame.activations.iloc[0] if len(self.frame) else "-"
        parts = ", ".join(f"{r.setting} {r.loss:.3f} ({r.gap:+.3f})" for r in self.frame.itertuples())
        return (f"{self.model_name}: loss {self.fp_loss:.3f} in full precision; round-to-nearest, per-channel "
                f"weights, {kind} activations: {parts}")

    def plot(self, ax: Any = None) -> Any:
        """The gap to full precision per setting (a bar each)."""

        ax = ensure_axes(ax, (5, 3), layout=None)
        ax.bar(self.frame.setting, self.frame.gap)
        ax.set_ylabel("loss - full-precision loss (nats)")
        ax.set_title(f"{self.model_name}: round-to-nearest fake quantization")
        return ax


@dataclass(frozen=True, kw_only=True)
class Quantization(LowBitGrid):
    """Loss, perplexity, quantization error and outlier statistics of one model under low-bit settings.

    ``to_frame()``: one row per setting: ``setting``, ``weights``, ``activations``, ``kv`` (bits,
    16 = full precision), ``granularity``, ``symmetric``, ``rotation``, ``keep_sinks``, ``loss``,
    ``gap`` with its 95% bootstrap interval over sequences ``gap_low``, ``gap_high``, ``perplexity``,
    ``ppl_ratio`` (``exp(gap)``), ``err_sink``, ``err_massive``, ``err_other`` (mean relative
    activation quantization error ``|q(x) - x| / |x|`` of the residual readers' inputs, per token
    group), ``max_abs``, ``kurtosis``, ``top1_median`` (what the activation quantizer sees: the
    largest ``|x|``, the mean non-excess kurtosis per token, the largest top-1/median of one input),
    ``n_seqs``, ``weight_granularity`` and ``activation_granularity`` (``none`` where not quantized),
    ``destroyed`` (perplexity above :data:`DESTROYED` times the reference: left out of any ratio or
    mean, and named in the summary), ``rotation_error`` (the rotated model's largest relative logit
    error before quantization;
    0 without a rotation). ``max_abs``, ``kurtosis``, ``top1_median`` and the ``err_*`` columns are NaN
    (not measured) on a model whose layers reading the residual stream cannot be told apart.
    :attr:`tokens` is the per-token table: ``setting``, ``seq``, ``pos``, ``group``
    (``sink``, ``massive`` or ``other``), ``error``.
    """

    tokens: pd.DataFrame  # besides LowBitGrid's model_name, frame and fp_loss (to_frame and gaps are its own)
    skipped: tuple[tuple[str, str], ...] = ()  # (setting, why) of the settings that cannot run on this model
    sequences: pd.DataFrame | None = None  # setting, seq, loss, fp_loss: the paired per-sequence losses

    def destroyed(self) -> list[str]:
        """The settings flagged ``destroyed`` (empty for results saved before the flag)."""
        f = self.frame
        return list(f.setting[f.destroyed.astype(bool)]) if "destroyed" in f else []

    def summary(self) -> str:
        parts = []
        for r in self.frame.itertuples():
            sink = "" if math.isnan(r.err_sink) else f", error at sinks {r.err_sink:.2f} vs other {r.err_other:.2f}"
            sees = ("quantizer's inputs not measured (no layer reading the residual stream found)"
                    if math.isnan(r.max_abs) else f"quantizer sees max |x| {r.max_abs:.3g}, kurtosis {r.kurtosis:.1f}")
            parts.append(f"  {r.setting}: loss {r.loss:.3f} (gap {r.gap:+.3f} [{r.gap_low:+.3f}, {r.gap_high:+.3f}], "
                         f"perplexity x{r.ppl_ratio:.2f}); {sees}{sink}")
        n = int(self.frame.n_seqs.iloc[0]) if len(self.frame) else 0
        parts += [f"  {name}: not run: {why}" for name, why in self.skipped]
        if self.destroyed():
            parts.append(f"  destroyed (perplexity above {DESTROYED:g}x full precision; left out of ratios and means): "
                         + ", ".join(self.destroyed()))
        return (f"{self.model_name}: loss {self.fp_loss:.3f} in full precision over {n} sequences; round-to-nearest "
                "(no GPTQ):\n" + "\n".join(parts))

    def plot(self, ax: Any = None) -> Any:
        """The loss gap per setting with its interval, and the activation error per token group."""

        ax = ensure_axes(ax, (7, 3.5), layout=None)
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
