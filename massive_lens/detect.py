"""Finding massive activations.

Sun et al. (2024) call a residual-stream activation *massive* when its magnitude is above
an absolute threshold (100) **and** about 1,000 times the median magnitude of its hidden
state. In LLaMA2-7B a handful of them sit on fixed dimensions (1415, 2533), on the first
token and the first strong delimiter, appear abruptly in one early layer and stay nearly
constant until the last layers. The definition is loose on purpose, so both thresholds are
parameters of :class:`Criterion`.

Three views of the same measurement:

- :func:`find_massive`: every massive entry of one text (or a padded batch): layer,
  position, token, token kind, dimension, value, ratio to the median;
- :func:`layer_profile`: per layer, the top-1..k magnitudes and the median, averaged over
  texts (the paper's layer-wise figure and its Table 2 statistic);
- :func:`~massive_lens.scan.scan_corpus`: the same statistics streamed over a corpus, plus
  how often each (dimension, token kind) is massive (module ``massive_lens.scan``).

All three hook ``blocks.{l}.hook_resid_post`` (or another residual hook), reduce each
activation in place, and stop the forward pass after the last layer they need.

>>> from massive_lens import tiny_model
>>> found = find_massive(tiny_model("llama"), "A tiny model has none.")
>>> len(found.to_frame())
0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens._model_view import TOKEN_KINDS, Batch, ModelView
from massive_lens.errors import MassiveLensError

RESIDUAL_HOOKS = ("resid_pre", "resid_mid", "resid_post")


@dataclass(frozen=True)
class Criterion:
    """When an activation counts as massive: ``|value| > abs_threshold`` and
    ``|value| / median > ratio_threshold``, the median taken over the whole hidden state of
    that layer and sequence (``median_over="hidden_state"``, non-pad positions only) or over
    each token's own vector (``"token"``).

    >>> Criterion(ratio_threshold=100).ratio_threshold
    100
    """

    abs_threshold: float | int = 100.0
    ratio_threshold: float | int = 1000.0
    median_over: str = "hidden_state"  # "hidden_state" or "token"

    def __post_init__(self) -> None:
        for name in ("abs_threshold", "ratio_threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise MassiveLensError(f"Criterion.{name} must be a finite number >= 0, got {value!r}")
        if self.ratio_threshold < 1:
            raise MassiveLensError(
                f"Criterion.ratio_threshold={self.ratio_threshold} is below 1, which would call "
                "values smaller than the median massive; the paper uses 1000"
            )
        if self.abs_threshold == 0 and self.ratio_threshold <= 1:
            raise MassiveLensError("Criterion with both thresholds at their minimum marks everything massive")
        if self.median_over not in ("hidden_state", "token"):
            raise MassiveLensError(f"median_over must be 'hidden_state' or 'token', got {self.median_over!r}")


class _Reducer:
    """Hook functions that reduce each residual activation as soon as it is computed."""

    def __init__(self, batch: Batch, criterion: Criterion, k: int, entries: bool, kinds: Tensor | None):
        self.batch, self.criterion, self.k = batch, criterion, k
        self.want_entries = entries
        self.kinds = kinds  # [batch pos] token kind ids, for per-kind counts
        self.top: dict[int, Tensor] = {}  # layer -> [batch k]
        self.median: dict[int, Tensor] = {}  # layer -> [batch]
        self.entries: list[tuple[int, Tensor, Tensor, Tensor]] = []
        self.kind_hits: dict[int, Tensor] = {}  # layer -> [batch kinds+1 d_model] bool
        self.peak = 0.0

    def hook(self, layer: int):
        def reduce(resid: Float[Tensor, "batch pos d_model"], hook: Any) -> None:
            self._reduce(layer, resid.detach())

        return reduce

    def _reduce(self, layer: int, resid: Float[Tensor, "batch pos d_model"]) -> None:
        mask = self.batch.mask.to(resid.device)[..., None]
        mag = resid.abs().float().masked_fill(~mask, 0.0)
        if self.criterion.median_over == "hidden_state":
            median = mag.masked_fill(~mask, float("nan")).flatten(1).nanmedian(1).values
            scale = median[:, None, None]
        else:
            median = mag.masked_fill(~mask, float("nan")).nanmedian(-1).values  # [batch pos]
            scale = median[..., None]
            median = median.masked_fill(~self.batch.mask.to(resid.device), float("nan")).nanmedian(-1).values
        flat = mag.flatten(1)
        self.top[layer] = flat.topk(min(self.k, flat.shape[1]), dim=1).values.cpu()
        self.median[layer] = median.cpu()
        self.peak = max(self.peak, float(self.top[layer][:, 0].max()))
        massive = (mag > self.criterion.abs_threshold) & (mag > self.criterion.ratio_threshold * scale)
        if self.want_entries:
            idx = massive.nonzero()
            if len(idx):
                b, p, d = idx.unbind(1)
                ratio = mag[b, p, d] / scale.expand_as(mag)[b, p, d]
                self.entries.append((layer, idx.cpu(), resid[b, p, d].float().cpu(), ratio.cpu()))
        if self.kinds is not None:
            self.kind_hits[layer] = _kind_hits(massive, self.kinds.to(resid.device)).cpu()


def _kind_hits(massive: Bool[Tensor, "batch pos d_model"], kinds: Int[Tensor, "batch pos"]) -> Tensor:
    """[batch, kinds + first delimiter, d_model]: is the dim massive at a token of that kind?"""
    hits = [(massive & (kinds == c)[..., None]).any(1) for c in range(len(TOKEN_KINDS))]
    is_delim = kinds == TOKEN_KINDS.index("delimiter")
    first = is_delim.float().argmax(1)  # first delimiter position (0 when there is none)
    at_first = massive[torch.arange(len(kinds), device=kinds.device), first] & is_delim.any(1)[:, None]
    return torch.stack(hits + [at_first], 1)


def _run(view: ModelView, batch: Batch, criterion: Criterion, hook: str, layers: Sequence[int],
         k: int = 3, entries: bool = False, kinds: Tensor | None = None) -> _Reducer:
    if hook not in RESIDUAL_HOOKS:
        raise MassiveLensError(f"hook must be one of {RESIDUAL_HOOKS}, got {hook!r}")
    reducer = _Reducer(batch, criterion, k, entries, kinds)
    names = [view.hook_name(layer, hook) for layer in layers]
    hooks = [(name, reducer.hook(layer)) for name, layer in zip(names, layers, strict=True)]
    view.forward(batch, hooks, stop_after=names[-1])
    view.check_precision(reducer.peak, f"max |{hook}|")
    return reducer


def _layers(view: ModelView, layers: Sequence[int] | None) -> list[int]:
    chosen = sorted(set(range(view.n_layers) if layers is None else layers))
    if not chosen:
        raise MassiveLensError("layers is empty; pass None for all layers")
    for layer in chosen:
        view.hook_name(layer, "resid_post")  # range check with a clear message
    return chosen


# --------------------------------------------------------------------------- find_massive


@dataclass(frozen=True)
class MassiveActivations:
    """Every massive entry of a batch of texts. ``to_frame()`` columns: ``seq``, ``layer``,
    ``pos``, ``token``, ``token_kind``, ``dim``, ``value``, ``ratio``."""

    entries: pd.DataFrame
    profile: pd.DataFrame  # seq, layer, top1, median
    tokens: tuple[tuple[str, ...], ...]
    criterion: Criterion
    model_name: str
    hook: str

    @property
    def layers(self) -> list[int]:
        return sorted(self.entries["layer"].unique().tolist())

    @property
    def dims(self) -> list[int]:
        return sorted(self.entries["dim"].unique().tolist())

    @property
    def positions(self) -> list[int]:
        return sorted(self.entries["pos"].unique().tolist())

    def to_frame(self) -> pd.DataFrame:
        return self.entries.copy()

    def by_dim(self) -> pd.DataFrame:
        """One row per (seq, pos, dim): token, the layers it spans, peak value and ratio."""
        if self.entries.empty:
            return pd.DataFrame(columns=["seq", "pos", "dim", "token", "token_kind", "first_layer",
                                         "last_layer", "n_layers", "value", "ratio"])
        groups = self.entries.groupby(["seq", "pos", "dim"], sort=True)
        peak = self.entries.loc[groups["value"].apply(lambda v: v.abs().idxmax()).values]
        out = peak[["seq", "pos", "dim", "token", "token_kind", "value", "ratio"]].reset_index(drop=True)
        out.insert(5, "first_layer", groups["layer"].min().values)
        out.insert(6, "last_layer", groups["layer"].max().values)
        out.insert(7, "n_layers", groups["layer"].nunique().values)
        return out.sort_values("value", key=abs, ascending=False).reset_index(drop=True)

    def summary(self) -> str:
        c = self.criterion
        head = f"{self.model_name}, {self.hook}, |x| > {c.abs_threshold:g} and > {c.ratio_threshold:g}x median"
        rows = self.by_dim()
        if rows.empty:
            ratio = self.profile["top1"] / self.profile["median"]
            peak = self.profile.loc[ratio.idxmax()]
            return (f"{head}: no massive activations in {len(self.tokens)} text(s); largest "
                    f"top-1/median is {ratio.max():,.0f}x (|x| = {peak['top1']:,.1f}) at layer {int(peak['layer'])}")
        lines = [f"{head}: {len(rows)} massive (position, dim) pairs in layers {self.layers[0]}-{self.layers[-1]}"]
        for r in rows.head(8).itertuples():
            lines.append(f"  dim {r.dim} at {r.token!r} ({r.token_kind}, seq {r.seq} pos {r.pos}): layers "
                         f"{r.first_layer}-{r.last_layer}, peak {r.value:,.1f} ({r.ratio:,.0f}x median)")
        if len(rows) > 8:
            lines.append(f"  ... and {len(rows) - 8} more (see .by_dim())")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return f"<pre>{self.summary()}</pre>" + self.by_dim().head(20).to_html(index=False)

    def plot(self, ax: Any = None) -> Any:
        """Top-1 magnitude and median per layer (log scale), massive layers shaded."""
        from massive_lens.plots import profile_axes

        frame = self.profile.groupby("layer")[["top1", "median"]].mean().reset_index()
        return profile_axes(frame, ["top1", "median"], ax=ax, shade=self.layers,
                            title=f"{self.model_name}: residual magnitudes ({self.hook})")


def find_massive(
    model: Any,
    text_or_tokens: str | Sequence[str] | Tensor,
    criterion: Criterion | None = None,
    hook: str = "resid_post",
    prepend_bos: bool | None = None,
    layers: Sequence[int] | None = None,
) -> MassiveActivations:
    """Every massive activation of a text (or a padded batch of texts) in the residual stream.

    >>> from massive_lens import tiny_model
    >>> found = find_massive(tiny_model("gpt2"), ["Hello.", "Hi"], Criterion(1.0, 1.0))
    >>> sorted(found.to_frame().columns)
    ['dim', 'layer', 'pos', 'ratio', 'seq', 'token', 'token_kind', 'value']
    """
    view = ModelView(model)
    criterion = criterion or Criterion()
    batch = view.tokenize(text_or_tokens, prepend_bos)
    chosen = _layers(view, layers)
    reducer = _run(view, batch, criterion, hook, chosen, k=1, entries=True)
    tokens = view.str_tokens(batch)
    kinds = view.token_kinds(batch)
    rows = []
    for layer, idx, values, ratios in reducer.entries:
        for (b, p, d), value, ratio in zip(idx.tolist(), values.tolist(), ratios.tolist(), strict=True):
            rows.append((b, layer, p, tokens[b][p], TOKEN_KINDS[int(kinds[b, p])], d, value, ratio))
    entries = pd.DataFrame(rows, columns=["seq", "layer", "pos", "token", "token_kind", "dim", "value", "ratio"])
    profile = pd.DataFrame(
        [(b, layer, float(reducer.top[layer][b, 0]), float(reducer.median[layer][b]))
         for layer in chosen for b in range(len(tokens))],
        columns=["seq", "layer", "top1", "median"],
    )
    return MassiveActivations(entries, profile, tuple(map(tuple, tokens)), criterion, view.name, hook)


# --------------------------------------------------------------------------- layer_profile


@dataclass(frozen=True)
class LayerProfile:
    """Per layer: mean and std over sequences of the top-1..k magnitudes and the median.
    ``to_frame()`` columns: ``layer``, ``top1_mean``, ``top1_std``, ..., ``median_mean``,
    ``median_std``, ``ratio_mean`` (top-1 / median)."""

    frame: pd.DataFrame
    model_name: str
    n_sequences: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame
        peak = f.loc[f["ratio_mean"].idxmax()]
        return (f"{self.model_name}, {self.n_sequences} sequences: top-1 peaks at layer {int(peak.layer)} "
                f"with {peak.top1_mean:,.1f} ± {peak.top1_std:,.1f} ({peak.ratio_mean:,.0f}x the median "
                f"{peak.median_mean:.3g}); layer {int(f.layer.iloc[-1])} ends at {f.top1_mean.iloc[-1]:,.1f}")

    def _repr_html_(self) -> str:
        return f"<pre>{self.summary()}</pre>" + self.frame.to_html(index=False, float_format="{:,.3g}".format)

    def plot(self, ax: Any = None) -> Any:
        """The paper's layer-wise figure: top-k and median per layer, log scale, ±1 std."""
        from massive_lens.plots import profile_axes

        cols = [c[:-5] for c in self.frame.columns if c.endswith("_mean") and c != "ratio_mean"]
        return profile_axes(self.frame, cols, ax=ax, suffix="_mean", title=f"{self.model_name}: layer profile")


def _profile_frame(layers: list[int], k: int, s: dict[str, Tensor], n: int) -> pd.DataFrame:
    """From per-layer sums (``sum``, ``sq``: [layers, k+2] for top-k, median, ratio) to a frame."""
    mean = s["sum"] / n
    std = (s["sq"] / n - mean**2).clamp_min(0).sqrt()
    names = [f"top{i + 1}" for i in range(k)] + ["median", "ratio"]
    data: dict[str, Any] = {"layer": layers}
    for j, name in enumerate(names):
        data[f"{name}_mean"] = mean[:, j].numpy()
        data[f"{name}_std"] = std[:, j].numpy()
    return pd.DataFrame(data)


def _accumulate(reducer: _Reducer, layers: list[int], sums: dict[str, Tensor]) -> None:
    for i, layer in enumerate(layers):
        top, med = reducer.top[layer].double(), reducer.median[layer].double()
        stats = torch.cat([top, med[:, None], (top[:, 0] / med)[:, None]], 1)
        sums["sum"][i] += stats.sum(0)
        sums["sq"][i] += (stats**2).sum(0)


def layer_profile(
    model: Any, texts: str | Sequence[str], k: int = 3, batch_size: int = 8,
    prepend_bos: bool | None = None, hook: str = "resid_post",
) -> LayerProfile:
    """Top-1..k magnitudes and the median of each layer's hidden state, mean ± std over texts.

    >>> from massive_lens import tiny_model
    >>> layer_profile(tiny_model("llama"), ["One text.", "Two texts."]).to_frame().shape
    (4, 11)
    """
    if k < 1:
        raise MassiveLensError(f"k must be >= 1, got {k}")
    view = ModelView(model)
    texts = [texts] if isinstance(texts, str) else list(texts)
    layers = _layers(view, None)
    sums = {key: torch.zeros(len(layers), k + 2, dtype=torch.float64) for key in ("sum", "sq")}
    for start in range(0, len(texts), batch_size):
        batch = view.tokenize(texts[start : start + batch_size], prepend_bos)
        _accumulate(_run(view, batch, Criterion(), hook, layers, k=k), layers, sums)
    return LayerProfile(_profile_frame(layers, k, sums, len(texts)), view.name, len(texts))


# scan_corpus lives in massive_lens.scan (it builds on the reducer above); re-exported here.
from massive_lens.scan import CorpusScan, scan_corpus  # noqa: E402

__all__ = ["Criterion", "CorpusScan", "LayerProfile", "MassiveActivations", "find_massive", "layer_profile",
           "scan_corpus"]
