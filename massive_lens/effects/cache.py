"""The StreamingLLM rolling cache as attention-score hooks, in one forward pass.

StreamingLLM (Xiao et al., 2023) keeps, for each new token, the key-value cache of the first
``k`` tokens (the sinks) and of the ``W`` most recent tokens, and gives every cached key its
position *within the cache*: sink ``i`` is at ``i``, the recent tokens at ``k, k+1, ...``, the
query at the end. Every token's hidden states are computed once, when it is the query, with the
cache of that moment.

A causal model computes token ``t``'s hidden states from its own row of each attention pattern
only, so one forward pass whose attention row ``t`` sees exactly token ``t``'s cache gives every
hidden state the cache loop gives. Under rotary embeddings the logit of query ``t`` on key ``j``
depends only on their distance, so positions within the cache change nothing for the recent
keys (their distance ``t - j`` is the same) and change the sink keys' distance from ``t - i`` to
``min(t, k + W - 1) - i``. :func:`window_hooks` does exactly that at each layer's
``attn.hook_attn_scores``:

- keys outside ``{i < k} | {t - W < j <= t}`` get the most negative logit (weight zero);
- a sink key's logit is recomputed from the model's own rotated query and key
  (``attn.hook_rot_q``, ``hook_rot_k``), with the key turned on by ``delta = t - min(t, k + W - 1)``
  positions using the model's own ``cos``/``sin`` (``attn.hook_cos``, ``hook_sin``, HF's
  rotate-half layout), and the score scale read off the unedited logits.

Two checks run on every pass and fail loudly: the model's ``cos``/``sin`` must be a pure rotation
by an angle linear in the position, in HF's rotate-half layout (so turning a key by ``cos[d]``,
``sin[d]`` moves it ``d`` positions), and its logits on the sink keys must be one scale times the
rotated ``q . k`` (no soft-capping or bias this module would miss). ``positions="original"``
keeps the original positions (any positional scheme, the mask alone).

>>> visible(5, 2, 1).int().tolist()[4]
[1, 0, 0, 1, 1]
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from massive_lens.core.gather import LayerGather
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

POSITIONS = ("cache", "original")


def visible(n: int, window: int, sinks: int) -> Bool[Tensor, "query_pos key_pos"]:
    """Which keys query ``t`` sees: the first ``sinks`` tokens and the last ``window`` (itself included)."""
    q, k = torch.arange(n)[:, None], torch.arange(n)[None]
    return (k <= q) & ((k < sinks) | (k > q - window))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _turn(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` (``[..., d_head]``) turned by the model's ``cos``/``sin`` (``[..., rotary_dim]``)."""
    dim = cos.shape[-1]
    head, tail = x[..., :dim], x[..., dim:]
    turned = head * cos + _rotate_half(head) * sin
    return torch.cat([turned, tail.expand(*turned.shape[:-1], tail.shape[-1])], dim=-1)


def _check_rotation(view: ModelView, layer: int, seen: dict[str, Tensor]) -> None:
    """The model's ``cos``/``sin`` must be a pure rotation by an angle linear in the position,
    in HF's rotate-half layout, so that turning a rotated key by ``cos[d]``/``sin[d]`` moves it
    ``d`` positions (what the logits of the sink keys are then recomputed with)."""
    cos, sin = seen["cos"][0].double(), seen["sin"][0].double()  # [pos rotary_dim]
    k = seen["rot_k"]
    half = cos.shape[-1] // 2
    ok = (cos.ndim == 2 and k.ndim == 4 and cos.shape[0] == k.shape[1] and cos.shape[-1] <= k.shape[-1]
          and cos.shape[-1] % 2 == 0)
    if ok:
        # the tables' own rounding (their dtype), and the angle's: the model computes p * theta in float32,
        # whose rounding grows with the position (at 8,192 positions about 5e-4 rad for theta = 1)
        atol = max(1e-4, 4 * torch.finfo(seen["cos"].dtype).eps)
        steps = torch.atan2(sin[1:2], cos[1:2]).abs().amax() if cos.shape[0] > 1 else 0.0
        grows = 4 * torch.finfo(torch.float32).eps * steps * torch.arange(1, cos.shape[0], dtype=cos.dtype)[:, None]
        turned_cos, turned_sin = cos[1:2] * cos[:-1] - sin[1:2] * sin[:-1], sin[1:2] * cos[:-1] + cos[1:2] * sin[:-1]
        ok = (torch.allclose(cos[0], torch.ones_like(cos[0])) and torch.allclose(sin[0], torch.zeros_like(sin[0]))
              and torch.allclose(cos.pow(2) + sin.pow(2), torch.ones_like(cos), atol=atol)
              and torch.allclose(cos[:, :half], cos[:, half:]) and torch.allclose(sin[:, :half], sin[:, half:])
              and bool(((cos[1:] - turned_cos).abs() <= atol + grows).all())
              and bool(((sin[1:] - turned_sin).abs() <= atol + grows).all()))
    if not ok:
        raise MassiveLensError(f"{view.name} layer {layer}: its attn.hook_cos/hook_sin ({tuple(cos.shape)}) are not a "
                               "rotation by an angle linear in the position in HF's rotate-half layout (or they "
                               "scale position 0), so the cache positions cannot be re-assigned safely; use "
                               "positions='original'")


def _sink_logits(view: ModelView, layer: int, scores: Tensor, seen: dict[str, Tensor], window: int, sinks: int
                 ) -> Tensor:
    """``scores`` with the sink keys' logits at their distance within the cache."""
    n = scores.shape[-1]
    delta = (torch.arange(n) - (sinks + window - 1)).clamp(min=0).to(scores.device)
    if not bool((delta > 0).any()):
        return scores
    q, k = seen["rot_q"].float(), seen["rot_k"][:, :sinks].float()  # [b pos head d], [b sinks kv d]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    cos, sin = seen["cos"][0].float()[delta], seen["sin"][0].float()[delta]  # [pos rotary_dim]
    turned = _turn(k[:, None], cos[None, :, None, None], sin[None, :, None, None])  # [b pos sinks head d]
    new = torch.einsum("bthd,btihd->bhti", q, turned)
    old = torch.einsum("bthd,bihd->bhti", q, k)
    causal = (torch.arange(n)[:, None] >= torch.arange(sinks)[None]).to(scores.device)  # [pos sinks]
    given = scores[..., :sinks].float()
    o, g = old[..., causal], given[..., causal]
    scale = (o * g).sum() / (o * o).sum().clamp(min=1e-30)
    if float((g - scale * o).abs().amax()) > 1e-3 * float(g.abs().amax().clamp(min=1e-6)) + 1e-4:
        raise MassiveLensError(f"{view.name} layer {layer}: its attention logits are not one scale times the rotated "
                               "q . k (soft-capping, a bias or ALiBi?), so the sink keys cannot be moved within the "
                               "cache; use positions='original'")
    moved = (delta > 0)[:, None]  # [pos 1]: only queries whose cache is full move the sink keys
    out = scores.clone()
    out[..., :sinks] = torch.where(moved, given + scale * (new - old), given).to(scores.dtype)
    return out


def _scores(scores: Tensor, hook: Any, *, view: ModelView, layer: int, rotary: LayerGather, window: int,
            sinks: int, positions: str) -> Tensor:
    if positions == "cache" and sinks > 0:
        seen = rotary.kept[layer]  # this pass's rot_q, rot_k, cos and sin of the layer
        _check_rotation(view, layer, seen)
        scores = _sink_logits(view, layer, scores, seen, window, sinks)
    keep = visible(scores.shape[-1], window, sinks).to(scores.device)
    return scores.masked_fill(~keep, torch.finfo(scores.dtype).min)


def window_hooks(view: ModelView, window: int, sinks: int, positions: str = "cache") -> list[tuple[str, Any]]:
    """Hooks that give each query the StreamingLLM cache of ``sinks`` first and ``window`` recent
    tokens (see the module docstring), at every layer."""
    if positions not in POSITIONS:
        raise MassiveLensError(f"positions must be one of {POSITIONS}, got {positions!r}")
    hooks: list[tuple[str, Any]] = []
    needed = ("rot_q", "rot_k", "cos", "sin")
    rotary = LayerGather(needed, reduce=Tensor.detach)
    for layer in range(view.n_layers):
        if positions == "cache" and sinks > 0:
            missing = [h for h in needed if not view.has_hook(layer, f"attn.hook_{h}")]
            if missing:
                raise MassiveLensError(f"{view.name} has no rotary hooks {missing} at layer {layer} (no rotary "
                                       "embedding, or not one TransformerLens exposes): positions within the cache "
                                       "cannot be re-assigned; use positions='original'")
            hooks += [(view.hook_name(layer, f"attn.hook_{h}"), rotary.hook(h, layer)) for h in needed]
        hooks.append((view.hook_name(layer, "attn.hook_attn_scores"),
                      partial(_scores, view=view, layer=layer, rotary=rotary, window=window, sinks=sinks,
                              positions=positions)))
    return hooks
