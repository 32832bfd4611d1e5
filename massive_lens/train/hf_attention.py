"""Attention variants inside a pretrained Hugging Face model, through transformers' own interface.

transformers looks up each attention layer's kernel by name:
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, mask, ...)``.
:func:`swap_attention` registers one function per variant of
:mod:`massive_lens.train.variants` (``massive_lens_softmax1``, ...) with
``transformers.AttentionInterface``, gives every attention module the variant's parameters
as a submodule ``ml_variant`` (so ``model.parameters()`` and the optimizer see them), and
switches the model to it. Nothing else in the model changes: the kernel *is*
:class:`~massive_lens.train.variants.SlotAttention` (or plain softmax), fed with the model's
post-RoPE queries and keys, so the swapped model computes what :class:`MassiveLM` computes
with the same variant.

A TransformerBridge re-implements attention itself (to fire ``hook_attn_scores`` and
``hook_pattern``) and never calls that function, so a bridge over a swapped model would run
plain softmax. :func:`bridge_hooks` gives the hooks that add the same slots to a bridge's
attention (scores, pattern and ``z``), so every massive_lens analysis sees the variant:
``with bridge.hooks(fwd_hooks=bridge_hooks(bridge, hf)): find_massive(bridge, text)``.

>>> from massive_lens import tiny_model
>>> hf = plain_copy(tiny_model("llama"))
>>> swap_attention(hf, "softmax1").config._attn_implementation
'massive_lens_softmax1'
"""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.train.variants import AttentionVariant, VariantConfig, make_variant

SUPPORTED = ("softmax", "softmax1", "softmax_n", "learned_sink", "kv_bias", "k_bias")
PREFIX = "massive_lens_"


class Tap(nn.Module):
    """Stands in for the hook points a variant calls; records attention mass when ``on``.

    ``first`` is the mean weight on key 0 and ``slot`` the mean total slot weight, over
    batch, heads and query positions ``>= 1`` (query 0 can only attend to key 0).
    """

    def __init__(self) -> None:
        super().__init__()
        self.on, self.first, self.slot = False, float("nan"), 0.0

    def hook_attn_scores(self, x: Tensor) -> Tensor:
        return x

    def hook_pattern(self, p: Tensor) -> Tensor:
        if self.on:
            self.first = float(p[:, :, 1:, 0].mean()) if p.shape[-2] > 1 else float("nan")
        return p

    def hook_slot_pattern(self, p: Tensor) -> Tensor:
        if self.on:
            self.slot = float(p[:, :, 1:].sum(-1).mean()) if p.shape[-2] > 1 else 0.0
        return p


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """The function registered with ``AttentionInterface``: returns ``z [batch, pos, head, d_head]``."""
    variant: AttentionVariant = module.ml_variant
    tap: Tap = module.ml_tap
    d_head = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, d_head ** -0.5):  # the kernel scales by 1/sqrt(d)
        query = query * (scaling * math.sqrt(d_head))
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    if query.shape[-2] != key.shape[-2]:
        raise MassiveLensError("the swapped attention runs whole sequences only (no KV cache); "
                               "call the model with use_cache=False")
    key_mask = None
    if attention_mask is not None:  # [batch, 1, q, k]: the last query sees every real key
        last = attention_mask[:, 0, -1, :]
        key_mask = last if last.dtype == torch.bool else last == 0
    fused = False if tap.on or key_mask is not None else None
    x = query.new_zeros(query.shape[0], query.shape[2], 0)  # the residual input, read only by gated variants
    return variant(query, key, value, x, tap, key_mask=key_mask, fused=fused), None


def attention_modules(hf_model: nn.Module) -> list[nn.Module]:
    """The attention module of every layer (modules with ``q_proj`` and ``k_proj``), in order."""
    found = [m for m in hf_model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")]
    if not found:
        raise MassiveLensError(f"{type(hf_model).__name__} has no attention modules with q_proj/k_proj; "
                               "swap_attention supports Llama/Qwen/Mistral-style Hugging Face models")
    return found


def swap_attention(hf_model: nn.Module, variant: str | VariantConfig) -> nn.Module:
    """Give every attention layer of ``hf_model`` the attention ``variant`` (in place).

    Args:
        hf_model: a Hugging Face causal LM (not a bridge: see :func:`plain_copy`).
        variant: one of :data:`SUPPORTED` (a name or a ``VariantConfig``); the new
            parameters start as :class:`MassiveLM` starts them (``learned_sink`` at logit 0,
            i.e. softmax1; ``kv_bias`` small random, see :func:`init_slots`).

    Returns:
        ``hf_model``, now running ``massive_lens_<variant>``.

    Raises:
        MassiveLensError: for a variant outside :data:`SUPPORTED` or a model without
            ``q_proj``/``k_proj`` attention modules.
    """
    cfg = variant if isinstance(variant, VariantConfig) else VariantConfig(variant)
    if cfg.name not in SUPPORTED:
        raise MassiveLensError(f"variant {cfg.name!r} cannot be swapped into a pretrained model; "
                               f"choose one of {', '.join(SUPPORTED)}")
    name = PREFIX + cfg.name
    AttentionInterface.register(name, _attention)
    config = hf_model.config
    n_heads = config.num_attention_heads
    d_head = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    param = next(hf_model.parameters())
    for module in attention_modules(hf_model):
        module.ml_variant = make_variant(cfg, n_heads, d_head, config.hidden_size).to(param.device, param.dtype)
        module.ml_tap = Tap()
    if hasattr(hf_model, "set_attn_implementation"):
        hf_model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        config._attn_implementation = name
    return hf_model


def variant_of(hf_model: nn.Module) -> str | None:
    """The swapped-in variant's name, or None when the model runs its own attention."""
    impl = getattr(hf_model.config, "_attn_implementation", "") or ""
    return impl[len(PREFIX):] if impl.startswith(PREFIX) else None


def init_slots(hf_model: nn.Module, keys: Tensor, values: Tensor) -> None:
    """Start each layer's learned key/value slot at the given ``[layer, kv_head, d_head]``
    means (bias surgery's initialisation: the mean post-RoPE key and value at the sink).

    Raises:
        MassiveLensError: if the model has no ``kv_bias``/``k_bias`` slots or the shapes differ.
    """
    modules = attention_modules(hf_model)
    if variant_of(hf_model) not in ("kv_bias", "k_bias") or len(keys) != len(modules):
        raise MassiveLensError("init_slots needs a model swapped to kv_bias/k_bias and one key/value row per layer")
    with torch.no_grad():
        for module, k, v in zip(modules, keys, values, strict=True):
            var = module.ml_variant
            group = var.n_heads // k.shape[0]
            var.k_slot.copy_(k.repeat_interleave(group, 0)[:, None])
            if var.v_slot is not None:
                var.v_slot.copy_(v.repeat_interleave(group, 0)[:, None])


def plain_copy(bridge: Any) -> nn.Module:
    """A plain Hugging Face model (no bridge components) with the bridge's weights, in eval mode.

    Raises:
        MassiveLensError: if ``bridge`` wraps no Hugging Face model or a weight is missing.
    """
    hf = getattr(bridge, "original_model", None)
    if hf is None:
        raise MassiveLensError(f"{type(bridge).__name__} wraps no Hugging Face model (original_model); "
                               "retrofit needs a model from load_model or wrap_hf_model")
    state = {k.replace("._original_component", ""): v for k, v in hf.state_dict().items()}
    plain = type(hf)(copy.deepcopy(hf.config))
    missing = plain.load_state_dict(state, strict=False).missing_keys
    if [k for k in missing if "rotary" not in k and "lm_head" not in k]:
        raise MassiveLensError(f"copying {type(hf).__name__} out of its bridge missed weights {missing[:4]}")
    return plain.to(next(hf.parameters()).device, next(hf.parameters()).dtype).eval()


def load_into_bridge(bridge: Any, hf_model: nn.Module) -> None:
    """Copy ``hf_model``'s weights into the bridge's Hugging Face model (the variant's own
    parameters stay in ``hf_model``; :func:`bridge_hooks` reads them from there)."""
    target = {k.replace("._original_component", ""): v for k, v in bridge.original_model.state_dict().items()}
    with torch.no_grad():
        for name, value in hf_model.state_dict().items():
            if name in target:
                target[name].copy_(value)


def bridge_hooks(bridge: Any, hf_model: nn.Module) -> list[tuple[str, Any]]:
    """Forward hooks that make a bridge's attention compute ``hf_model``'s swapped variant.

    For plain softmax: no hooks. For slot variants, per layer: stash the post-RoPE queries
    (``hook_rot_q``, ``[batch, pos, head, d_head]``) and the masked scores
    (``hook_attn_scores``), renormalise the pattern over the real keys plus the slots
    (``hook_pattern``), and add the slots' values to
    ``hook_z``. ``bridge`` must hold ``hf_model``'s weights (:func:`load_into_bridge`).
    """
    if variant_of(hf_model) in (None, "softmax"):
        return []
    hooks = []
    for layer, module in enumerate(attention_modules(hf_model)):
        scaling = float(getattr(module, "scaling", module.head_dim ** -0.5))
        state: dict[str, Tensor] = {}
        stash = partial(_stash, state=state)
        name = partial(ModelView.block_hook, layer)
        hooks += [(name("attn.hook_rot_q"), partial(stash, key="q")),
                  (name("attn.hook_attn_scores"), partial(stash, key="scores")),
                  (name("attn.hook_pattern"),
                   partial(_slot_pattern, state=state, variant=module.ml_variant, scaling=scaling)),
                  (name("attn.hook_z"), partial(_slot_value, state=state, variant=module.ml_variant))]
    return hooks


def _stash(x: Tensor, hook: Any, *, state: dict, key: str) -> None:
    state[key] = x


def _slot_pattern(pattern: Tensor, hook: Any, *, state: dict, variant: AttentionVariant, scaling: float) -> Tensor:
    k_s, _, bias = variant.slots()
    slot = torch.einsum("bqhd,hsd->bhqs", state["q"], k_s.to(pattern.dtype)) * scaling  # TL layout
    if bias is not None:
        slot = slot + bias[None, :, None, :]
    weights = variant.normalize(torch.cat([state["scores"].to(slot.dtype), slot], -1))
    n_real = pattern.shape[-1]
    state["slot"] = weights[..., n_real:]
    return weights[..., :n_real].to(pattern.dtype)


def _slot_value(z: Tensor, hook: Any, *, state: dict, variant: AttentionVariant) -> Tensor:
    _, v_s, _ = variant.slots()
    extra = torch.einsum("bhqs,hsd->bqhd", state["slot"], v_s.to(z.dtype))
    return z + extra.reshape(z.shape)
