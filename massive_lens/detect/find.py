"""Massive activations in one text (:func:`find_massive`) and per layer (:func:`layer_profile`).

In LLaMA2-7B a handful of massive activations sit on fixed dimensions (1415, 2533), on the
first token and the first strong delimiter, appear abruptly in one early layer and stay
nearly constant until the last layers. :func:`find_massive` lists every entry that meets the
:class:`~massive_lens.Criterion`; :func:`layer_profile` gives the per-layer top-k and median.

>>> from massive_lens import tiny_model
>>> found = find_massive(tiny_model("llama"), "A tiny model has none.")
>>> len(found.to_frame())
0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from torch import Tensor

from massive_lens.core.charts import profile_axes
from massive_lens.core.criterion import Criterion, as_criterion
from massive_lens.core.fmt import num
from massive_lens.core.model_view import ModelView
from massive_lens.core.reduce import ProfileSums, ResidualReducer
from massive_lens.core.results import Result
from massive_lens.core.tokens import TOKEN_KINDS, Batch
from massive_lens.detect.scope import layer_span, outlier_lines, outlier_table, scoped
from massive_lens.errors import MassiveLensError

RESIDUAL_HOOKS = ("resid_pre", "resid_mid", "resid_post")


def run_reducer(view: ModelView, batch: Batch, criterion: Criterion, hook: str, layers: Sequence[int],
                k: int = 1, entries: bool = False, kinds: Tensor | None = None) -> ResidualReducer:
    """One forward pass that reduces ``hook`` of each of ``layers`` in place, then stops."""
    if hook not in RESIDUAL_HOOKS:
        raise MassiveLensError(f"hook must be one of {RESIDUAL_HOOKS}, got {hook!r}")
    reducer = ResidualReducer(batch, criterion, k, entries, kinds)
    names = [view.hook_name(layer, hook) for layer in layers]
    hooks = [(name, reducer.hook(layer)) for name, layer in zip(names, layers, strict=True)]
    view.forward(batch, hooks, stop_after=names[-1])
    view.check_precision(reducer.peak, f"max |{hook}|")
    return reducer


# --------------------------------------------------------------------------- find_massive


_BY_DIM = ["seq", "pos", "dim", "token", "token_kind", "scope", "first_layer", "last_layer", "n_layers",
           "peak_layer", "value", "ratio"]


@dataclass(frozen=True, kw_only=True)
class MassiveActivations(Result):
    """Every massive entry of a batch of texts. ``to_frame()`` columns: ``seq``, ``layer``,
    ``pos``, ``token``, ``token_kind``, ``dim``, ``value``, ``ratio``, ``scope``
    (``"token"``: a token-specific massive activation; ``"outlier_dim"``: the dim is an outlier
    dimension, massive at most tokens of some layer of these texts, and spread over several
    tokens at this one; the rule is :class:`~massive_lens.core.criterion.OutlierTally`).
    ``magnitudes`` has the top-1 and median ``|value|`` per (``seq``, ``layer``); ``profile``
    is their per-layer table in :class:`LayerProfile`'s columns, as ``CorpusScan.profile``.
    ``outliers`` lists the outlier dimensions per (``seq``, ``layer``, ``dim``) with the
    ``share`` of that sequence's tokens where the dim is massive."""

    entries: pd.DataFrame
    magnitudes: pd.DataFrame  # seq, layer, top1, median
    tokens: tuple[tuple[str, ...], ...]
    criterion: Criterion
    model_name: str
    hook: str
    outliers: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["seq", "layer", "dim", "share"]))

    @classmethod
    def _from_stored(cls, fields: dict[str, Any]) -> MassiveActivations:
        """Results saved before ``magnitudes`` was named so stored it as ``profile``."""
        if "magnitudes" not in fields and "profile" in fields:
            fields = {("magnitudes" if k == "profile" else k): v for k, v in fields.items()}
        return super()._from_stored(fields)

    @property
    def profile(self) -> pd.DataFrame:
        """Per layer, mean and std over sequences (``ddof=0``) of top-1, median and top-1 / median:
        ``layer``, ``top1_mean``, ``top1_std``, ``median_mean``, ``median_std``, ``ratio_mean``,
        ``ratio_std`` (the columns of :class:`LayerProfile` with ``k=1``)."""
        stats = self.magnitudes.assign(ratio=self.magnitudes["top1"] / self.magnitudes["median"])
        groups = stats.groupby("layer")[["top1", "median", "ratio"]]
        mean, std = groups.mean(), groups.std(ddof=0)
        data: dict[str, Any] = {"layer": mean.index.to_numpy()}
        for name in ("top1", "median", "ratio"):
            data[f"{name}_mean"], data[f"{name}_std"] = mean[name].to_numpy(), std[name].to_numpy()
        return pd.DataFrame(data)

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers with at least one massive entry."""
        return tuple(sorted(self.entries["layer"].unique().tolist()))

    @property
    def dims(self) -> tuple[int, ...]:
        """Dimensions that are massive somewhere."""
        return tuple(sorted(self.entries["dim"].unique().tolist()))

    @property
    def positions(self) -> tuple[int, ...]:
        """Positions that are massive somewhere (in any sequence)."""
        return tuple(sorted(self.entries["pos"].unique().tolist()))

    @property
    def peak_layer(self) -> int:
        """The layer where top-1 / median is largest (over sequences and layers)."""
        prof = self.magnitudes
        return int(prof.loc[(prof["top1"] / prof["median"]).idxmax(), "layer"])

    @property
    def headline(self) -> pd.Series | None:
        """The headline activation: the token-specific entry of largest ``|value|`` (an outlier
        dimension's entry only when nothing is token-specific); None when nothing is massive."""
        rows = self.by_dim()
        return None if rows.empty else rows.iloc[0]

    @property
    def headline_layer(self) -> int:
        """The layer of the headline activation's largest ``|value|``; without one, the layer of
        the largest top-1 ``|value|``. Figures of one layer default to it."""
        top = self.headline
        if top is not None:
            return int(top.peak_layer)
        return int(self.magnitudes.loc[self.magnitudes["top1"].idxmax(), "layer"])

    def to_frame(self) -> pd.DataFrame:
        return scoped(self.entries)

    def by_dim(self) -> pd.DataFrame:
        """One row per (seq, pos, dim, scope): token, the layers it spans, peak value and ratio.

        An entry that is token-specific at some layers and part of an outlier dimension at
        others gives one row of each scope.

        Returns:
            A DataFrame with columns ``seq``, ``pos``, ``dim``, ``token``, ``token_kind``,
            ``scope``, ``first_layer``, ``last_layer``, ``n_layers``, ``peak_layer``, ``value``
            (the signed value of largest magnitude over those layers) and ``ratio`` (there);
            token-specific rows first, each scope largest ``|value|`` first; empty, with these
            columns, when nothing is massive.
        """
        entries = scoped(self.entries)
        if entries.empty:
            return pd.DataFrame(columns=_BY_DIM)
        groups = entries.groupby(["seq", "pos", "dim", "scope"], sort=True)
        peak = entries.loc[groups["value"].apply(lambda v: v.abs().idxmax()).values]
        out = peak[["seq", "pos", "dim", "token", "token_kind", "scope", "value", "ratio"]].reset_index(drop=True)
        out.insert(6, "first_layer", groups["layer"].min().values)
        out.insert(7, "last_layer", groups["layer"].max().values)
        out.insert(8, "n_layers", groups["layer"].nunique().values)
        out.insert(9, "peak_layer", peak["layer"].values)
        key = out.assign(_outlier=out.scope != "token", _size=-out.value.abs())
        return out.loc[key.sort_values(["_outlier", "_size"], kind="stable").index].reset_index(drop=True)

    def outlier_dims(self) -> pd.DataFrame:
        """One row per outlier dimension: ``dim``, ``layers`` (where it is one, in any sequence),
        ``first_layer``, ``last_layer``, ``share`` (mean share of tokens where it is massive
        there), ``seqs`` (sequences) and ``value`` (its largest ``|value|`` there, signed);
        largest ``share`` first."""
        return outlier_table(self.outliers, scoped(self.entries))

    def summary(self) -> str:
        c = self.criterion
        head = f"{self.model_name}, {self.hook}, |x| > {c.abs_threshold:g} and > {c.ratio_threshold:g}x median"
        rows = self.by_dim()
        token = rows[rows.scope == "token"]
        outliers = outlier_lines(self.outlier_dims())
        if rows.empty:
            ratio = self.magnitudes["top1"] / self.magnitudes["median"]
            peak = self.magnitudes.loc[ratio.idxmax()]
            return (f"{head}: no massive activations in {len(self.tokens)} text(s); largest "
                    f"top-1/median is {ratio.max():,.0f}x (|x| = {peak['top1']:,.1f}) at layer {int(peak['layer'])}")
        if token.empty:
            lines = [f"{head}: no token-specific massive activations in {len(self.tokens)} text(s)"]
        else:
            top = token.iloc[0]
            span = layer_span(sorted(scoped(self.entries).query("scope == 'token'").layer.unique()))
            pairs = "pair" if len(token) == 1 else "pairs"
            lines = [f"{head}: {len(token)} token-specific massive (position, dim) {pairs} in {span}; the largest is "
                     f"{num(top.value)} (dim {top.dim} at {top.token!r}, pos {top.pos}) at layer {top.peak_layer}"]
        for r in token.head(8).itertuples():
            lines.append(f"  dim {r.dim} at {r.token!r} ({r.token_kind}, seq {r.seq} pos {r.pos}): layers "
                         f"{r.first_layer}-{r.last_layer}, peak {r.value:,.1f} at layer {r.peak_layer} "
                         f"({r.ratio:,.0f}x median)")
        if len(token) > 8:
            lines.append(f"  ... and {len(token) - 8} more (see .by_dim())")
        return "\n".join(lines + outliers)

    def plot(self, ax: Any = None) -> Any:
        """Top-1 magnitude and median per layer (log scale), massive layers shaded."""
        frame = self.magnitudes.groupby("layer")[["top1", "median"]].mean().reset_index()
        return profile_axes(frame, ["top1", "median"], ax=ax, shade=self.layers,
                            title=f"{self.model_name}: residual magnitudes ({self.hook})")


def find_massive(
    model: Any,
    text: str | Sequence[str] | Tensor,
    *,
    criterion: Criterion | None = None,
    layers: int | Sequence[int] | None = None,
    hook: str = "resid_post",
    prepend_bos: bool | None = None,
) -> MassiveActivations:
    """Every massive activation of a text (or a padded batch of texts) in the residual stream.

    Args:
        model: a TransformerLens-style model (see :func:`massive_lens.load_model`).
        text: a string, a list of strings (right-padded into one batch; pads are never
            massive) or token ids (``[pos]`` or ``[batch, pos]``); for a vision model,
            ``pixel_values`` (``[batch, channels, height, width]``, see ``docs/vision.md``).
        criterion: when a value is massive (None: ``Criterion()``, Sun et al.'s 100 and
            1000x the median).
        layers: a layer or layers to read (None: all); duplicates are dropped and the
            forward pass stops after the last one.
        hook: the residual hook, ``resid_post`` (default), ``resid_mid`` or ``resid_pre``.
        prepend_bos: whether to prepend BOS to text input (None: the model's default);
            ignored for token ids.

    Returns:
        A :class:`MassiveActivations` with one row per massive (seq, layer, pos, dim), the
        per-layer top-1 and median of every sequence, and the token strings.

    Raises:
        MassiveLensError: if ``model`` is not a TransformerLens model, ``text`` is empty,
            longer than the model's context or holds out-of-vocabulary ids, ``layers`` is
            empty or out of range, ``hook`` is not a residual hook, or a half-precision
            model overflows.

    >>> from massive_lens import tiny_model
    >>> found = find_massive(tiny_model("gpt2"), ["Hello.", "Hi"], criterion=Criterion(1.0, 1.0))
    >>> sorted(found.to_frame().columns)
    ['dim', 'layer', 'pos', 'ratio', 'scope', 'seq', 'token', 'token_kind', 'value']
    """
    view = ModelView(model)
    criterion = as_criterion(criterion)
    batch = view.tokenize(text, prepend_bos)
    return find_in_batch(view, batch, criterion, view.chosen_layers(layers), hook)


def find_in_batch(view: ModelView, batch: Batch, criterion: Criterion, layers: Sequence[int],
                  hook: str = "resid_post") -> MassiveActivations:
    """:func:`find_massive` on a view and batch already built, ``layers`` already chosen (see
    :meth:`ModelView.chosen_layers`): the door other analyses use, so they never re-wrap the model."""
    reducer = run_reducer(view, batch, criterion, hook, layers, k=1, entries=True)
    tokens = view.str_tokens(batch)
    kinds = view.token_kinds(batch)
    rows = []
    for layer, idx, values, ratios, scopes in reducer.scoped_entries():
        for (b, p, d), value, ratio, scope in zip(idx.tolist(), values.tolist(), ratios.tolist(), scopes, strict=True):
            rows.append((b, layer, p, tokens[b][p], TOKEN_KINDS[int(kinds[b, p])], d, value, ratio, scope))
    entries = pd.DataFrame(rows, columns=["seq", "layer", "pos", "token", "token_kind", "dim", "value", "ratio",
                                          "scope"])
    outliers = pd.DataFrame([(b, layer, d, float(reducer.share[layer][b, d]))
                             for layer in layers for b, d in reducer.outlier[layer].nonzero().tolist()],
                            columns=["seq", "layer", "dim", "share"])
    magnitudes = pd.DataFrame(
        [(b, layer, float(reducer.top[layer][b, 0]), float(reducer.median[layer][b]))
         for layer in layers for b in range(len(tokens))],
        columns=["seq", "layer", "top1", "median"],
    )
    return MassiveActivations(entries=entries, magnitudes=magnitudes, tokens=tuple(map(tuple, tokens)),
                              criterion=criterion, model_name=view.name, hook=hook, outliers=outliers)


# --------------------------------------------------------------------------- layer_profile


@dataclass(frozen=True, kw_only=True)
class LayerProfile(Result):
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
        top = f.loc[f["top1_mean"].idxmax()]
        by_ratio = f.loc[f["ratio_mean"].idxmax()]
        text = (f"{self.model_name}, {self.n_sequences} sequences: top-1 is largest at layer {int(top.layer)} "
                f"with {top.top1_mean:,.1f} ± {top.top1_std:,.1f} ({top.ratio_mean:,.0f}x the median "
                f"{top.median_mean:.3g})")
        if int(by_ratio.layer) != int(top.layer):
            text += (f"; top-1/median peaks at layer {int(by_ratio.layer)} ({by_ratio.ratio_mean:,.0f}x, top-1 "
                     f"{by_ratio.top1_mean:,.1f})")
        return text + f"; layer {int(f.layer.iloc[-1])} ends at {f.top1_mean.iloc[-1]:,.1f}"

    def plot(self, ax: Any = None) -> Any:
        """The paper's layer-wise figure: top-k and median per layer, log scale, ±1 std."""
        cols = [c[:-5] for c in self.frame.columns if c.endswith("_mean") and c != "ratio_mean"]
        return profile_axes(self.frame, cols, ax=ax, suffix="_mean", title=f"{self.model_name}: layer profile")


def layer_profile(
    model: Any, text: str | Sequence[str] | Tensor, *, k: int = 3, batch_size: int = 8,
    prepend_bos: bool | None = None, hook: str = "resid_post",
) -> LayerProfile:
    """Top-1..k magnitudes and the median of each layer's hidden state, mean ± std over texts.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings or a ``[batch, pos]`` token tensor; each string
            (or row) is one sequence of the mean and std. For a vision model, ``pixel_values``
            (each image is one sequence).
        k: how many of the largest magnitudes to keep per layer (default 3).
        batch_size: texts per forward pass (default 8).
        prepend_bos: whether to prepend BOS to text input (None: the model's default).
        hook: the residual hook, ``resid_post`` (default), ``resid_mid`` or ``resid_pre``.

    Returns:
        A :class:`LayerProfile` (one row per layer: ``top1_mean``, ``top1_std``, ...,
        ``median_mean``, ``median_std``, ``ratio_mean``, ``ratio_std``).

    Raises:
        MassiveLensError: if ``k`` or ``batch_size`` is below 1, there are no texts, a text
            is empty or too long, ``hook`` is not a residual hook, or ``model`` is not a
            TransformerLens model.

    >>> from massive_lens import tiny_model
    >>> layer_profile(tiny_model("llama"), ["One text.", "Two texts."]).to_frame().shape
    (4, 11)
    """
    if k < 1 or batch_size < 1:
        raise MassiveLensError(f"k and batch_size must be >= 1, got k={k}, batch_size={batch_size}")
    view = ModelView(model)
    texts = [text] if isinstance(text, str) else (text if isinstance(text, Tensor) else list(text))
    if len(texts) == 0:
        raise MassiveLensError("layer_profile got no texts; pass at least one string")
    layers = view.chosen_layers(None)
    sums = ProfileSums(layers, k)
    if isinstance(text, Tensor):  # token ids or images: one batch, cut into passes
        batches = view.tokenize(text, prepend_bos).split(batch_size)
    else:
        batches = (view.tokenize(texts[start : start + batch_size], prepend_bos)
                   for start in range(0, len(texts), batch_size))
    for batch in batches:
        sums.add(run_reducer(view, batch, Criterion(), hook, layers, k=k))
    return LayerProfile(frame=sums.frame(), model_name=view.name, n_sequences=sums.n)
