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

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.attention.sinks import Sinks, SinkSet, post_attention_norm, sink_hooks, sink_mask, sinks_from
from massive_lens.core.criterion import SinkEvidence
from massive_lens.core.gather import LayerGather
from massive_lens.core.lse import EAGER, LSE, LayerAttention, choose_path, lse_run, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import sink_content_axes
from massive_lens.core.results import Result
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.errors import MassiveLensError

_EXCLUDED = "constancy statistics exclude the sink query positions (a sink attends to itself)"


@dataclass(frozen=True, kw_only=True)
class AttentionDecomposition(Result):
    """Sink and content terms of the attention output, in the residual stream.

    ``sink``/``content``: ``[layer, batch, pos, d_model]`` (summed over heads), ``bias``:
    ``[layer, d_model]`` (``b_O``, zeros when absent), for the layers in ``layers``.
    ``to_frame()``: one row per (``layer``, ``head``, ``term``) with ``norm`` (mean vector
    norm), ``rel_std_pos``/``cos_pos`` (spread and mean pairwise cosine across query
    positions of one text, averaged over texts), ``rel_std_text``/``cos_text`` (the same
    across the per-text mean vectors; NaN for one text). Sink query positions are excluded.
    ``attention``: ``"lse"`` (the attention on the sink columns from q, k and the SDPA kernel's
    log-sum-exp, the heads' outputs from the kernel) or ``"eager"`` (the pattern).
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
    attention: str = EAGER  # how attention was read: "lse" or "eager"

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
                 f"reconstruction error {self.reconstruction_error:.1e} ({where}); {_EXCLUDED}; "
                 f"{path_text(self.attention)}.",
                 "median over heads:   norm   rel.std(pos)  cos(pos)  rel.std(texts)  cos(texts)"]
        for term, r in by.iterrows():
            lines.append(f"  {term:<8} {r.norm:>12.3f} {r.rel_std_pos:>12.3f} {r.cos_pos:>9.3f} "
                         f"{r.rel_std_text:>14.3f} {r.cos_text:>11.3f}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Per layer: mean norm of the sink and content terms, and the sink term's cosine."""
        return sink_content_axes(self.frame, ax=ax, title=f"{self.model_name}: sink vs content term")


def _reductions(x: Float[Tensor, "batch head_index pos d_model"], keep: Bool[Tensor, "batch pos"]
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One term's sums over the positions that count, per text and head (a few passes over x):
    the mean vector, the sum of unit vectors, the mean squared norm and the mean norm."""
    w = keep.to(x.dtype)
    share = w / w.sum(1).clamp(min=1)[:, None]  # [batch pos]
    norms = torch.linalg.vector_norm(x, dim=-1)  # [batch head pos]
    mean = (share[:, None, None, :] @ x)[:, :, 0]  # [batch head d_model]
    unit_sum = ((w[:, None, :] / norms.clamp(min=1e-12))[:, :, None, :] @ x)[:, :, 0]
    return mean, unit_sum, (norms.pow(2) * share[:, None]).sum(-1), (norms * share[:, None]).sum(-1)


def _constancy(parts: Sequence[tuple[Tensor, ...]], keep: Bool[Tensor, "batch pos"]) -> Float[Tensor, "term head 5"]:
    """Per term (one :func:`_reductions` each) and head: norm, rel_std_pos, cos_pos,
    rel_std_text, cos_text (see the result class), for all terms at once.

    Uses E||x - mean||^2 = E||x||^2 - ||mean||^2 and, for unit vectors u, mean pairwise
    cosine = (||sum u||^2 - n) / (n (n - 1)).
    """
    mean, unit_sum, sq_mean, norm_mean = (torch.stack(t).cpu() for t in zip(*parts, strict=True))  # [term batch ...]
    n = keep.sum(1).to(mean.dtype)  # [batch]
    mean_sq = mean.pow(2).sum(-1)
    spread = (sq_mean - mean_sq).clamp(min=0).sqrt() / mean_sq.sqrt().clamp(min=1e-12)
    pairs = (n * (n - 1))[:, None]
    cos = torch.where(pairs > 0, (unit_sum.pow(2).sum(-1) - n[:, None]) / pairs.clamp(min=1), float("nan"))
    texts = n > 0
    if not bool(texts.any()):
        return torch.full((*mean.shape[:1], mean.shape[2], 5), float("nan"))
    stats = torch.stack([norm_mean, spread, cos], -1)[:, texts]  # [term text head 3]
    text_means = mean[:, texts].double()
    grand = text_means.mean(1, keepdim=True)
    spread = (text_means - grand).pow(2).sum(-1).mean(1).sqrt() / grand[:, 0].norm(dim=-1).clamp(min=1e-12)
    across = torch.stack([spread if text_means.shape[1] > 1 else torch.full_like(spread, float("nan")),
                          _mean_cosine(text_means)], -1)
    return torch.cat([stats.nanmean(1).double(), across], -1).float()


def _mean_cosine(rows: Float[Tensor, "term n head d_model"]) -> Float[Tensor, "term head"]:
    """Mean cosine over distinct pairs (axis 1): (||sum u||^2 - n) / (n (n - 1)) for unit vectors u."""
    n = rows.shape[1]
    if n < 2:
        return torch.full((rows.shape[0], rows.shape[2]), float("nan"), dtype=rows.dtype)
    unit = rows / rows.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return (unit.sum(1).pow(2).sum(-1) - n) / (n * (n - 1))


def decompose_attention(model: Any, text: str | Sequence[str] | Tensor, *, layers: int | Sequence[int] | None = None,
                        sinks: Sinks = None, attention: str = "auto") -> AttentionDecomposition:
    """Split each attention output into sink term + content term + b_O (see module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor; for a
            vision model, ``pixel_values`` ``[batch, channels, height, width]``.
        layers: a layer or a sequence of layers to decompose (None: all).
        sinks: sink positions (a list of ints, the same for every sequence, or a bool
            ``[batch, pos]`` mask); None: the positions that act as sinks (:func:`find_sinks`),
            else the first token.
        attention: ``"auto"`` (the default: the attention on the sink columns from q, k and the
            fused SDPA kernel's log-sum-exp where the model supports it, no pattern built; else
            the eager pattern), ``"lse"`` or ``"eager"`` (:mod:`massive_lens.core.lse`).

    Returns:
        An :class:`AttentionDecomposition`: the terms, their constancy per head, and the
        reconstruction error.

    Raises:
        MassiveLensError: if ``layers`` is empty or out of range, ``sinks`` is invalid (see
            :func:`sink_attention`), ``text`` is empty or too long, ``model`` is not a
            TransformerLens model, or a layer's attention cannot be split: no per-head ``W_O``,
            latent attention, or an output that sink + content + b_O does not reconstruct
            (relative error above 1e-3 in float32; a decomposition never returns unchecked), or
            ``attention="lse"`` on a model whose kernel cannot give the log-sum-exp.

    >>> from massive_lens import tiny_model
    >>> d = decompose_attention(tiny_model("qwen2"), "Hi there.", layers=1, sinks=[0])
    >>> d.layers, tuple(d.sink.shape)
    ((1,), (1, 1, 9, 64))
    """
    view = ModelView(model)
    layers = tuple(view.chosen_layers(layers))
    batch = view.tokenize(text)
    path = choose_path(view, attention)
    weights = {layer: output_weights(view, layer) for layer in layers}
    given = None if sinks is None else sink_mask(model, batch, sinks, path)
    # the key columns kept per layer: the given sinks' or, when the sinks are found in this same pass,
    # every position that could turn out to be one (see _candidates)
    columns = _candidates(view, batch) if given is None else given.mask.any(0).nonzero()[:, 0]
    kept: dict[int, tuple[Tensor, ...]] = {}
    out: dict[str, list] = {"sink": [], "content": [], "bias": [], "stats": [], "errors": []}

    def take(layer: int, pattern: Tensor, v: Tensor, attn_out: Tensor) -> None:
        _check_shapes(view, layer, tuple(pattern.shape), v, weights[layer][0], attn_out)
        v = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)  # one value head per query head
        cols = columns.to(pattern.device)
        keep(layer, (torch.einsum("bhqk,bkhd->bqhd", pattern, v), pattern[..., cols], v[:, cols], attn_out))

    def take_lse(layer: int, z: Tensor, pattern: Tensor, v: Tensor, attn_out: Tensor) -> None:
        # from the kernel: the heads' outputs z, the attention on the kept columns (from q, k and the LSE), v
        _check_shapes(view, layer, (*pattern.shape[:3], v.shape[1]), v, weights[layer][0], attn_out)
        v = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)
        keep(layer, (z, pattern, v[:, columns.to(v.device)], attn_out))

    def keep(layer: int, parts: tuple[Tensor, ...]) -> None:
        if given is None:
            kept[layer] = tuple(t.detach().cpu() for t in parts)  # until the pass has found the sinks
        else:
            _split(view, layer, *parts, given.mask[:, columns], weights[layer], batch.mask, given.mask, out)

    if path == LSE:
        gather = LayerGather(("z", "pattern", "v", "out"), take_lse)
        hooks = [(view.hook_name(i, _output_hook(view, i, LSE)), gather.hook("out", i)) for i in layers]
    else:
        gather = LayerGather(("pattern", "v", "out"), take)  # they fire in any order (some bridges: pattern last)
        hooks = [(view.hook_name(i, name), gather.hook(key, i)) for i in layers for key, name in
                 (("pattern", "attn.hook_pattern"), ("v", "attn.hook_v"), ("out", _output_hook(view, i)))]
    last = view.hook_name(max(layers), "resid_post")
    evidence = SinkEvidence(batch.mask, view.n_layers)
    if given is None:  # the sink rule reads every layer
        hooks += sink_hooks(view, evidence, patterns=path != LSE)
        last = hooks[-1][0]

    def from_lse(att: LayerAttention) -> None:
        if given is None:
            evidence.add_key_attention(*att.band(batch.mask))
        if att.layer in layers:
            z = att.z.transpose(1, 2)  # [batch query head d_head]
            for key, act in (("z", z), ("pattern", att.columns(columns).to(z.dtype)), ("v", att.v.transpose(1, 2))):
                gather.hook(key, att.layer)(act, None)

    with lse_run(view, from_lse) if path == LSE else contextlib.nullcontext():
        view.forward(batch, hooks, stop_after=last)
    missed = sorted(set(gather.pending) | (set(layers) - set(gather.done)))
    if missed:
        raise MassiveLensError(f"{view.name}: the pattern, value and output hooks of attention layer {missed[0]} did "
                               "not all fire; decompose_attention cannot split that layer")
    found = given
    if given is None:
        found = sinks_from(evidence, view.token_kinds(batch), path)
        inside = found.mask[:, columns]
        if int(inside.sum()) < int(found.mask.sum()):  # a sink outside the kept columns: a second pass
            return decompose_attention(model, text, layers=layers, sinks=found, attention=path)
        for layer in layers:
            _split(view, layer, *kept.pop(layer), inside, weights[layer], batch.mask, found.mask, out)
    stats = _constancy([parts for _, _, parts in out["stats"]], batch.mask & ~found.mask)  # [term head 5]
    rows = [(layer, h, term, *vals) for (layer, term, _), per_head in zip(out["stats"], stats.tolist(), strict=True)
            for h, vals in enumerate(per_head)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "term", "norm", "rel_std_pos", "cos_pos",
                                        "rel_std_text", "cos_text"])
    return AttentionDecomposition(
        frame=frame, errors=pd.DataFrame(out["errors"], columns=["layer", "rel_error"]), layers=layers,
        sink=torch.stack(out["sink"]), content=torch.stack(out["content"]), bias=torch.stack(out["bias"]),
        sink_mask=found.mask, sink_source=found.source, model_name=view.name, sinks=found,
        post_norm=post_attention_norm(model), attention=path)


# at most this many key columns are kept per layer while the sinks are found in the same pass
MAX_CANDIDATES = 64


def _candidates(view: ModelView, batch: Any) -> Tensor:
    """Key positions that could be sinks, kept per layer while the pass finds the sinks: the first
    four positions and every position that is not an ordinary token (first token, delimiters,
    an image's class and register tokens) in some sequence; at most ``MAX_CANDIDATES`` (a sink
    elsewhere costs a second pass, never a wrong split)."""
    kinds = view.token_kinds(batch)
    ordinary = torch.tensor([TOKEN_KINDS.index("other"), TOKEN_KINDS.index("patch")])
    special = (~torch.isin(kinds, ordinary) & batch.mask).any(0)
    special[:4] = True
    return special.nonzero()[:MAX_CANDIDATES, 0]


def _split(view: ModelView, layer: int, z: Tensor, pattern: Tensor, v: Tensor, attn_out: Tensor, keys: Tensor,
           weights: tuple[Tensor, Tensor | None], valid: Tensor, sinks: Tensor, out: dict[str, list]) -> None:
    """One layer's terms from the heads' outputs ``z [batch query head d_head]``, the attention on
    the kept key columns ``pattern [batch head query col]`` and their values ``v [batch col head
    d_head]``; ``keys [batch col]`` marks the sinks among the columns. The sink term is mapped
    through ``W_O`` column by column (a few), the content term is the rest of the heads' output."""
    W_O, b_O = weights
    device = attn_out.device
    W_O = W_O.to(z)
    z, pattern, v, keys = z.to(device), pattern.to(device), v.to(device), keys.to(device)
    used = keys.any(0).nonzero()[:, 0]  # the columns that are a sink in some sequence
    pattern, v, keys = pattern[..., used], v[:, used], keys[:, used]
    at_sinks = pattern * keys[:, None, None, :].to(pattern.dtype)  # [batch head query sink]
    z_content = z - torch.einsum("bhqk,bkhd->bqhd", at_sinks, v)  # the heads' outputs from the other keys
    content_heads = torch.einsum("bqhd,hdm->bhqm", z_content, W_O)  # [batch head query d_model]: einsum's own layout
    sink_heads = at_sinks @ torch.einsum("bkhd,hdm->bhkm", v, W_O)  # each sink's value through W_O, weighted
    bias = torch.zeros_like(attn_out[0, 0]) if b_O is None else b_O.to(attn_out)
    sink, content = sink_heads.sum(1), content_heads.sum(1)
    real = valid.to(device)[..., None]
    err = ((sink + content + bias - attn_out) * real).norm() / (attn_out * real).norm().clamp(min=1e-12)
    _check_error(view, layer, float(err), attn_out.dtype)
    out["errors"].append((layer, float(err)))
    keep = (valid & ~sinks).to(device)
    for name, t in (("sink", sink_heads), ("content", content_heads)):
        out["stats"].append((layer, name, _reductions(t, keep)))
    out["sink"].append(sink.cpu())
    out["content"].append(content.cpu())
    out["bias"].append(bias.cpu())


# relative error of sink + content + b_O above which a decomposition is refused, by dtype
RECONSTRUCTION_TOL = {torch.float16: 5e-2, torch.bfloat16: 5e-2}
RECONSTRUCTION_TOL_FLOAT32 = 1e-3


def _output_hook(view: ModelView, layer: int, path: str = EAGER) -> str:
    """Where the attention output is read: the output projection's own hook (``attn.o.hook_out``:
    ``z @ W_O + b_O`` and nothing else) where there is one, else ``attn.hook_out`` (which on some
    bridges, e.g. BLOOM's, also holds the residual added inside the HF attention module). On the
    LSE path the Hugging Face attention runs its own code, so ``attn.o`` fires only where that code
    calls the bridge's projection (Llama's ``o_proj``; GPT-2's ``c_proj`` is its own module)."""
    if not view.has_hook(layer, "attn.o.hook_out"):
        return "attn.hook_out"
    if path == LSE:
        attn = view.block(layer).attn
        hf = getattr(attn, "original_component", None)
        if hf is not None and not any(child is attn.o for child in hf.children()):
            return "attn.hook_out"
    return "attn.o.hook_out"


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


def _check_shapes(view: ModelView, layer: int, pattern: tuple[int, ...], v: Tensor, W_O: Tensor, attn_out: Tensor
                  ) -> None:
    """``pattern``: the pattern's shape (the eager one's, or the one the kernel's q and k imply)."""
    heads, d_head, d_model = W_O.shape
    ok = (len(pattern) == 4 and v.ndim == 4 and pattern[1] == heads and v.shape[1] == pattern[-1]
          and v.shape[3] == d_head and heads % v.shape[2] == 0 and attn_out.shape[-1] == d_model)
    if not ok:
        raise MassiveLensError(
            f"{view.name}: attention layer {layer} does not have the shapes decompose_attention splits: pattern "
            f"{tuple(pattern)} [batch, head, query, key], v {tuple(v.shape)} [batch, key, kv_head, d_head], "
            f"W_O {tuple(W_O.shape)} [head, d_head, d_model] (e.g. latent or compressed attention)")


def _check_error(view: ModelView, layer: int, err: float, dtype: torch.dtype) -> None:
    """Refuse a decomposition that does not reconstruct the attention output."""
    tol = RECONSTRUCTION_TOL.get(dtype, RECONSTRUCTION_TOL_FLOAT32)
    if not math.isfinite(err):  # NaN or inf reached the layer: an overflow, not a wrong split
        raise view.overflow_error(view.hook_name(layer, _output_hook(view, layer)))
    if not err <= tol:
        raise MassiveLensError(
            f"{view.name}: sink + content + b_O misses the attention output of layer {layer} by {err:.1e} "
            f"(relative, above {tol:g}): this attention's output is not pattern @ v @ W_O + b_O (e.g. a norm "
            "between the heads and W_O, or a pattern hook that is not the pattern applied), so "
            "decompose_attention cannot split it")
