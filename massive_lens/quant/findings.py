"""The results of the granularity analyses: the granularity table with ``D_sink``, the
fewest-modules-in-float16 search, and the sink-mass predictor comparison.

:class:`GranularityTable` (:func:`~massive_lens.quant.granularity.granularity_table`),
:class:`Float16Search` (:func:`~massive_lens.quant.float16.fewest_float16`) and
:class:`SinkPredictor` (:func:`~massive_lens.quant.predictor.sink_predictor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.quant.result import DESTROYED


@dataclass(frozen=True, kw_only=True)
class GranularityTable(Result):
    """Every setting per weight and activation granularity, with the sink-attributable damage.

    ``to_frame()``: one row per setting (its kept-sinks twin folded in): ``setting``, ``base``
    (``W8A8``, ``W4A4``), ``weight_granularity``, ``activation_granularity``, ``symmetric``,
    ``rotation``, ``gap`` with ``gap_low``/``gap_high`` (nats), ``ppl_ratio``, ``destroyed``;
    ``kept_gap`` and ``kept_destroyed`` (the same setting with the sinks kept in full precision);
    ``d_sink`` = gap minus kept gap, the paired per-sequence difference of losses, with its 95%
    bootstrap interval over sequences (``d_sink_low``, ``d_sink_high``), and ``d_sink_ppl`` with
    ``d_sink_ppl_low``/``d_sink_ppl_high``: the same difference in perplexity points
    (``exp(loss)`` per sequence). :attr:`arms` is the frame of the underlying
    :class:`~massive_lens.quant.result.Quantization` (every arm, kept twins included),
    :attr:`sequences` its per-sequence losses.
    """

    model_name: str
    frame: pd.DataFrame
    fp_loss: float
    arms: pd.DataFrame
    sequences: pd.DataFrame

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def ratios(self) -> pd.DataFrame:
        """Per ``base``: ``d_sink`` at per-tensor activations over ``d_sink`` at per-token, the
        factor per-token scaling removes (NaN where either arm is destroyed, either row is missing,
        or either ``D_sink`` is not positive)."""
        rows = []
        f = self.frame[self.frame.rotation.eq("none") & self.frame.symmetric.astype(bool)]
        for base, part in f.groupby("base", sort=False):
            by = {r.activation_granularity: r for r in part.itertuples()}
            tensor, token = by.get("tensor"), by.get("token")
            ok = tensor is not None and token is not None and not any(
                r.destroyed or r.kept_destroyed for r in (tensor, token))
            rows.append(dict(base=base, d_sink_tensor=tensor.d_sink if tensor is not None else math.nan,
                             d_sink_token=token.d_sink if token is not None else math.nan,
                             ratio=tensor.d_sink / token.d_sink if ok and min(tensor.d_sink, token.d_sink) > 0
                             else math.nan))
        return pd.DataFrame(rows, columns=["base", "d_sink_tensor", "d_sink_token", "ratio"])

    def summary(self) -> str:
        f = self.frame
        lines = [f"{self.model_name}: loss {self.fp_loss:.3f} in full precision; D_sink = gap - gap with the sinks "
                 "kept in full precision (paired over sequences, 95% bootstrap interval):"]
        for r in f.itertuples():
            flag = " DESTROYED" if r.destroyed else ""
            lines.append(f"  {r.setting} (weights {r.weight_granularity}, activations {r.activation_granularity}): gap "
                         f"{r.gap:+.3f} [{r.gap_low:+.3f}, {r.gap_high:+.3f}] (x{r.ppl_ratio:.3g}){flag}; D_sink "
                         f"{r.d_sink:+.4f} [{r.d_sink_low:+.4f}, {r.d_sink_high:+.4f}] nats, {r.d_sink_ppl:+.3g} "
                         f"[{r.d_sink_ppl_low:+.3g}, {r.d_sink_ppl_high:+.3g}] perplexity")
        for r in self.ratios().itertuples():
            if math.isfinite(r.ratio):
                lines.append(f"  {r.base}: D_sink per-tensor / per-token = {r.ratio:.3g} (the factor per-token "
                             "scaling removes)")
        gone = list(f.setting[f.destroyed | f.kept_destroyed])
        if gone:
            lines.append(f"  destroyed (perplexity above {DESTROYED:g}x full precision, left out of the ratios): "
                         + ", ".join(gone))
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """``D_sink`` per setting with its interval (destroyed settings hatched)."""
        ax = ensure_axes(ax, (7, 3.5), layout=None)
        f = self.frame
        x = list(range(len(f)))
        bars = ax.bar(x, f.d_sink, color="tab:blue",
                      yerr=[(f.d_sink - f.d_sink_low).clip(lower=0), (f.d_sink_high - f.d_sink).clip(lower=0)],
                      capsize=3)
        for bar, gone in zip(bars, f.destroyed | f.kept_destroyed, strict=True):
            if gone:
                bar.set_hatch("//")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(x, f.setting, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("D_sink (nats)")
        ax.set_title(f"{self.model_name}: sink-attributable damage by granularity")
        return ax


@dataclass(frozen=True, kw_only=True)
class Float16Search(Result):
    """The fewest modules to keep in full precision for a setting to come within ``target`` of
    the reference perplexity.

    ``to_frame()``: the curve, one row per evaluated count: ``kept`` (modules in full precision,
    the first ``kept`` of the ranking), ``perplexity``, ``ppl_ratio``, ``gap``. :attr:`ranking`:
    every module, most damaged first (``module``, ``layer``, ``error``: its own relative output
    error per token, averaged over tokens, in the all-quantized pass). :attr:`modules`: the smallest
    set found (None when even every ranked module kept was not enough).
    """

    model_name: str
    setting: str
    target: float
    fp_perplexity: float
    frame: pd.DataFrame
    ranking: pd.DataFrame
    modules: tuple[str, ...] | None

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        start = self.frame.iloc[0]
        head = (f"{self.model_name}, {self.setting}: perplexity x{start.ppl_ratio:.3g} of full precision "
                f"({self.fp_perplexity:.3g}) with every module quantized")
        if self.modules is None:
            return head + f"; no kept set of the {len(self.ranking)} modules reached x{self.target:g}"
        end = self.frame[self.frame.kept == len(self.modules)].iloc[0]
        shown = ", ".join(self.modules[:5]) + (" ..." if len(self.modules) > 5 else "")
        return (head + f"; keeping {len(self.modules)} of {len(self.ranking)} modules in full precision brings it to "
                f"x{end.ppl_ratio:.3g} (target x{self.target:g}): {shown}")

    def plot(self, ax: Any = None) -> Any:
        """Perplexity ratio against the number of modules kept in full precision."""
        ax = ensure_axes(ax, (5, 3.5), layout=None)
        f = self.frame.sort_values("kept")
        ax.plot(f.kept, f.ppl_ratio, "o-")
        ax.axhline(self.target, color="gray", ls="--", lw=0.8, label=f"target x{self.target:g}")
        ax.set_yscale("log")
        ax.set_xlabel("modules kept in full precision")
        ax.set_ylabel("perplexity / full precision")
        ax.set_title(f"{self.model_name}: {self.setting}")
        ax.legend(fontsize=8)
        return ax


@dataclass(frozen=True, kw_only=True)
class SinkPredictor(Result):
    """Per-layer sink mass, dispersion and quantization damage, and their rank correlations.

    ``to_frame()``: one row per layer: ``layer``, ``sink_mass`` (mean attention to the first
    token over heads and queries), ``dispersion`` (the largest column dispersion of the layer's
    quantized inputs and weights), ``underflow`` (the largest underflow there), ``damage`` (the
    loss gap with only this layer's modules quantized). :attr:`correlations`: one row per pair
    (``x``, ``y``, Spearman's ``rho`` with ``low``/``high`` 95% interval, ``p``, ``n``).
    """

    model_name: str
    setting: str
    frame: pd.DataFrame
    correlations: pd.DataFrame

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        lines = [f"{self.model_name}, {self.setting}: rank correlation with per-layer damage (one layer quantized at "
                 f"a time, {len(self.frame)} layers):"]
        for r in self.correlations.itertuples():
            lines.append(f"  {r.x} vs {r.y}: rho {r.rho:+.2f} [{r.low:+.2f}, {r.high:+.2f}], p {r.p:.3g}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Damage against dispersion and against sink mass, per layer (ranks)."""
        ax = ensure_axes(ax, (5, 3.5), layout=None)
        f = self.frame
        rank = f.damage.rank()
        ax.plot(f.dispersion.rank(), rank, "o", label="dispersion")
        ax.plot(f.sink_mass.rank(), rank, "^", label="sink mass")
        ax.set_xlabel("rank of the layer's predictor")
        ax.set_ylabel("rank of the layer's damage")
        ax.set_title(f"{self.model_name}: {self.setting}")
        ax.legend(fontsize=8)
        return ax
