"""Attention variants: ways to let a head "attend to nothing".

Plain softmax attention must put weight 1 somewhere. A head with nothing to do parks its
weight on a cheap, nearly constant key (the first token, a delimiter) whose value is
small; the network then grows a few huge "massive" activations on that token to make
its key stand out. The variants here give the head an explicit way out, so we can train
them side by side and see whether the massive activations go away:

* ``softmax``: the baseline.
* ``softmax1`` / ``softmax_n``: one (or ``n``) extra keys with logit 0 and value zero,
  i.e. ``exp(x_i) / (n + sum_j exp(x_j))`` ("attention is off by one"). Identical to
  ``nn.MultiheadAttention(add_zero_attn=True)`` for ``n = 1``.
* ``learned_sink``: one learnable logit ``s_h`` per head with a zero value (GPT-OSS).
* ``kv_bias``: a learnable key ``k'`` and value ``v'`` per head appended as an extra slot,
  ``softmax(q [K; k']^T / sqrt(d)) [V; v']`` (Sun et al. 2024, Eq. 3); ``k_bias`` learns
  only ``k'`` (its value is zero).
* ``clipped_softmax``: ``clip((zeta - gamma) softmax(x) + gamma, 0, 1)``, which can reach
  exact zeros (Bondarenko et al. 2023).
* ``gated``: softmax attention whose per-head output is scaled by ``sigmoid(x W_G + b_G)``.
* ``sink_token``: softmax attention plus a learnable token that the model prepends at
  position 0 (token id ``d_vocab``, shown as ``<|sink|>``). The sink is a real position:
  every hook shows it, and ``to_tokens`` prepends it.
* ``relu``: non-normalised attention, ``relu(q k^T / sqrt(d)) / n_q`` where ``n_q`` is the number
  of keys query ``q`` sees (the sequence-length scaling of ReLU attention, Wortsman et al. 2023,
  the form Ran-Milo 2026 contrast with softmax): a head can output zero by making every logit
  negative, so it needs no sink.
* ``vscale``: softmax attention whose forward pass is unchanged but whose value path passes back
  less gradient to keys many queries see: the gradient reaching ``v_j`` is multiplied by
  ``mean(n) / n_j``, ``n_j`` the number of queries that see key ``j`` (our reading of Chen & Yao
  2026's V-scale, which "adjusts value-path backpropagated gradients" so that the first token's
  gradient sink is not concentrated; their exact scale was not available to us).

All "slot" variants share one mechanism: extra keys with a per-head logit offset and a
value, appended after the real keys. ``hook_pattern`` shows the weights over the real
keys only; ``hook_slot_pattern`` ``[batch, head_index, query_pos, slot]`` records the slot
weights (the two sum to one per query). Slot variants run fused
(``F.scaled_dot_product_attention``) unless someone hooks the scores or the pattern.

>>> cfg = VariantConfig(name="softmax1")
>>> type(make_variant(cfg, n_heads=2, d_head=4, d_model=8)).__name__
'SlotAttention'
>>> sorted(VARIANTS)[:3]
['clipped_softmax', 'gated', 'k_bias']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from massive_lens.errors import MassiveLensError

VARIANTS = (
    "softmax",
    "softmax1",
    "softmax_n",
    "learned_sink",
    "kv_bias",
    "k_bias",
    "clipped_softmax",
    "gated",
    "sink_token",
    "relu",
    "vscale",
)


@dataclass(frozen=True)
class VariantConfig:
    """Which attention variant, with its options.

    ``n`` is the number of zero slots of ``softmax_n``; ``gamma`` and ``zeta`` the stretch
    of ``clipped_softmax`` (Bondarenko et al. use ``gamma = -alpha / T`` with small alpha,
    ``zeta = 1``).
    """

    name: str = "softmax"
    n: float | int = 1.0
    gamma: float | int = -0.03
    zeta: float | int = 1.0

    def __post_init__(self) -> None:
        if self.name not in VARIANTS:
            raise MassiveLensError(
                f"unknown attention variant {self.name!r}; choose one of {', '.join(VARIANTS)}"
            )
        if self.name == "softmax_n" and self.n <= 0:
            raise MassiveLensError(f"softmax_n needs n > 0 slots, got n={self.n}")
        if self.name == "clipped_softmax" and not self.gamma <= 0 < 1 <= self.zeta:
            raise MassiveLensError(
                f"clipped_softmax needs gamma <= 0 and zeta >= 1, got {self.gamma}, {self.zeta}"
            )


def causal_scores(
    q: Float[Tensor, "batch head_index query_pos d_head"],
    k: Float[Tensor, "batch head_index key_pos d_head"],
    key_mask: Tensor | None = None,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """Scaled dot-product logits with the causal (and optional padding) mask as -inf."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n_q, n_k = scores.shape[-2:]
    future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
    if key_mask is not None:  # [batch, key_pos], True/1 for real tokens
        future = future | ~key_mask.bool()[:, None, None, :]
    return scores.masked_fill(future, float("-inf"))


class AttentionVariant(nn.Module):
    """Plain causal softmax attention; subclasses change how scores become weights.

    ``forward`` returns ``z`` ``[batch, pos, head_index, d_head]``. ``hooks`` is the owning
    attention layer, which provides ``hook_attn_scores``, ``hook_pattern`` and
    ``hook_slot_pattern``.
    """

    fusable = True

    def __init__(self, cfg: VariantConfig, n_heads: int, d_head: int, d_model: int):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.d_head = n_heads, d_head

    # --- the parts a variant may override -------------------------------------------
    def slots(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """Extra keys ``[head, slot, d_head]``, values, and logit offsets ``[head, slot]``."""
        return None

    def normalize(
        self, scores: Float[Tensor, "batch head_index query_pos key_pos"]
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        return torch.softmax(scores, dim=-1)

    def gate(
        self,
        z: Float[Tensor, "batch pos head_index d_head"],
        x: Float[Tensor, "batch pos d_model"],
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        return z

    # --- shared machinery -----------------------------------------------------------
    def forward(
        self,
        q: Float[Tensor, "batch head_index pos d_head"],
        k: Float[Tensor, "batch head_index pos d_head"],
        v: Float[Tensor, "batch head_index pos d_head"],
        x: Float[Tensor, "batch pos d_model"],
        hooks: nn.Module,
        key_mask: Tensor | None = None,
        fused: bool | None = None,
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        watched = any(
            _has_hooks(getattr(hooks, n))
            for n in ("hook_attn_scores", "hook_pattern", "hook_slot_pattern")
        )
        if fused is None:
            fused = self.fusable and key_mask is None and not watched
        z = self._fused(q, k, v) if fused else self._explicit(q, k, v, hooks, key_mask)
        return self.gate(z.transpose(1, 2), x)

    def _fused(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        slots = self.slots()
        if slots is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        k_s, v_s, bias = slots
        batch, n_slot = q.shape[0], k_s.shape[1]
        scale = 1 / math.sqrt(self.d_head)
        if bias is not None:  # fold the logit offset into one extra coordinate
            ones = q.new_ones(*q.shape[:-1], 1)
            q = torch.cat([q, ones], -1)
            k = torch.cat([k, k.new_zeros(*k.shape[:-1], 1)], -1)
            k_s = torch.cat([k_s, (bias / scale)[..., None]], -1)
        # Slots go first; one dummy query per slot keeps the causal mask top-left aligned.
        k_full = torch.cat([k_s.expand(batch, -1, -1, -1).to(k.dtype), k], 2)
        v_full = torch.cat([v_s.expand(batch, -1, -1, -1).to(v.dtype), v], 2)
        q_full = torch.cat([q.new_zeros(*q.shape[:2], n_slot, q.shape[-1]), q], 2)
        out = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True, scale=scale)
        return out[:, :, n_slot:]

    def _explicit(
        self, q: Tensor, k: Tensor, v: Tensor, hooks: nn.Module, key_mask: Tensor | None
    ) -> Tensor:
        scores = hooks.hook_attn_scores(causal_scores(q, k, key_mask))
        slots = self.slots()
        if slots is None:
            pattern = hooks.hook_pattern(self.normalize(scores))
            return pattern @ v
        k_s, v_s, bias = slots
        weights = self.normalize(torch.cat([scores, self._slot_scores(q, k_s, bias)], -1))
        n_real = scores.shape[-1]
        pattern = hooks.hook_pattern(weights[..., :n_real])
        slot_pattern = hooks.hook_slot_pattern(weights[..., n_real:])
        return pattern @ v + torch.einsum("bhqs,hsd->bhqd", slot_pattern, v_s.to(v.dtype))


    def _slot_scores(self, q: Tensor, k_s: Tensor, bias: Tensor | None) -> Tensor:
        """The logits of the queries on the slot keys ``[batch, head, query, slot]``."""
        slot_scores = torch.einsum("bhqd,hsd->bhqs", q, k_s.to(q.dtype)) / math.sqrt(self.d_head)
        return slot_scores if bias is None else slot_scores + bias[None, :, None, :]

    @torch.no_grad()
    def first_key_weight(
        self, q: Float[Tensor, "batch head_index query_pos d_head"], k: Float[Tensor, "batch head_index key_pos d_head"]
    ) -> Float[Tensor, "batch head_index query_pos"]:
        """The weight each query puts on key 0 (what ``hook_pattern[..., 0]`` shows), computed
        aside from the pass and without its hooks, so a fused pass stays fused (for recording)."""
        scores = causal_scores(q, k)
        slots = self.slots()
        if slots is not None:
            scores = torch.cat([scores, self._slot_scores(q, slots[0], slots[2])], -1)
        return self.normalize(scores)[..., 0]


class SlotAttention(AttentionVariant):
    """softmax1, softmax_n, learned_sink, kv_bias, k_bias: extra keys after the real ones."""

    def __init__(self, cfg: VariantConfig, n_heads: int, d_head: int, d_model: int):
        super().__init__(cfg, n_heads, d_head, d_model)
        shape = (n_heads, 1, d_head)
        learn_k = cfg.name in ("kv_bias", "k_bias")
        self.k_slot = nn.Parameter(torch.randn(shape) * 0.02) if learn_k else None
        self.v_slot = nn.Parameter(torch.randn(shape) * 0.02) if cfg.name == "kv_bias" else None
        self.sink_logit = nn.Parameter(torch.zeros(n_heads, 1)) if cfg.name == "learned_sink" else None
        self.register_buffer("_zeros", torch.zeros(shape), persistent=False)

    def slots(self) -> tuple[Tensor, Tensor, Tensor | None]:
        k_s = self.k_slot if self.k_slot is not None else self._zeros
        v_s = self.v_slot if self.v_slot is not None else self._zeros
        if self.sink_logit is not None:
            return k_s, v_s, self.sink_logit
        if self.cfg.name == "softmax_n" and self.cfg.n != 1:
            return k_s, v_s, torch.full_like(self._zeros[..., 0], math.log(self.cfg.n))
        return k_s, v_s, None


class ClippedSoftmax(AttentionVariant):
    """``clip((zeta - gamma) softmax + gamma, 0, 1)``: exact zeros, so explicit only."""

    fusable = False

    def normalize(
        self, scores: Float[Tensor, "batch head_index query_pos key_pos"]
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        p = torch.softmax(scores, dim=-1)
        return ((self.cfg.zeta - self.cfg.gamma) * p + self.cfg.gamma).clamp(0.0, 1.0)


class GatedAttention(AttentionVariant):
    """Softmax attention whose head outputs are scaled by ``sigmoid(x W_G + b_G)``."""

    def __init__(self, cfg: VariantConfig, n_heads: int, d_head: int, d_model: int):
        super().__init__(cfg, n_heads, d_head, d_model)
        self.W_G = nn.Parameter(torch.randn(d_model, n_heads) / math.sqrt(d_model))
        self.b_G = nn.Parameter(torch.full((n_heads,), 2.0))  # starts nearly open

    def gate(
        self,
        z: Float[Tensor, "batch pos head_index d_head"],
        x: Float[Tensor, "batch pos d_model"],
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        return z * torch.sigmoid(x @ self.W_G.to(x.dtype) + self.b_G.to(x.dtype))[..., None]


class ReluAttention(AttentionVariant):
    """``relu(scores) / n_visible``: weights that need not sum to one (no sink needed)."""

    fusable = False

    def normalize(
        self, scores: Float[Tensor, "batch head_index query_pos key_pos"]
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        visible = torch.isfinite(scores).sum(-1, keepdim=True).clamp(min=1)
        return torch.relu(scores) / visible

    def _fused(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # no fused kernel: the same sum, unhooked
        return self.normalize(causal_scores(q, k)) @ v


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale`` (broadcast)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.dtype), None


class VScaleAttention(AttentionVariant):
    """Softmax attention; the value of key ``j`` gets ``mean(n) / n_j`` of its gradient."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if torch.is_grad_enabled() and v.requires_grad:
            n_k = v.shape[2]
            seen_by = torch.arange(n_k, 0, -1, device=v.device, dtype=torch.float32)  # queries that see key j
            v = _ScaleGradient.apply(v, (seen_by.mean() / seen_by)[:, None])
        return super().forward(q, k, v, *args, **kwargs)


_CLASSES: dict[str, type[AttentionVariant]] = {
    "softmax": AttentionVariant,
    "sink_token": AttentionVariant,
    "clipped_softmax": ClippedSoftmax,
    "gated": GatedAttention,
    "relu": ReluAttention,
    "vscale": VScaleAttention,
    **{n: SlotAttention for n in ("softmax1", "softmax_n", "learned_sink", "kv_bias", "k_bias")},
}


def make_variant(cfg: VariantConfig, n_heads: int, d_head: int, d_model: int) -> AttentionVariant:
    """Build the attention kernel named by ``cfg.name`` (see :data:`VARIANTS`).

    >>> v = make_variant(VariantConfig("kv_bias"), n_heads=2, d_head=4, d_model=8)
    >>> tuple(v.slots()[0].shape)
    (2, 1, 4)
    """
    return _CLASSES[cfg.name](cfg, n_heads, d_head, d_model)


def _has_hooks(hook_point: object) -> bool:
    return bool(
        getattr(hook_point, "fwd_hooks", None)
        or getattr(hook_point, "bwd_hooks", None)
        or getattr(hook_point, "_forward_hooks", None)
    )
