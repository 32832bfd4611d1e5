"""Sun et al.'s split of each attention output into sink term + content term + b_O.

Per head at query ``q`` with sink set C, ``sum_{i in C} p_qi v_i`` (the sink term) plus
``sum_{i not in C} p_qi v_i`` (the content term), mapped through ``W_O`` into the residual
stream, so that sink + content + b_O reconstructs the attention output exactly; with how
constant each term is across query positions and texts. Grouped-query attention and value
biases are handled. On models with a post-attention norm (Gemma 2/3) the decomposed output is
the one *before* that norm (``blocks.{l}.attn.hook_out``); where the output projection has its
own hook (``attn.o.hook_out``) that is the output decomposed. An attention whose output the
split does not reconstruct raises a ``MassiveLensError`` instead of returning numbers.

>>> from massive_lens import tiny_model
>>> result = decompose_attention(tiny_model("llama"), ["Hello there.", "Bye now!"])
>>> result.reconstruction_error < 1e-4
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.attention.sinks import Sinks, SinkSet, post_attention_norm, sink_mask, sink_term
from massive_lens.core.gather import LayerGather
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import sink_content_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

_EXCLUDED = "constancy statistics exclude the sink query positions (a sink attends to itself)"


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
        text: a string, a list of strings (padded into one batch) or a token tensor; for a
            vision model, ``pixel_values`` ``[batch, channels, height, width]``.
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
    layers = tuple(view.chosen_layers(layers))
    batch = view.tokenize(text)
    found = sink_mask(model, batch, sinks)
    mask, source = found.mask, found.source
    keep = batch.mask & ~mask
    weights = {layer: output_weights(view, layer) for layer in layers}
    out: dict[str, list] = {"sink": [], "content": [], "bias": [], "stats": [], "errors": []}

    def split(layer: int, pattern: Tensor, v: Tensor, attn_out: Tensor) -> None:
        W_O, b_O = weights[layer]
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

    gather = LayerGather(("pattern", "v", "out"), split)  # they fire in any order (some bridges: pattern last)
    hooks = [(view.hook_name(i, name), gather.hook(key, i)) for i in layers
             for key, name in (("pattern", "attn.hook_pattern"), ("v", "attn.hook_v"), ("out", _output_hook(view, i)))]
    view.forward(batch, hooks, stop_after=view.hook_name(max(layers), "resid_post"))
    missed = sorted(set(gather.pending) | (set(layers) - set(gather.done)))
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


# relative error of sink + content + b_O above which a decomposition is refused, by dtype
RECONSTRUCTION_TOL = {torch.float16: 5e-2, torch.bfloat16: 5e-2}
RECONSTRUCTION_TOL_FLOAT32 = 1e-3


def _output_hook(view: ModelView, layer: int) -> str:
    """Where the attention output is read: the output projection's own hook (``attn.o.hook_out``:
    ``z @ W_O + b_O`` and nothing else) where there is one, else ``attn.hook_out`` (which on some
    bridges, e.g. BLOOM's, also holds the residual added inside the HF attention module)."""
    return "attn.o.hook_out" if f"blocks.{layer}.attn.o.hook_out" in view.hook_names else "attn.hook_out"


def output_weights(view: ModelView, layer: int) -> tuple[Tensor, Tensor | None]:
    """``W_O [head d_head d_model]`` and ``b_O`` of one layer, or a clear error."""
    view.hook_name(layer, "attn.hook_pattern")  # range check (and an attention layer) with a clear message
    attn = view.block(layer).attn
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
