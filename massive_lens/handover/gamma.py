"""Outlier severity γ: how far a layer's mean activation stands out from its spread, and the SAE
latents it predicts will die.

An SAE learns directions around the origin. Where a layer's activations all share a large
common offset (the mean vector ``μ``) compared with how much they vary (the per-dim standard
deviations ``σ``), many latents end up never firing. Simon, Adams and Zou (2026, arXiv
2605.31518) measure that offset as the outlier severity ``γ = ‖μ‖ / ‖σ‖`` (both vectors over the
model's width, μ and σ taken over the positions of a corpus) and report that it predicts the
share of dead SAE latents across model-layers; mean-centring the activations removes most of
the death. Massive activations and attention sinks are where a large common offset comes from
in a residual stream, so :func:`outlier_severity` gives ``γ`` twice per layer and hook: over
every position, and over the positions :func:`~massive_lens.exclusion_mask` keeps.

The dead share ``γ`` implies needs a fit from ``γ`` to dead shares measured on trained SAEs:
:func:`fit_dead_share` makes one (a logistic curve in ``log10 γ``); pass it as ``fit=`` and the
frame gains ``predicted_dead`` columns. :func:`~massive_lens.core.stats.spearman_interval` gives the rank correlation
of such pairs with an interval. No fit is built in: the paper's coefficients are not published
with it, and one fitted here belongs to the SAEs it was fitted on (docs/handover.md shows one).

What raises γ is an offset shared by most positions (an outlier *dimension*); a massive value
at one position in sixteen lowers it, since it adds more spread than mean (for a value ``v`` at
a share ``p`` of the positions, ``‖μ‖/‖σ‖ ≈ sqrt(p / (1 - p))``). A tiny model whose every token
carries 50 in dim 7, and whose first token carries 3,000 in dim 5:

>>> import torch
>>> from massive_lens import tiny_model
>>> model = tiny_model("llama")
>>> with torch.no_grad():
...     model.W_E[:, 7] += 50.0
>>> sev = outlier_severity(model, "Some text to read. " * 20, seq_len=16, n_seqs=2, levels=())
>>> round(sev.gamma(1), -1) >= 20, round(sev.gamma(1, kept=True), -1) >= 20
(True, True)
>>> with torch.no_grad():
...     model.W_E[:, 7] -= 50.0
...     model.W_E[model.tokenizer.bos_token_id, 5] = 3000.0
>>> sev = outlier_severity(model, "Some text to read. " * 20, seq_len=16, n_seqs=2, levels=())
>>> round(sev.gamma(1), 2), sev.gamma(1, kept=True) > sev.gamma(1)
(0.25, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, SinkRule
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import finite_numbers
from massive_lens.errors import MassiveLensError
from massive_lens.handover.masks import exclusion_mask

SEVERITY_HOOKS = ("resid_post", "attn_out", "mlp_out")
SEVERITY_COLUMNS = ["layer", "hook", "gamma", "gamma_kept", "mean_norm", "std_norm", "mean_norm_kept",
                    "std_norm_kept", "n_positions", "n_kept", "predicted_dead", "predicted_dead_kept"]


def gamma_of(x: Float[Tensor, "n d"]) -> float:
    """γ = ‖μ‖ / ‖σ‖ of activations ``[n, d]`` (rows: positions; μ and σ per dim, σ with n - 1).

    Args:
        x: at least two activation vectors.

    Returns:
        The outlier severity (NaN when every row is the same).

    Raises:
        MassiveLensError: for fewer than two rows or a tensor that is not 2-D.

    >>> import torch
    >>> round(gamma_of(torch.tensor([[3.0, 0.0], [5.0, 0.0]])), 6)  # mean 4, std sqrt(2)
    2.828427
    """
    if not isinstance(x, Tensor) or x.ndim != 2 or len(x) < 2:
        raise MassiveLensError(f"gamma_of takes activations [n >= 2, d], got {getattr(x, 'shape', type(x).__name__)}")
    x = x.double()
    return _ratio(float(x.mean(0).norm()), float(x.std(0).norm()))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


@dataclass(frozen=True, kw_only=True)
class DeadShareFit:
    """A logistic fit of the dead-latent share on ``log10 γ``:
    ``dead = 1 / (1 + exp(-(intercept + slope * log10 γ)))``, from ``n_points`` trained SAEs.

    >>> fit = DeadShareFit(slope=2.0, intercept=-1.0, n_points=8, source="example")
    >>> round(fit.predict(10.0), 3)
    0.731
    """

    slope: float
    intercept: float
    n_points: int
    source: str = ""

    def predict(self, gamma: float) -> float:
        """The dead share the fit gives at ``gamma`` (> 0).

        Args:
            gamma: an outlier severity ``‖μ‖ / ‖σ‖``.

        Returns:
            The predicted share of dead latents, in (0, 1).

        Raises:
            MassiveLensError: for a ``gamma`` that is not a positive finite number.
        """
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma <= 0:
            raise MassiveLensError(f"gamma is an outlier severity > 0, got {gamma!r}")
        z = self.intercept + self.slope * math.log10(gamma)
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def summary(self) -> str:
        return (f"dead share = sigmoid({self.intercept:.3g} + {self.slope:.3g} log10 γ), fitted on {self.n_points} "
                f"SAEs{f' ({self.source})' if self.source else ''}")


def fit_dead_share(gammas: Sequence[float | int] | np.ndarray, dead_shares: Sequence[float | int] | np.ndarray, *,
                   source: str = "") -> DeadShareFit:
    """Fit ``dead = sigmoid(a + b log10 γ)`` by least squares on the logit of the dead share (each
    share clipped to [0.5 / 10,000, 1 - 0.5 / 10,000] so that 0 and 1 stay finite).

    Args:
        gammas: outlier severities (> 0), one per trained SAE.
        dead_shares: the share of that SAE's latents that never fire, in [0, 1].
        source: what the SAEs were, for the summary.

    Returns:
        A :class:`DeadShareFit`.

    Raises:
        MassiveLensError: for fewer than 2 pairs, unequal lengths, a γ <= 0, a share outside [0, 1],
            or γ values all equal.

    >>> fit = fit_dead_share([1.0, 10.0, 100.0], [0.1, 0.5, 0.9])
    >>> round(fit.predict(10.0), 2)
    0.5
    """
    g, d = finite_numbers(gammas, "gammas"), finite_numbers(dead_shares, "dead_shares")
    if len(g) != len(d) or len(g) < 2:
        raise MassiveLensError(f"fit_dead_share needs at least 2 (γ, dead share) pairs of equal length; got {len(g)} "
                               f"gammas and {len(d)} dead shares")
    if (g <= 0).any() or (d < 0).any() or (d > 1).any():
        raise MassiveLensError("gammas must be > 0 and dead shares in [0, 1]; got "
                               f"gammas {g.tolist()}, dead shares {d.tolist()}")
    x = np.log10(g)
    if np.ptp(x) == 0:
        raise MassiveLensError(f"all gammas are equal ({g[0]:.4g}): a fit needs γ values that differ")
    p = d.clip(0.5e-4, 1 - 0.5e-4)
    slope, intercept = np.polyfit(x, np.log(p / (1 - p)), 1)
    return DeadShareFit(slope=float(slope), intercept=float(intercept), n_points=len(g), source=source)


@dataclass(frozen=True, kw_only=True)
class OutlierSeverity(Result):
    """``γ = ‖μ‖ / ‖σ‖`` per layer and hook, over every position and over the kept ones.

    ``to_frame()``: one row per (``layer``, ``hook``): ``gamma`` (over every position),
    ``gamma_kept`` (over the positions :func:`~massive_lens.exclusion_mask` keeps: massive
    positions and sinks of the chosen levels left out), the norms behind them (``mean_norm``
    ``‖μ‖``, ``std_norm`` ``‖σ‖``, and their ``_kept`` twins), ``n_positions``, ``n_kept``, and
    ``predicted_dead`` / ``predicted_dead_kept`` (the dead-latent share ``fit`` gives; NaN
    without a fit).
    """

    frame: pd.DataFrame
    mask: Bool[Tensor, "seq pos"]
    fit: DeadShareFit | None
    model_name: str
    levels: tuple[str, ...]

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def gamma(self, layer: int, hook: str = "resid_post", *, kept: bool = False) -> float:
        """γ at one layer and hook.

        Args:
            layer: the layer.
            hook: one of the hooks measured (``resid_post``, ``attn_out``, ``mlp_out``).
            kept: γ over the kept positions only.

        Returns:
            The ``gamma`` (or ``gamma_kept``) value.

        Raises:
            MassiveLensError: for a layer and hook that were not measured.
        """
        rows = self.frame[(self.frame["layer"] == layer) & (self.frame["hook"] == hook)]
        if rows.empty:
            raise MassiveLensError(f"no γ at layer {layer}, hook {hook!r}; measured: layers "
                                   f"{sorted(set(self.frame['layer']))}, hooks {sorted(set(self.frame['hook']))}")
        return float(rows["gamma_kept" if kept else "gamma"].iloc[0])

    def summary(self) -> str:
        f = self.frame
        lines = [f"{self.model_name}: outlier severity γ = ‖μ‖/‖σ‖ over {int(f['n_positions'].iloc[0])} positions, "
                 f"{int(f['n_kept'].iloc[0])} kept (left out: massive positions"
                 f"{', ' + '/'.join(self.levels) + ' sinks' if self.levels else ''})"]
        for hook, g in f.groupby("hook", sort=False):
            top = g.loc[g["gamma"].idxmax()]
            lines.append(f"  {hook}: γ {g['gamma'].min():.3g}-{g['gamma'].max():.3g} (largest at layer "
                         f"{int(top.layer)}: {top.gamma:.3g}, {top.gamma_kept:.3g} without the left-out positions)"
                         + (f"; predicted dead share there {top.predicted_dead:.1%} -> {top.predicted_dead_kept:.1%}"
                            if self.fit is not None else ""))
        if self.fit is not None:
            lines.append(f"  fit: {self.fit.summary()}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """γ per layer for each hook: solid over every position, dashed over the kept ones (log scale)."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        for hook, g in self.frame.groupby("hook", sort=False):
            line = ax.plot(g["layer"], g["gamma"], marker="o", markersize=3, label=f"{hook}")[0]
            ax.plot(g["layer"], g["gamma_kept"], linestyle="--", color=line.get_color(), label=f"{hook}, kept")
        ax.set(yscale="log", xlabel="layer", ylabel="γ = ‖μ‖/‖σ‖", title=f"{self.model_name}: outlier severity")
        ax.legend(fontsize="small")
        return ax


class _Moments:
    """Per (layer, hook): sums of x and x² (float64) over every position and over the kept ones."""

    def __init__(self, keep: Tensor):
        self.keep, self.sums = keep, {}

    def hook(self, x: Tensor, hook: Any, *, key: tuple[int, str]) -> None:
        x = x.detach().double().cpu().flatten(2)  # [seq pos d]
        kept = x[self.keep]
        flat = x.flatten(0, 1)
        self.sums[key] = (flat.sum(0), flat.pow(2).sum(0), len(flat), kept.sum(0), kept.pow(2).sum(0), len(kept))


def _norms(s: Tensor, s2: Tensor, n: int) -> tuple[float, float]:
    if n < 2:
        return float("nan"), float("nan")
    mean = s / n
    var = (s2 / n - mean.pow(2)).clamp(min=0) * n / (n - 1)
    return float(mean.norm()), float(var.sqrt().norm())


def outlier_severity(
    model: Any,
    corpus: Corpus = None,
    *,
    layers: int | Sequence[int] | None = None,
    hooks: Sequence[str] = SEVERITY_HOOKS,
    seq_len: int = 128,
    n_seqs: int = 8,
    levels: str | Sequence[str] = ("primary",),
    criterion: Criterion | None = None,
    rule: SinkRule | None = None,
    fit: Any = None,
) -> OutlierSeverity:
    """γ = ‖μ‖ / ‖σ‖ per layer and hook, with and without the massive and sink positions (see the
    module docstring).

    Args:
        model: a TransformerLens-style model (left as found).
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor,
            or None for the offline default text.
        layers: the layers (None: all).
        hooks: per-block hooks whose output is ``[.., d]`` (default residual stream, attention
            output, MLP output); a hook the model lacks is an error.
        seq_len: tokens per sequence read from a text corpus.
        n_seqs: sequences read from a text corpus.
        levels: the sink levels the kept positions leave out, as for :func:`~massive_lens.exclusion_mask`.
        criterion: as for :func:`~massive_lens.exclusion_mask`.
        rule: as for :func:`~massive_lens.exclusion_mask`.
        fit: a :class:`DeadShareFit` to turn γ into a predicted dead share (None: no prediction).

    Returns:
        An :class:`OutlierSeverity`.

    Raises:
        MassiveLensError: for a hook the model lacks, no hooks, a ``fit`` that is not a
            :class:`DeadShareFit`, or what :func:`~massive_lens.exclusion_mask` refuses.
    """
    names = [hooks] if isinstance(hooks, str) else list(hooks)
    if not names or len(set(names)) != len(names):
        raise MassiveLensError(f"hooks must name each per-block hook once, e.g. {SEVERITY_HOOKS}; got {hooks!r}")
    if fit is not None and not isinstance(fit, DeadShareFit):
        raise MassiveLensError(f"fit must be a DeadShareFit (from fit_dead_share), got {type(fit).__name__}")
    view = ModelView(model)
    chosen = view.chosen_layers(layers)
    for name in names:
        if not all(view.has_hook(layer, name) for layer in chosen):
            raise MassiveLensError(f"{view.name} has no hook {view.block_hook(chosen[0], name)!r} at every chosen "
                                   f"layer; hooks it has per block: see model.hook_dict (e.g. {SEVERITY_HOOKS})")
    tokens = sequences(view, corpus, seq_len, n_seqs)
    ex = exclusion_mask(model, tokens, levels=levels, criterion=criterion, rule=rule)
    moments = _Moments(ex.keep & ex.valid)
    fwd = [(view.block_hook(layer, name), partial(moments.hook, key=(layer, name))) for layer in chosen
           for name in names]
    view.forward(view.full_batch(tokens), fwd)
    rows = []
    for layer in chosen:
        for name in names:
            s, s2, n, ks, ks2, nk = moments.sums[(layer, name)]
            mean, std = _norms(s, s2, n)
            kmean, kstd = _norms(ks, ks2, nk)
            gamma, kept = _ratio(mean, std), _ratio(kmean, kstd)
            pred = [fit.predict(g) if fit is not None and g > 0 else float("nan") for g in (gamma, kept)]
            rows.append((layer, name, gamma, kept, mean, std, kmean, kstd, n, nk, *pred))
    return OutlierSeverity(frame=pd.DataFrame(rows, columns=SEVERITY_COLUMNS), mask=ex.mask.clone(), fit=fit,
                           model_name=view.name, levels=ex.levels)
