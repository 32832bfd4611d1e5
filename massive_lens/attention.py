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

The sinks default to the positions carrying massive activations (``find_massive``); with
none, the first token. On models with a post-attention norm (Gemma 2/3) the decomposed
output is the one *before* that norm (``blocks.{l}.attn.hook_out``), since the norm is not
linear.

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
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.criterion import SINK_THRESHOLD, first_token_mass, sink_metric
from massive_lens.core.model_view import Batch, ModelView
from massive_lens.core.render import sink_content_axes, sink_mass_axes
from massive_lens.core.results import Result
from massive_lens.detect import find_massive
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


def _sink_mask(model: Any, batch: Batch, inputs: Any, sinks: Sinks) -> tuple[Bool[Tensor, "batch pos"], str]:
    n, pos = batch.tokens.shape
    mask = torch.zeros(n, pos, dtype=torch.bool)
    if isinstance(sinks, Tensor):
        if sinks.dtype != torch.bool or tuple(sinks.shape) != (n, pos):
            raise MassiveLensError(f"a sinks tensor must be bool [batch, pos] = {[n, pos]}, got "
                                   f"{sinks.dtype} {list(sinks.shape)}; or pass a list of positions")
        return sinks.cpu() & batch.mask, "given mask"
    if sinks is None:
        found = find_massive(model, inputs).to_frame()
        if found.empty:
            mask[:, 0] = True
            return mask, "first token (no massive activations found)"
        mask[torch.tensor(found["seq"].values), torch.tensor(found["pos"].values)] = True
        return mask & batch.mask, "positions with massive activations"
    positions = list(sinks)
    if not positions or any(not 0 <= int(p) < pos for p in positions):
        raise MassiveLensError(f"sink positions {positions} must be non-empty and within 0..{pos - 1}")
    mask[:, positions] = True
    return mask & batch.mask, f"positions {positions}"


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

    @property
    def sink_metric(self) -> float:
        """Share of heads whose mean attention to the first token exceeds ``threshold``."""
        return sink_metric(torch.tensor(self.frame["first_token_mass"].to_numpy()), self.threshold)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        per_layer = self.frame.groupby("layer")["sink_mass"].mean()
        top = per_layer.sort_values(ascending=False).head(3)
        return (f"{self.model_name}, {self.n_texts} text(s), sinks = {self.sink_source}: sink metric "
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
            ``[batch, pos]`` mask); None: the positions with massive activations (found with
            :func:`~massive_lens.find_massive`), else the first token.
        threshold: the sink metric's attention share, in (0, 1) (default 0.3, Gu et al.).

    Returns:
        A :class:`SinkAttention` (one row per layer and head) with its ``sink_metric``.

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
    mask, source = _sink_mask(model, batch, text, sinks)
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
    return SinkAttention(frame, threshold, source, view.name, len(batch.tokens))


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

    @property
    def reconstruction_error(self) -> float:
        """Largest relative error ||sink + content + b_O - attn_out|| / ||attn_out||."""
        return float(self.errors["rel_error"].max())

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        by = self.frame.groupby("term")[["norm", "rel_std_pos", "cos_pos", "rel_std_text", "cos_text"]].median()
        lines = [f"{self.model_name}: attention output = sink term + content term + b_O, layers "
                 f"{self.layers[0]}-{self.layers[-1]}, sinks = {self.sink_source}; max relative "
                 f"reconstruction error {self.reconstruction_error:.1e} (decomposed before any "
                 f"post-attention norm); {_EXCLUDED}.",
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
            ``[batch, pos]`` mask); None: the positions with massive activations, else the
            first token.

    Returns:
        An :class:`AttentionDecomposition`: the terms, their constancy per head, and the
        reconstruction error.

    Raises:
        MassiveLensError: if ``layers`` is empty or out of range, ``sinks`` is invalid (see
            :func:`sink_attention`), ``text`` is empty or too long, or ``model`` is not a
            TransformerLens model.

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
    mask, source = _sink_mask(model, batch, text, sinks)
    keep = batch.mask & ~mask
    weights = {}
    for i in layers:
        view.hook_name(i, "attn.hook_out")  # range check with a clear message
        attn = view.model.blocks[i].attn
        weights[i] = (attn.W_O.detach(), attn.b_O.detach() if getattr(attn, "b_O", None) is not None else None)
    stash: dict[str, Tensor] = {}
    out: dict[str, list] = {"sink": [], "content": [], "bias": [], "stats": [], "errors": []}

    def split(attn_out: Tensor, hook: Any, layer: int) -> None:
        W_O, b_O = weights[layer]
        device = attn_out.device
        stash_keys = mask.to(device)
        terms = []
        for keys in (stash_keys, ~stash_keys):
            z = sink_term(stash["pattern"], stash["v"], keys)
            terms.append(torch.einsum("bqhd,hdm->bqhm", z, W_O.to(z)))
        bias = torch.zeros_like(attn_out[0, 0]) if b_O is None else b_O.to(attn_out)
        sink, content = terms[0].sum(2), terms[1].sum(2)
        valid = batch.mask.to(device)[..., None]
        err = ((sink + content + bias - attn_out) * valid).norm() / (attn_out * valid).norm().clamp(min=1e-12)
        out["errors"].append((layer, float(err)))
        for name, t in (("sink", terms[0]), ("content", terms[1])):
            out["stats"].append((layer, name, _constancy(t.cpu(), keep)))
        out["sink"].append(sink.cpu())
        out["content"].append(content.cpu())
        out["bias"].append(bias.cpu())

    hooks = []
    for i in layers:
        hooks += [(view.hook_name(i, "attn.hook_pattern"), partial(_put, stash=stash, key="pattern")),
                  (view.hook_name(i, "attn.hook_v"), partial(_put, stash=stash, key="v")),
                  (view.hook_name(i, "attn.hook_out"), partial(split, layer=i))]
    view.forward(batch, hooks, stop_after=hooks[-1][0])
    rows = [(layer, h, term, *vals.tolist()) for layer, term, s in out["stats"] for h, vals in enumerate(s)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "term", "norm", "rel_std_pos", "cos_pos",
                                        "rel_std_text", "cos_text"])
    return AttentionDecomposition(
        frame=frame, errors=pd.DataFrame(out["errors"], columns=["layer", "rel_error"]), layers=layers,
        sink=torch.stack(out["sink"]), content=torch.stack(out["content"]), bias=torch.stack(out["bias"]),
        sink_mask=mask, sink_source=source, model_name=view.name)


def _put(act: Tensor, hook: Any, *, stash: dict[str, Tensor], key: str) -> None:
    stash[key] = act
