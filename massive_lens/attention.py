"""Attention sinks as a fixed bias.

Tokens that carry massive activations attract most of the attention (the *attention
sink*). After the layer norm their hidden states are nearly identical sparse vectors, so
their keys and values barely depend on the input. Sun et al. (2024, section 4.2) split the
attention output of a head at query ``q`` with sink set C as

    sum_{i in C} p_qi v_i   +   sum_{i not in C} p_qi v_i
    (sink term)                 (content term)

and observe that the sink term is nearly the same vector at every query and for every
input: an implicit attention bias. This module measures both halves:

- :func:`sink_attention`: per layer and head, the attention mass queries put on the sink
  positions, and the sink metric of Gu et al. (2024): the share of heads whose mean
  attention to the first token (over the first 64 queries) exceeds a threshold (0.3);
- :func:`decompose_attention`: the two terms per layer, head and query position, mapped
  through ``W_O`` into the residual stream (``b_O`` kept separate), so that
  sink + content + b_O reconstructs the attention output exactly; and how constant each
  term is (relative standard deviation and mean pairwise cosine, across query positions
  and across texts). Grouped-query attention (query head h reads kv head
  ``h // (n_heads // n_kv_heads)``) and value biases (inside ``v``) are handled.

The sinks default to the positions that act as sinks (:func:`find_sinks`, the rule of
:class:`~massive_lens.core.criterion.SinkRule`): they draw attention from a large share of
heads, or carry a massive activation that persists across layers; a dim that crosses the
massive criterion at one early layer does not make its positions sinks. A sequence with
none falls back to its first token. Every result says which positions it treated as sinks
(:class:`SinkSet`: count per sequence and token kinds). On models with a post-attention norm
(Gemma 2/3) the decomposed output is the one *before* that norm
(``blocks.{l}.attn.hook_out``), since the norm is not linear; the summary says so. Where the
output projection has its own hook (``attn.o.hook_out``: exactly ``z @ W_O + b_O``) that is
the output decomposed, so an attention module that adds the residual itself (BLOOM) splits
too. The split is checked: an attention whose output sink + content + b_O does not
reconstruct (a norm between the heads and ``W_O``, a gated output, latent attention) raises a
``MassiveLensError`` instead of returning numbers.

>>> from massive_lens import tiny_model
>>> result = decompose_attention(tiny_model("llama"), ["Hello there.", "Bye now!"])
>>> result.reconstruction_error < 1e-4
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core.criterion import (
    SINK_THRESHOLD,
    Criterion,
    SinkEvidence,
    SinkRule,
    first_token_mass,
    sink_metric,
)
from massive_lens.core.model_view import TOKEN_KINDS, Batch, ModelView
from massive_lens.core.render import sink_content_axes, sink_mass_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

Sinks = Sequence[int] | Tensor | None
_EXCLUDED = "constancy statistics exclude the sink query positions (a sink attends to itself)"


def sink_term(pattern: Float[Tensor, "batch head_index query_pos key_pos"],
              v: Float[Tensor, "batch key_pos kv_head d_head"],
              keys: Bool[Tensor, "batch key_pos"]) -> Float[Tensor, "batch query_pos head_index d_head"]:
    """``sum_{i in keys} p_qi v_i`` per query head; a kv head serves ``n_heads // n_kv`` heads.

    >>> p = torch.full((1, 2, 3, 3), 1 / 3)
    >>> sink_term(p, torch.ones(1, 3, 1, 4), torch.tensor([[True, False, False]]))[0, 0, 0]
    tensor([0.3333, 0.3333, 0.3333, 0.3333])
    """
    group = pattern.shape[1] // v.shape[2]
    return torch.einsum("bhqk,bkhd->bqhd", pattern * keys[:, None, None, :].to(pattern.dtype),
                        v.repeat_interleave(group, dim=2))


FOUND = "positions with massive activations that persist across layers, or that draw attention as sinks"


@dataclass(frozen=True)
class SinkSet:
    """The positions an analysis or intervention treated as sinks, and why.

    ``mask [batch pos]``; ``kinds [batch pos]`` indexes ``TOKEN_KINDS`` (``bos``, ``first``,
    ``delimiter``, ``other``); ``by_attention``/``by_massive``: which sinks the rule found by
    the attention they draw and by a persistent massive activation (None when the sinks were
    given); ``source``: how they were chosen.

    >>> s = SinkSet(torch.tensor([[True, False], [True, True]]), torch.tensor([[0, 3], [0, 2]]), "given")
    >>> s.describe()
    '1-2 per sequence (mean 1.5): bos 2, delimiter 1'
    """

    mask: Bool[Tensor, "batch pos"]
    kinds: Int[Tensor, "batch pos"]
    source: str
    by_attention: Bool[Tensor, "batch pos"] | None = None
    by_massive: Bool[Tensor, "batch pos"] | None = None

    @property
    def per_seq(self) -> Int[Tensor, " batch"]:
        """Number of sink positions in each sequence."""
        return self.mask.sum(-1)

    @property
    def kind_counts(self) -> dict[str, int]:
        """Sink positions of each token kind (kinds with none left out)."""
        counts = torch.bincount(self.kinds[self.mask].flatten(), minlength=len(TOKEN_KINDS)).tolist()
        return {kind: n for kind, n in zip(TOKEN_KINDS, counts, strict=True) if n}

    @property
    def kinds_text(self) -> str:
        """``"bos 8, delimiter 2"``: the token kinds of the sinks, with counts."""
        return ", ".join(f"{k} {n}" for k, n in self.kind_counts.items()) or "none"

    def describe(self) -> str:
        """One line: how many sinks per sequence, and their token kinds."""
        n = self.per_seq.float()
        if not len(n):
            return "no sequences"
        low, high = int(n.min()), int(n.max())
        count = f"{low} per sequence" if low == high else f"{low}-{high} per sequence (mean {float(n.mean()):.3g})"
        return f"{count}: {self.kinds_text}"

    def to_frame(self) -> pd.DataFrame:
        """One row per sink: ``seq``, ``pos``, ``token_kind``, ``by_attention``, ``by_massive``."""
        seq, pos = self.mask.nonzero(as_tuple=True)
        frame = pd.DataFrame({"seq": seq.tolist(), "pos": pos.tolist(),
                              "token_kind": [TOKEN_KINDS[int(k)] for k in self.kinds[seq, pos]]})
        for name in ("by_attention", "by_massive"):
            flags = getattr(self, name)
            frame[name] = flags[seq, pos].tolist() if flags is not None else None
        return frame


def token_kinds(view: ModelView, batch: Batch) -> Int[Tensor, "batch pos"]:
    """``ModelView.token_kinds``, or (a model without a tokenizer) only bos/first and other."""
    try:
        return view.token_kinds(batch)
    except MassiveLensError:
        kinds = torch.full_like(batch.tokens, TOKEN_KINDS.index("other"))
        kinds[:, 0] = TOKEN_KINDS.index("bos" if batch.has_bos else "first")
        return kinds


def sink_hooks(view: ModelView, evidence: SinkEvidence) -> list[tuple[str, Any]]:
    """Hooks that feed ``evidence`` every layer's residual stream and attention pattern (layers
    without an attention pattern, as in recurrent or hybrid models, give only the former)."""
    hooks = []
    for layer in range(view.n_layers):
        if f"blocks.{layer}.attn.hook_pattern" in view.hook_names:
            hooks.append((view.hook_name(layer, "attn.hook_pattern"), partial(_add_pattern, evidence=evidence)))
        hooks.append((view.hook_name(layer, "resid_post"), partial(_add_resid, evidence=evidence, layer=layer)))
    return hooks


def _add_pattern(pattern: Tensor, hook: Any, *, evidence: SinkEvidence) -> None:
    evidence.add_pattern(pattern)


def _add_resid(resid: Tensor, hook: Any, *, evidence: SinkEvidence, layer: int) -> None:
    evidence.add_resid(layer, resid)


def sinks_from(evidence: SinkEvidence, kinds: Int[Tensor, "batch pos"]) -> SinkSet:
    """The :class:`SinkSet` the rule gives, each sequence without one falling back to its first token."""
    mask = evidence.mask()
    none = ~mask.any(-1)
    source = FOUND
    if bool(none.any()):
        mask = mask.clone()
        mask[none, 0] = True
        source += f"; the first token in {int(none.sum())} sequence(s) with none"
    return SinkSet(mask, kinds, source, evidence.by_attention, evidence.by_massive)


def find_sinks(model: Any, text: str | Sequence[str] | Tensor, *, rule: SinkRule | None = None,
               criterion: Criterion | None = None) -> SinkSet:
    """The positions of ``text`` that act as attention sinks (one forward pass).

    A position is a sink when a large share of heads put most of their attention on it, or
    when it carries a massive activation that persists across layers (see
    :class:`~massive_lens.core.criterion.SinkRule`); a sequence with none falls back to its
    first token.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor.
        rule: the sink rule (None: ``SinkRule()``).
        criterion: when an activation is massive (None: ``Criterion()``).

    Returns:
        A :class:`SinkSet`.

    >>> from massive_lens import tiny_model
    >>> find_sinks(tiny_model("llama"), "Hello there, world.").describe()
    '1 per sequence: bos 1'
    """
    view = ModelView(model)
    batch = view.tokenize(text)
    return sinks_of(view, batch, rule, criterion)


def sinks_of(view: ModelView, batch: Batch, rule: SinkRule | None = None, criterion: Criterion | None = None
             ) -> SinkSet:
    """The sinks of an already tokenized ``batch`` (what :func:`find_sinks` does after tokenizing)."""
    evidence = SinkEvidence(batch.mask, view.n_layers, rule, criterion)
    hooks = sink_hooks(view, evidence)
    view.forward(batch, hooks, stop_after=hooks[-1][0])
    return sinks_from(evidence, token_kinds(view, batch))


def post_attention_norm(model: Any) -> bool:
    """Whether the model normalizes each attention output before adding it (Gemma 2/3)."""
    return any(name.startswith("blocks.0.ln1_post.") for name in model.hook_dict)


def _sink_mask(model: Any, batch: Batch, inputs: Any, sinks: Sinks) -> SinkSet:
    view = ModelView(model)
    n, pos = batch.tokens.shape
    mask = torch.zeros(n, pos, dtype=torch.bool)
    if isinstance(sinks, Tensor):
        if sinks.dtype != torch.bool or tuple(sinks.shape) != (n, pos):
            raise MassiveLensError(f"a sinks tensor must be bool [batch, pos] = {[n, pos]}, got "
                                   f"{sinks.dtype} {list(sinks.shape)}; or pass a list of positions")
        return SinkSet(sinks.cpu() & batch.mask, token_kinds(view, batch), "given mask")
    if sinks is None:
        return sinks_of(view, batch)
    positions = list(sinks)
    if not positions or any(not 0 <= int(p) < pos for p in positions):
        raise MassiveLensError(f"sink positions {positions} must be non-empty and within 0..{pos - 1}")
    mask[:, positions] = True
    return SinkSet(mask & batch.mask, token_kinds(view, batch), f"positions {positions}")


# --------------------------------------------------------------------------- sink_attention


@dataclass(frozen=True)
class SinkAttention(Result):
    """Per layer and head: ``sink_mass`` (mean attention of non-sink queries to the sinks)
    and ``first_token_mass`` (mean attention of the first 64 queries to the first token, Gu et al.).
    ``to_frame()`` columns: ``layer``, ``head``, ``sink_mass``, ``first_token_mass``."""

    frame: pd.DataFrame
    threshold: float
    sink_source: str
    model_name: str
    n_texts: int
    sinks: SinkSet | None = None  # the positions treated as sinks

    @property
    def sink_metric(self) -> float:
        """Share of heads whose mean attention to the first token exceeds ``threshold``."""
        return sink_metric(torch.tensor(self.frame["first_token_mass"].to_numpy()), self.threshold)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        per_layer = self.frame.groupby("layer")["sink_mass"].mean()
        top = per_layer.sort_values(ascending=False).head(3)
        treated = f" ({self.sinks.describe()})" if self.sinks is not None else ""
        return (f"{self.model_name}, {self.n_texts} text(s), sinks = {self.sink_source}{treated}: sink metric "
                f"{self.sink_metric:.0%} of heads put > {self.threshold:g} of their attention on the "
                f"first token; mean sink mass over all heads {self.frame['sink_mass'].mean():.2f}; "
                "highest layers " + ", ".join(f"{int(k)} ({v:.2f})" for k, v in top.items()))

    def plot(self, ax: Any = None) -> Any:
        """Sink mass per layer: mean over heads, with the min-max range of heads."""
        return sink_mass_axes(self.frame, threshold=self.threshold, ax=ax,
                              title=f"{self.model_name}: attention to sinks")


def sink_attention(model: Any, text: str | Sequence[str] | Tensor, *, sinks: Sinks = None,
                   threshold: float = SINK_THRESHOLD) -> SinkAttention:
    """Attention mass on the sink positions per layer and head, and the sink metric.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor.
        sinks: sink positions (a list of ints, the same for every sequence, or a bool
            ``[batch, pos]`` mask); None: the positions that act as sinks (:func:`find_sinks`:
            they draw attention from many heads or carry a persistent massive activation),
            else the first token.
        threshold: the sink metric's attention share, in (0, 1) (default 0.3, Gu et al.).

    Returns:
        A :class:`SinkAttention` (one row per layer and head) with its ``sink_metric`` and
        the positions it treated as sinks (``.sinks``).

    Raises:
        MassiveLensError: if ``threshold`` is not in (0, 1), ``sinks`` is an empty list, a
            position outside the text or a mask of the wrong dtype or shape, ``text`` is
            empty or too long, or ``model`` is not a TransformerLens model.

    >>> from massive_lens import tiny_model
    >>> result = sink_attention(tiny_model("gpt2"), "Hello world.", sinks=[0])
    >>> list(result.to_frame().columns), 0 <= result.sink_metric <= 1
    (['layer', 'head', 'sink_mass', 'first_token_mass'], True)
    """
    if not 0 < threshold < 1:
        raise MassiveLensError(f"threshold is an attention share in (0, 1), got {threshold}")
    view = ModelView(model)
    batch = view.tokenize(text)
    found = _sink_mask(model, batch, text, sinks)
    mask, source = found.mask, found.source
    valid = batch.mask.float()
    queries = valid * (~mask).float()
    rows: list[Tensor] = []

    def reduce(pattern: Tensor, hook: Any, layer: int) -> None:
        p = pattern.float().cpu()
        sink = torch.einsum("bhqk,bk,bq->h", p, mask.float(), queries) / queries.sum().clamp(min=1)
        first = first_token_mass(p, batch.mask)
        rows.append(torch.stack([torch.full_like(sink, layer), torch.arange(len(sink)).float(), sink, first], 1))

    names = [view.hook_name(layer, "attn.hook_pattern") for layer in range(view.n_layers)]
    view.forward(batch, [(n, partial(reduce, layer=i)) for i, n in enumerate(names)], stop_after=names[-1])
    frame = pd.DataFrame(torch.cat(rows).numpy(), columns=["layer", "head", "sink_mass", "first_token_mass"])
    frame[["layer", "head"]] = frame[["layer", "head"]].astype(int)
    return SinkAttention(frame, threshold, source, view.name, len(batch.tokens), found)


# --------------------------------------------------------------------------- decompose_attention


@dataclass(frozen=True)
class AttentionDecomposition(Result):
    """Sink and content terms of the attention output, in the residual stream.

    ``sink``/``content``: ``[layer, batch, pos, d_model]`` (summed over heads), ``bias``:
    ``[layer, d_model]`` (``b_O``, zeros when absent), for the layers in ``layers``.
    ``to_frame()``: one row per (``layer``, ``head``, ``term``) with ``norm`` (mean vector
    norm), ``rel_std_pos``/``cos_pos`` (spread and mean pairwise cosine across query
    positions of one text, averaged over texts), ``rel_std_text``/``cos_text`` (the same
    across the per-text mean vectors; NaN for one text). Sink query positions are excluded.
    """

    frame: pd.DataFrame
    errors: pd.DataFrame  # layer, rel_error
    layers: tuple[int, ...]
    sink: Float[Tensor, "layer batch pos d_model"]
    content: Float[Tensor, "layer batch pos d_model"]
    bias: Float[Tensor, "layer d_model"]
    sink_mask: Bool[Tensor, "batch pos"]
    sink_source: str
    model_name: str
    sinks: SinkSet | None = None  # the positions treated as sinks (count per sequence, token kinds)
    post_norm: bool = False  # the model normalizes the attention output after W_O (Gemma 2/3)

    @property
    def reconstruction_error(self) -> float:
        """Largest relative error ||sink + content + b_O - attn_out|| / ||attn_out||."""
        return float(self.errors["rel_error"].max())

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        by = self.frame.groupby("term")[["norm", "rel_std_pos", "cos_pos", "rel_std_text", "cos_text"]].median()
        treated = f" ({self.sinks.describe()})" if self.sinks is not None else ""
        where = ("taken at attn.hook_out, before this model's post-attention norm (not linear), where the "
                 "terms sum exactly" if self.post_norm else "decomposed before any post-attention norm")
        lines = [f"{self.model_name}: attention output = sink term + content term + b_O, layers "
                 f"{self.layers[0]}-{self.layers[-1]}, sinks = {self.sink_source}{treated}; max relative "
                 f"reconstruction error {self.reconstruction_error:.1e} ({where}); {_EXCLUDED}.",
                 "median over heads:   norm   rel.std(pos)  cos(pos)  rel.std(texts)  cos(texts)"]
        for term, r in by.iterrows():
            lines.append(f"  {term:<8} {r.norm:>12.3f} {r.rel_std_pos:>12.3f} {r.cos_pos:>9.3f} "
                         f"{r.rel_std_text:>14.3f} {r.cos_text:>11.3f}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Per layer: mean norm of the sink and content terms, and the sink term's cosine."""
        return sink_content_axes(self.frame, ax=ax, title=f"{self.model_name}: sink vs content term")


def _constancy(x: Float[Tensor, "batch pos head_index d_model"], keep: Bool[Tensor, "batch pos"]) -> Tensor:
    """[head, 5]: norm, rel_std_pos, cos_pos, rel_std_text, cos_text (see the result class).

    Uses E||x - mean||^2 = E||x||^2 - ||mean||^2 and, for unit vectors u, mean pairwise
    cosine = (||sum u||^2 - n) / (n (n - 1)), so each text costs a few passes over x.
    """
    stats, means = [], []
    for b in range(x.shape[0]):
        rows = x[b, keep[b]]  # [n head d_model]
        n = rows.shape[0]
        if n == 0:
            continue
        mean = rows.mean(0)
        sq = rows.pow(2).sum(-1)  # [n head]
        norms = sq.sqrt()
        mean_sq = mean.pow(2).sum(-1)
        spread = (sq.mean(0) - mean_sq).clamp(min=0).sqrt() / mean_sq.sqrt().clamp(min=1e-12)
        unit_sum = torch.einsum("nh,nhm->hm", 1 / norms.clamp(min=1e-12), rows)
        cos = (unit_sum.pow(2).sum(-1) - n) / (n * (n - 1)) if n > 1 else torch.full_like(spread, float("nan"))
        means.append(mean.double())
        stats.append(torch.stack([norms.mean(0), spread, cos], 1))
    if not stats:
        return torch.full((x.shape[2], 5), float("nan"))
    text_means = torch.stack(means)
    grand = text_means.mean(0)
    spread = (text_means - grand).pow(2).sum(-1).mean(0).sqrt() / grand.norm(dim=-1).clamp(min=1e-12)
    across = torch.stack([spread if len(means) > 1 else torch.full_like(spread, float("nan")),
                          _mean_cosine(text_means)], 1)
    return torch.cat([torch.stack(stats).nanmean(0).double(), across], 1).float()


def _mean_cosine(rows: Float[Tensor, "n head d_model"]) -> Float[Tensor, " head"]:
    """Mean cosine over distinct pairs: (||sum u||^2 - n) / (n (n - 1)) for unit vectors u."""
    n = rows.shape[0]
    if n < 2:
        return torch.full(rows.shape[1:2], float("nan"), dtype=rows.dtype)
    unit = rows / rows.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return (unit.sum(0).pow(2).sum(-1) - n) / (n * (n - 1))


def decompose_attention(model: Any, text: str | Sequence[str] | Tensor, *,
                        layers: int | Sequence[int] | None = None, sinks: Sinks = None) -> AttentionDecomposition:
    """Split each attention output into sink term + content term + b_O (see module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor.
        layers: a layer or a sequence of layers to decompose (None: all).
        sinks: sink positions (a list of ints, the same for every sequence, or a bool
            ``[batch, pos]`` mask); None: the positions that act as sinks (:func:`find_sinks`),
            else the first token.

    Returns:
        An :class:`AttentionDecomposition`: the terms, their constancy per head, and the
        reconstruction error.

    Raises:
        MassiveLensError: if ``layers`` is empty or out of range, ``sinks`` is invalid (see
            :func:`sink_attention`), ``text`` is empty or too long, ``model`` is not a
            TransformerLens model, or a layer's attention cannot be split: no per-head ``W_O``,
            latent attention, or an output that sink + content + b_O does not reconstruct
            (relative error above 1e-3 in float32; a decomposition never returns unchecked).

    >>> from massive_lens import tiny_model
    >>> d = decompose_attention(tiny_model("qwen2"), "Hi there.", layers=1, sinks=[0])
    >>> d.layers, tuple(d.sink.shape)
    ((1,), (1, 1, 9, 64))
    """
    view = ModelView(model)
    if layers is None:
        layers = tuple(range(view.n_layers))
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    if not layers:
        raise MassiveLensError("layers is an empty list; pass None for all layers")
    batch = view.tokenize(text)
    found = _sink_mask(model, batch, text, sinks)
    mask, source = found.mask, found.source
    keep = batch.mask & ~mask
    weights = {layer: _output_weights(view, layer) for layer in layers}
    stash: dict[tuple[str, int], Tensor] = {}
    out: dict[str, list] = {"sink": [], "content": [], "bias": [], "stats": [], "errors": []}

    def split(layer: int) -> None:
        W_O, b_O = weights[layer]
        pattern, v, attn_out = (stash.pop((key, layer)) for key in ("pattern", "v", "out"))
        _check_shapes(view, layer, pattern, v, W_O, attn_out)
        device = attn_out.device
        stash_keys = mask.to(device)
        terms = []
        for keys in (stash_keys, ~stash_keys):
            z = sink_term(pattern, v, keys)
            terms.append(torch.einsum("bqhd,hdm->bqhm", z, W_O.to(z)))
        bias = torch.zeros_like(attn_out[0, 0]) if b_O is None else b_O.to(attn_out)
        sink, content = terms[0].sum(2), terms[1].sum(2)
        valid = batch.mask.to(device)[..., None]
        err = ((sink + content + bias - attn_out) * valid).norm() / (attn_out * valid).norm().clamp(min=1e-12)
        _check_error(view, layer, float(err), attn_out.dtype)
        out["errors"].append((layer, float(err)))
        for name, t in (("sink", terms[0]), ("content", terms[1])):
            out["stats"].append((layer, name, _constancy(t.cpu(), keep)))
        out["sink"].append(sink.cpu())
        out["content"].append(content.cpu())
        out["bias"].append(bias.cpu())

    hooks = []
    for i in layers:  # the three fire in any order (some bridges fire the pattern after the output)
        for key, name in (("pattern", "attn.hook_pattern"), ("v", "attn.hook_v"), ("out", _output_hook(view, i))):
            hooks.append((view.hook_name(i, name), partial(_put, stash=stash, key=(key, i), ready=split)))
    view.forward(batch, hooks, stop_after=view.hook_name(max(layers), "resid_post"))
    missed = sorted({layer for _, layer in stash} | (set(layers) - {layer for layer, _ in out["errors"]}))
    if missed:
        raise MassiveLensError(f"{view.name}: the pattern, value and output hooks of attention layer {missed[0]} did "
                               "not all fire; decompose_attention cannot split that layer")
    rows = [(layer, h, term, *vals.tolist()) for layer, term, s in out["stats"] for h, vals in enumerate(s)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "term", "norm", "rel_std_pos", "cos_pos",
                                        "rel_std_text", "cos_text"])
    return AttentionDecomposition(
        frame=frame, errors=pd.DataFrame(out["errors"], columns=["layer", "rel_error"]), layers=layers,
        sink=torch.stack(out["sink"]), content=torch.stack(out["content"]), bias=torch.stack(out["bias"]),
        sink_mask=mask, sink_source=source, model_name=view.name, sinks=found, post_norm=post_attention_norm(model))


def _put(act: Tensor, hook: Any, *, stash: dict[tuple[str, int], Tensor], key: tuple[str, int],
         ready: Any) -> None:
    """Keep one of a layer's pattern/value/output; the third to arrive runs ``ready(layer)``."""
    stash[key] = act
    layer = key[1]
    if all((k, layer) in stash for k in ("pattern", "v", "out")):
        ready(layer)


# relative error of sink + content + b_O above which a decomposition is refused, by dtype
RECONSTRUCTION_TOL = {torch.float16: 5e-2, torch.bfloat16: 5e-2}
RECONSTRUCTION_TOL_FLOAT32 = 1e-3


def _output_hook(view: ModelView, layer: int) -> str:
    """Where the attention output is read: the output projection's own hook (``attn.o.hook_out``:
    ``z @ W_O + b_O`` and nothing else) where there is one, else ``attn.hook_out`` (which on some
    bridges, e.g. BLOOM's, also holds the residual added inside the HF attention module)."""
    return "attn.o.hook_out" if f"blocks.{layer}.attn.o.hook_out" in view.hook_names else "attn.hook_out"


def _output_weights(view: ModelView, layer: int) -> tuple[Tensor, Tensor | None]:
    """``W_O [head d_head d_model]`` and ``b_O`` of one layer, or a clear error."""
    view.hook_name(layer, "attn.hook_pattern")  # range check (and an attention layer) with a clear message
    attn = view.model.blocks[layer].attn
    try:
        W_O, b_O = attn.W_O, getattr(attn, "b_O", None)
    except Exception as exc:  # noqa: BLE001 - bridges raise many kinds for weights they cannot expose
        raise MassiveLensError(f"{view.name}: decompose_attention needs W_O of layer {layer} as [head, d_head, "
                               f"d_model]; the bridge cannot give it ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:200]})") from exc
    if not isinstance(W_O, Tensor) or W_O.ndim != 3:
        raise MassiveLensError(f"{view.name}: decompose_attention needs W_O of layer {layer} as [head, d_head, "
                               f"d_model]; {type(attn).__name__} has {None if W_O is None else tuple(W_O.shape)}")
    return W_O.detach(), b_O.detach() if isinstance(b_O, Tensor) else None


def _check_shapes(view: ModelView, layer: int, pattern: Tensor, v: Tensor, W_O: Tensor, attn_out: Tensor) -> None:
    heads, d_head, d_model = W_O.shape
    ok = (pattern.ndim == 4 and v.ndim == 4 and pattern.shape[1] == heads and v.shape[1] == pattern.shape[-1]
          and v.shape[3] == d_head and heads % v.shape[2] == 0 and attn_out.shape[-1] == d_model)
    if not ok:
        raise MassiveLensError(
            f"{view.name}: attention layer {layer} does not have the shapes decompose_attention splits: pattern "
            f"{tuple(pattern.shape)} [batch, head, query, key], v {tuple(v.shape)} [batch, key, kv_head, d_head], "
            f"W_O {tuple(W_O.shape)} [head, d_head, d_model] (e.g. latent or compressed attention)")


def _check_error(view: ModelView, layer: int, err: float, dtype: torch.dtype) -> None:
    """Refuse a decomposition that does not reconstruct the attention output."""
    tol = RECONSTRUCTION_TOL.get(dtype, RECONSTRUCTION_TOL_FLOAT32)
    if not err <= tol:
        raise MassiveLensError(
            f"{view.name}: sink + content + b_O misses the attention output of layer {layer} by {err:.1e} "
            f"(relative, above {tol:g}): this attention's output is not pattern @ v @ W_O + b_O (e.g. a norm "
            "between the heads and W_O, or a pattern hook that is not the pattern applied), so "
            "decompose_attention cannot split it")
