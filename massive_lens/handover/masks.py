"""Which positions to leave out of SAE training, in the shapes the SAE tools take.

SAELens (``exclude_special_tokens``), dictionary_learning (``max_activation_norm_multiple``)
and sparsify all drop the first token, or high-norm positions, from the activations they
train on: a position that carries a massive activation, or acts as an attention sink, has a
norm hundreds of times the typical one and a nearly input-independent direction, so it
dominates the reconstruction loss and kills features. Each tool rewrites a detector by hand;
:func:`exclusion_mask` hands them the library's own one.

A position is left out when

- it carries a **token-specific massive activation** at some layer (an entry of
  :func:`~massive_lens.find_massive` with ``scope == "token"``). Entries of *outlier
  dimensions* (a dim massive at most tokens of a layer, or a channel large at most tokens
  that passes the rule at a few, see :mod:`massive_lens.core.outliers`) mark no position by
  default, since they would mark ordinary tokens: they are a property of the dim, for
  :func:`~massive_lens.handover.massive_dims` to keep out of a direction
  (``outliers="include"`` marks their positions too). Which dims those are is decided once
  over all the texts given and every layer, so a spike at a few commas of one short text is
  judged against the channel's values in all of them;
- it is an **attention sink** of one of the chosen ``levels`` of
  :func:`~massive_lens.sink_census` (``"primary"``: the first token and every position the
  sink rule counts; ``"secondary"``; ``"transient"``). The census lists the positions that
  draw sink-like attention; one the sink rule counts only for its persistent massive
  activation (say, with too few later queries to be judged by attention) is left out as
  massive.

:func:`norm_thresholds` gives tools that filter by norm a norm-multiple threshold per layer,
calibrated on a corpus against the positions massive at that layer.

A tiny model whose BOS embedding carries 3,000 in dim 5 (so its residual stream does too):

>>> import torch
>>> from massive_lens import tiny_model
>>> model = tiny_model("llama")
>>> with torch.no_grad():
...     model.W_E[model.tokenizer.bos_token_id, 5] = 3000.0
>>> ex = exclusion_mask(model, ["Hello there, world.", "Hi."])
>>> ex.mask.shape == ex.tokens.shape, ex.to_frame()[["seq", "pos", "reason"]].values.tolist()
(True, [[0, 0, 'massive'], [1, 0, 'massive']])
>>> ex.token_ids() == [model.tokenizer.bos_token_id]
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from massive_lens.attention.census import LEVELS, sink_census
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import OUTLIER_CHOICES, Criterion, SinkRule, as_criterion
from massive_lens.core.fmt import pct
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.detect.find import RESIDUAL_HOOKS, find_in_batch, find_massive
from massive_lens.detect.scope import layer_span
from massive_lens.errors import MassiveLensError

COLUMNS = ["seq", "pos", "token", "token_kind", "reason", "massive", "level", "dim", "value", "n_layers"]


@dataclass(frozen=True, kw_only=True)
class ExclusionMask(Result):
    """The positions to leave out, and why.

    ``mask [batch pos]``: True where a position is left out; ``valid``: the real (non-pad)
    positions; ``tokens``: the token ids. ``to_frame()``: one row per left-out position:
    ``seq``, ``pos``, ``token``, ``token_kind``, ``reason`` (``"massive"``, ``"primary
    sink"``, ``"massive, primary sink"``, ...), ``massive`` (bool), ``level`` (the sink level,
    ``""`` if not a sink of a chosen level), ``dim``, ``value`` (its massive entry of largest
    ``|value|``; -1 and NaN if none), ``n_layers`` (layers where it is massive).
    """

    mask: Bool[Tensor, "batch pos"]
    valid: Bool[Tensor, "batch pos"]
    tokens: Int[Tensor, "batch pos"]
    frame: pd.DataFrame
    model_name: str
    levels: tuple[str, ...]
    outliers: str
    criterion: Criterion
    outlier_dims: tuple[int, ...] = ()  # the outlier dimensions found in these texts (any layer)

    @property
    def keep(self) -> Bool[Tensor, "batch pos"]:
        """The position mask for an activation store: True at the real positions to keep."""
        return self.valid & ~self.mask

    def token_ids(self, every: bool = True) -> list[int]:
        """Token ids for SAELens's ``exclude_special_tokens``.

        Args:
            every: only ids left out at *every* one of their occurrences in the texts given
                (the default: BOS, not a ``"."`` that is a sink once but ordinary elsewhere,
                which a token list would drop everywhere); False: every id left out anywhere.

        Returns:
            Sorted distinct token ids.
        """
        out = self.tokens[self.mask].unique()
        if every:
            out = out[[bool(self.mask[self.valid & (self.tokens == t)].all()) for t in out.tolist()]]
        return sorted(out.tolist())

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        n, total = int(self.mask.sum()), int(self.valid.sum())
        f = self.frame
        why = ", ".join(f"{reason} {count}" for reason, count in f["reason"].value_counts().items()) or "nothing"
        ids = self.token_ids()
        kinds = ", ".join(f"{k} {c}" for k, c in f["token_kind"].value_counts().items())
        return (f"{self.model_name}: {n} of {total} positions left out ({pct(n / max(total, 1))}; {kinds or 'none'}): "
                f"{why}. Sink levels {', '.join(self.levels) or 'none'}; {self._outlier_line()}. "
                f"Token ids left out at every occurrence: {ids}")

    def _outlier_line(self) -> str:
        if not self.outlier_dims:
            return "no outlier dim in these texts"
        dims = ", ".join(map(str, self.outlier_dims[:8])) + (" ..." if len(self.outlier_dims) > 8 else "")
        return (f"outlier dim{'s' if len(self.outlier_dims) > 1 else ''} {dims} {self.outliers}d (massive at most "
                "tokens of a layer, or a channel large at most tokens: not a token's)")

    def plot(self, ax: Any = None) -> Any:
        """The mask, sequences by positions (pads grey)."""
        ax = ensure_axes(ax, (7, 2 + 0.2 * len(self.mask)), layout=None)
        image = self.mask.float().masked_fill(~self.valid, 0.5)
        ax.pcolormesh(image.numpy(), cmap="Greys_r", vmin=0, vmax=1)
        ax.invert_yaxis()
        ax.set(xlabel="position", ylabel="sequence", title=f"{self.model_name}: positions left out (white)")
        return ax


def _levels(levels: Sequence[str]) -> tuple[str, ...]:
    chosen = (levels,) if isinstance(levels, str) else tuple(levels)
    wrong = [lv for lv in chosen if lv not in LEVELS]
    if wrong:
        raise MassiveLensError(f"levels must be sink levels of sink_census, some of {LEVELS} (or () for none), "
                               f"got {wrong[0]!r}")
    return chosen


def _parts(valid: Bool[Tensor, "batch pos"]) -> list[tuple[list[int], int]]:
    """(rows, length) groups that run as unpadded token tensors: the whole batch when nothing
    is padded, else one row at a time, cut to its length (so pads never reach a forward pass)."""
    if bool(valid.all()):
        return [(list(range(len(valid))), valid.shape[1])]
    return [([b], int(valid[b].sum())) for b in range(len(valid))]


def exclusion_mask(
    model: Any,
    text: str | Sequence[str] | Tensor,
    *,
    levels: str | Sequence[str] = ("primary",),
    outliers: str = "exclude",
    criterion: Criterion | None = None,
    rule: SinkRule | None = None,
    prepend_bos: bool | None = None,
) -> ExclusionMask:
    """The positions of ``text`` to leave out of SAE training or an activation store (see the
    module docstring): massive positions and attention sinks of the chosen levels.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (right-padded into one batch) or token ids
            ``[batch, pos]``.
        levels: the sink levels of :func:`~massive_lens.sink_census` to leave out
            (default ``("primary",)``; ``()`` for massive positions only).
        outliers: ``"exclude"`` (default): entries of outlier dimensions mark no position;
            ``"include"``: they do.
        criterion: when an activation is massive (None: ``Criterion()``).
        rule: the sink rule (None: ``SinkRule()``).
        prepend_bos: whether to prepend BOS to text (None: the model's default).

    Returns:
        An :class:`ExclusionMask`: ``.mask`` and ``.keep`` (bool ``[batch, pos]``),
        ``.token_ids()``, and a reason per left-out position in ``.to_frame()``.

    Raises:
        MassiveLensError: for an empty text, a vision model, an unknown level or ``outliers``
            value, or what :func:`~massive_lens.find_massive` refuses.

    >>> from massive_lens import tiny_model
    >>> model = tiny_model("llama")
    >>> ex = exclusion_mask(model, ["Hi.", "A longer text."], levels=())
    >>> int(ex.mask.sum()), ex.keep.sum().item() == ex.valid.sum().item()
    (0, True)
    """
    chosen = _levels(levels)
    if outliers not in OUTLIER_CHOICES:
        raise MassiveLensError(f"outliers must be one of {OUTLIER_CHOICES}, got {outliers!r}")
    criterion = as_criterion(criterion)
    view = ModelView(model)
    view.require_text()  # positions of text: a vision model has no token ids to hand over
    batch = view.tokenize(text, prepend_bos)
    kinds = view.token_kinds(batch)
    scopes = ("token",) if outliers == "exclude" else ("token", "outlier_dim")
    massive = torch.zeros_like(batch.mask)
    level = [[""] * batch.tokens.shape[1] for _ in range(len(batch.tokens))]
    top: dict[tuple[int, int], tuple[int, float, int, str]] = {}
    found = find_in_batch(view, batch, criterion, view.chosen_layers(None))  # one run: scopes decided over the batch
    strings = [list(t) for t in found.tokens]
    every = found.to_frame()
    entries = every[every["scope"].isin(scopes)]
    for (b, p), group in entries.groupby(["seq", "pos"]):
        massive[int(b), int(p)] = True
        peak = group.loc[group["value"].abs().idxmax()]
        top[(int(b), int(p))] = (int(peak["dim"]), float(peak["value"]), int(group["layer"].nunique()),
                                 "massive" if (group["scope"] == "token").any() else "massive (outlier dim)")
    for rows, length in _parts(batch.mask):
        ids = batch.tokens[rows, :length]
        if chosen:
            census = sink_census(model, ids, rule=rule, criterion=criterion).to_frame()
            for r in census[census["level"].isin(chosen)].itertuples():
                level[rows[int(r.seq)]][int(r.pos)] = r.level
    sinks = torch.tensor([[bool(x) for x in row] for row in level], dtype=torch.bool)
    mask = (massive | sinks) & batch.mask
    records = []
    for b, p in mask.nonzero().tolist():
        dim, value, n_layers, why = top.get((b, p), (-1, float("nan"), 0, ""))
        reason = ", ".join(([why] if why else []) + ([f"{level[b][p]} sink"] if level[b][p] else []))
        records.append((b, p, strings[b][p], TOKEN_KINDS[int(kinds[b, p])], reason, bool(massive[b, p]), level[b][p],
                        dim, value, n_layers))
    frame = pd.DataFrame(records, columns=COLUMNS)
    return ExclusionMask(mask=mask, valid=batch.mask.clone(), tokens=batch.tokens.clone(), frame=frame,
                         model_name=view.name, levels=chosen, outliers=outliers, criterion=criterion,
                         outlier_dims=tuple(sorted(int(d) for d in every.loc[every["scope"] == "outlier_dim", "dim"]
                                                   .unique())))


# --------------------------------------------------------------------------- norm thresholds


THRESHOLD_COLUMNS = ["layer", "median_norm", "n_massive", "kept_max", "massive_min", "threshold", "separates",
                     "caught"]


@dataclass(frozen=True, kw_only=True)
class NormThresholds(Result):
    """Per layer, a norm multiple that drops the positions massive at that layer.

    ``to_frame()``: ``layer``, ``median_norm`` (the median residual norm over the corpus's
    positions), ``n_massive`` (positions with a massive entry at that layer), ``kept_max``
    (the largest norm / median among the other positions), ``massive_min`` (the smallest
    among the massive ones; NaN if none), ``threshold`` (the multiple: positions with norm >
    threshold x median are dropped), ``separates`` (every massive position is above it and
    every other one below), ``caught`` (the share of massive positions above it; NaN if none).
    """

    frame: pd.DataFrame
    model_name: str
    hook: str
    n_seqs: int

    def multiple(self, layer: int) -> float:
        """The threshold at ``layer``, for dictionary_learning's ``max_activation_norm_multiple``.

        Args:
            layer: the layer whose activations the SAE trains on.

        Returns:
            The norm multiple (norm / median norm) above which a position is dropped.

        Raises:
            MassiveLensError: if the layer was not calibrated.
        """
        rows = self.frame[self.frame["layer"] == layer]
        if rows.empty:
            raise MassiveLensError(f"no threshold for layer {layer}; layers: {self.frame['layer'].tolist()}")
        return float(rows["threshold"].iloc[0])

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame
        with_massive = f[f["n_massive"] > 0]
        sep = f[f["separates"]]
        head = f"{self.model_name}, {self.hook}, {self.n_seqs} sequences: "
        if with_massive.empty:
            return head + "no position is massive at any layer; the thresholds drop nothing of this corpus"
        text = head + f"massive positions at {layer_span(with_massive['layer'])}; the norm separates them at "
        if sep.empty:
            return text + "no layer"
        mid = sep.iloc[len(sep) // 2]
        return (text + f"{layer_span(sep['layer'])}; e.g. layer {int(mid.layer)}: drop norm > {mid.threshold:,.1f}x "
                f"the median ({mid.median_norm:.3g}): the other positions reach {mid.kept_max:,.1f}x, the massive "
                f"ones start at {mid.massive_min:,.1f}x")

    def plot(self, ax: Any = None) -> Any:
        """Per layer: the largest kept multiple, the smallest massive one and the threshold (log scale)."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        for col in ("kept_max", "massive_min", "threshold"):
            ax.plot(self.frame["layer"], self.frame[col], marker="o", markersize=3, label=col)
        ax.set(yscale="log", xlabel="layer", ylabel="norm / median norm", title=f"{self.model_name}: norm multiples")
        ax.legend()
        return ax


def _keep_norm(x: Tensor, hook: Any, *, out: dict[int, Tensor], layer: int) -> None:
    out[layer] = x.detach().float().norm(dim=-1).cpu()


def norm_thresholds(
    model: Any,
    corpus: Corpus = None,
    *,
    seq_len: int = 128,
    n_seqs: int = 8,
    hook: str = "resid_post",
    outliers: str = "exclude",
    criterion: Criterion | None = None,
) -> NormThresholds:
    """A norm-multiple threshold per layer (like dictionary_learning's
    ``max_activation_norm_multiple``: drop positions whose norm exceeds the threshold times
    the median norm), calibrated on a corpus against the positions that
    :func:`~massive_lens.find_massive` finds massive *at that layer*.

    Where the massive positions' norms all lie above the others', the threshold is the
    geometric mean of the two edges; elsewhere it is the largest multiple of the other
    positions (it drops none of them on this corpus), and ``caught`` says how many massive
    positions it drops. A norm cannot catch a sink that draws attention without an outsized
    norm: :func:`exclusion_mask` can.

    Args:
        model: a TransformerLens-style model.
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor,
            or None for the offline default text.
        seq_len: tokens per sequence read from a text corpus.
        n_seqs: sequences read from a text corpus.
        hook: the residual hook (``resid_post``, ``resid_mid`` or ``resid_pre``).
        outliers: as for :func:`exclusion_mask`.
        criterion: as for :func:`exclusion_mask`.

    Returns:
        A :class:`NormThresholds`; ``.multiple(layer)`` is the value to pass on.

    Raises:
        MassiveLensError: if ``hook`` is not a residual hook, ``outliers`` is not a choice, or
            the corpus is too short.

    >>> from massive_lens import tiny_model
    >>> th = norm_thresholds(tiny_model("llama"), "Some text to read. " * 20, seq_len=16, n_seqs=2)
    >>> th.to_frame().columns.tolist()[:3], th.multiple(0) > 0
    (['layer', 'median_norm', 'n_massive'], True)
    """
    if hook not in RESIDUAL_HOOKS:
        raise MassiveLensError(f"hook must be one of {RESIDUAL_HOOKS}, got {hook!r}")
    if outliers not in OUTLIER_CHOICES:
        raise MassiveLensError(f"outliers must be one of {OUTLIER_CHOICES}, got {outliers!r}")
    view = ModelView(model)
    tokens = sequences(view, corpus, seq_len, n_seqs)
    entries = find_massive(model, tokens, criterion=as_criterion(criterion), hook=hook).to_frame()
    if outliers == "exclude":
        entries = entries[entries["scope"] == "token"]
    norms: dict[int, Tensor] = {}
    names = [view.hook_name(layer, hook) for layer in range(view.n_layers)]
    hooks = [(name, partial(_keep_norm, out=norms, layer=layer)) for layer, name in enumerate(names)]
    view.forward(view.full_batch(tokens), hooks, stop_after=names[-1])
    rows = []
    for layer in range(view.n_layers):
        massive = torch.zeros(tokens.shape, dtype=torch.bool)
        here = entries[entries["layer"] == layer]
        massive[here["seq"].tolist(), here["pos"].tolist()] = True
        median = float(norms[layer].median())
        multiple = norms[layer] / max(median, 1e-12)
        kept = float(multiple[~massive].max()) if bool((~massive).any()) else 0.0
        low = float(multiple[massive].min()) if bool(massive.any()) else float("nan")
        separates = low == low and low > kept
        threshold = (low * kept) ** 0.5 if separates else kept
        caught = float((multiple[massive] > threshold).float().mean()) if bool(massive.any()) else float("nan")
        rows.append((layer, median, int(massive.sum()), kept, low, threshold, separates, caught))
    return NormThresholds(frame=pd.DataFrame(rows, columns=THRESHOLD_COLUMNS), model_name=view.name, hook=hook,
                          n_seqs=len(tokens))
