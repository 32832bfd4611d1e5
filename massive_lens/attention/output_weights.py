"""A layer's output projection as the attention analyses read it: ``W_O [head d_head d_model]`` and
``b_O`` (:func:`output_weights`), the shapes a per-head split of the output needs (:func:`check_shapes`),
the check that the output is the heads' outputs through them (:func:`output_miss`, :func:`check_error`)
and ``W_O``'s per-head Gram matrix, kept between calls while the weights stay what they were
(:func:`head_gram`): it costs about as much as a 21-token forward of the layer's output projection
on SmolLM2 (~0.9 ms a layer on one CPU thread) and is the same in every call on the same weights.

>>> from massive_lens import tiny_model
>>> from massive_lens.core.model_view import ModelView
>>> view = ModelView(tiny_model("llama"))
>>> W_O, b_O = output_weights(view, 0)
>>> gram = head_gram(W_O, W_O, view.block(0).attn)
>>> torch.equal(gram, W_O @ W_O.transpose(-1, -2)), head_gram(W_O, W_O, view.block(0).attn) is gram
(True, True)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.model_view import ModelView
from massive_lens.core.weight_cache import derived
from massive_lens.errors import MassiveLensError


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


def check_shapes(view: ModelView, layer: int, pattern: tuple[int, ...], v: Tensor, W_O: Tensor, attn_out: Tensor
                 ) -> None:
    """Refuse a layer whose attention is not split per head: ``pattern`` is the pattern's shape (the eager
    one's, or the one the kernel's q and k imply), ``v`` the values ``[batch key kv_head d_head]``."""
    heads, d_head, d_model = W_O.shape
    ok = (len(pattern) == 4 and v.ndim == 4 and pattern[1] == heads and v.shape[1] == pattern[-1]
          and v.shape[3] == d_head and heads % v.shape[2] == 0 and attn_out.shape[-1] == d_model)
    if not ok:
        raise MassiveLensError(
            f"{view.name}: attention layer {layer} does not have the shapes decompose_attention splits: pattern "
            f"{tuple(pattern)} [batch, head, query, key], v {tuple(v.shape)} [batch, key, kv_head, d_head], "
            f"W_O {tuple(W_O.shape)} [head, d_head, d_model] (e.g. latent or compressed attention)")


def head_gram(W_O: Float[Tensor, "head d_head d_model"], like: Tensor, owner: Any
              ) -> Float[Tensor, "head d_head d_head"]:
    """``W_O[h] @ W_O[h].T`` per head, of ``W_O`` in ``like``'s dtype and device (bitwise the product
    taken now), kept with ``owner`` (the layer's attention module) while the weights are unchanged
    (:func:`~massive_lens.core.weight_cache.derived`)."""

    def gram(weights: Tensor) -> Tensor:
        target = weights.to(like)
        return target @ target.transpose(-1, -2)

    return derived(W_O, owner, ("head_gram", like.dtype, like.device), gram)


def output_miss(z: Float[Tensor, "batch query head d_head"], out: Float[Tensor, "batch query d_model"],
                W_O: Float[Tensor, "head d_head d_model"], b_O: Tensor | None, rows: Tensor,
                real: Tensor | None = None) -> Float[Tensor, "2"]:
    """``||z W_O + b_O - out||`` and ``||out||`` on the query ``rows`` (:func:`check_rows`), at their real
    positions (``real [batch row 1]``; None: all): where the first is small next to the second the output is
    the heads' outputs ``z`` through ``W_O`` plus ``b_O``, and any split of ``z`` rebuilds it."""
    seen = out.detach()[:, rows]
    heads = z.detach()[:, rows].reshape(-1, W_O.shape[0] * W_O.shape[1])  # [batch x row, head x d_head]
    W = W_O.to(z).flatten(0, 1)
    rebuilt = heads @ W if b_O is None else torch.addmm(b_O.to(z), heads, W)
    both = torch.stack([rebuilt.view(seen.shape).to(seen.dtype).sub_(seen), seen])  # [2 batch row d_model]
    if real is not None:
        both *= real
    return torch.linalg.vector_norm(both.flatten(1), dim=1)


# query rows (evenly spaced) on which each layer's heads' outputs through W_O are checked against the attention
# output (output_miss): what the check catches (an output that is not z W_O + b_O) shows at every row
CHECK_ROWS = 8


def check_rows(n: int, device: torch.device | str) -> Tensor:
    """Up to ``CHECK_ROWS`` evenly spaced query positions of ``n``, first and last included."""
    return torch.linspace(0, n - 1, min(n, CHECK_ROWS), device=device).round().long().unique()


# relative error of sink + content + b_O above which a decomposition is refused, by dtype
RECONSTRUCTION_TOL = {torch.float16: 5e-2, torch.bfloat16: 5e-2}
RECONSTRUCTION_TOL_FLOAT32 = 1e-3


def check_error(view: ModelView, layer: int, err: float, dtype: torch.dtype, hook: str) -> None:
    """Refuse a decomposition that does not reconstruct the attention output."""
    tol = RECONSTRUCTION_TOL.get(dtype, RECONSTRUCTION_TOL_FLOAT32)
    if not math.isfinite(err):  # NaN or inf reached the layer: an overflow, not a wrong split
        raise view.overflow_error(view.hook_name(layer, hook))
    if not err <= tol:
        raise MassiveLensError(
            f"{view.name}: sink + content + b_O misses the attention output of layer {layer} by {err:.1e} "
            f"(relative, above {tol:g}): this attention's output is not pattern @ v @ W_O + b_O (e.g. a norm "
            "between the heads and W_O, or a pattern hook that is not the pattern applied), so "
            "decompose_attention cannot split it")
