"""Tiny models for tests and examples: :func:`tiny_model` builds a small random-weight model of
one architecture family, offline, from its Hugging Face config class (:func:`tiny_config`),
with sizes checked before anything is built.

>>> from massive_lens.core.tokens import byte_tokenizer
>>> model_cls, config = tiny_config("qwen2", byte_tokenizer(), {"num_hidden_layers": 3})
>>> model_cls.__name__, config.num_hidden_layers, config.hidden_size
('Qwen2ForCausalLM', 3, 64)
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

from massive_lens.core.tokens import byte_tokenizer
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import wrap_hf_model

FAMILIES = ("llama", "gpt2", "gemma3", "qwen2")
VISION_FAMILIES = ("vit", "deit")  # vision transformers: they read images (see docs/vision.md)
OFFSWITCH_FAMILIES = ("gpt_oss", "qwen3_next")  # an attention off-switch: learned sink logits; an output gate (hybrid)
VISION_SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                    image_size=32, patch_size=8, num_channels=3)


def tiny_config(family: str, tok: Any, overrides: dict[str, Any]) -> tuple[type, Any]:
    """The model class and checked config of a ``family`` (see
    :func:`~massive_lens.tiny_model`), with ``overrides`` (Hugging Face config fields) applied."""
    ids = dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **ids,
    )
    builders = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, common),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, common),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {**common, "head_dim": 16}),
        "gpt2": (
            tf.GPT2Config,
            tf.GPT2LMHeadModel,
            dict(n_embd=64, n_layer=4, n_head=4, n_positions=256, **ids),
        ),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, {**common, "head_dim": 16, "num_local_experts": 4,
                                                             "num_experts_per_tok": 2, "sliding_window": 8}),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, {
            **common, "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
        "vit": (tf.ViTConfig, tf.ViTModel, VISION_SHAPE),
        "deit": (tf.DeiTConfig, tf.DeiTModel, VISION_SHAPE),
    }
    if family not in builders:
        raise MassiveLensError(f"unknown tiny_model family {family!r}; "
                               f"choose one of {FAMILIES + OFFSWITCH_FAMILIES + VISION_FAMILIES}")
    config_cls, model_cls, fields = builders[family]
    overrides = dict(overrides)
    if family == "gpt2" and "num_hidden_layers" in overrides:
        overrides["n_layer"] = overrides.pop("num_hidden_layers")
    try:
        config = config_cls(**{**fields, **overrides})
    except Exception as exc:  # noqa: BLE001 - configs raise TypeError, ValueError or their own validation errors
        raise MassiveLensError(f"bad override for tiny_model({family!r}): {str(exc).strip()}") from exc
    _check_sizes(family, config)
    return model_cls, config


def _check_sizes(family: str, config: Any) -> None:
    """Sizes a model can have: positive integers, heads that divide the width and the key/value heads."""
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings")
    sizes = {n: getattr(config, n, None) for n in names}
    bad = {n: v for n, v in sizes.items() if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1)}
    if bad:
        raise MassiveLensError(f"tiny_model({family!r}): sizes must be positive integers, got {bad}")
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if getattr(config, "head_dim", None) is None and sizes["hidden_size"] % heads:
        raise MassiveLensError(f"tiny_model({family!r}): hidden_size {sizes['hidden_size']} is not a multiple of "
                               f"num_attention_heads {heads}")
    if kv is not None and heads % kv:
        raise MassiveLensError(f"tiny_model({family!r}): num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {kv}")


def tiny_model(family: str = "llama", *, seed: int = 0, **overrides: Any) -> Any:
    """A small random-weight model of one architecture family, built offline.

    Families: ``llama`` (RMSNorm, SwiGLU, RoPE, GQA), ``gpt2`` (LayerNorm, GELU, learned
    positions, biases), ``gemma3`` (post-sublayer "sandwich" norms, QK-norm) and
    ``qwen2`` (GQA with q/k/v biases). ``overrides`` are Hugging Face config fields, e.g.
    ``num_hidden_layers=4``. All use the byte-level tokenizer of :func:`byte_tokenizer`.
    The vision families ``vit`` and ``deit`` (:data:`VISION_FAMILIES`) are ViTs that read
    32x32 RGB images in 8x8 patches (``[CLS]``, for DeiT a distillation token, 16 patches).
    :data:`OFFSWITCH_FAMILIES` have an attention off-switch: ``gpt_oss`` (a learned sink logit
    per head, sliding and full layers, a mixture of experts) and ``qwen3_next`` (an element-wise
    output gate on its full-attention layer, after three linear-attention layers).

    Args:
        family: ``"llama"`` (default), ``"gpt2"``, ``"gemma3"``, ``"qwen2"``, ``"vit"`` or ``"deit"``.
        seed: the torch seed of the random weights (the global RNG state is left as it was).
        **overrides: Hugging Face config fields of that family, replacing the defaults
            (4 layers, width 64, 4 heads, 2 key/value heads except in ``gpt2``, 256
            positions); for ``gpt2``, ``num_hidden_layers`` is accepted for ``n_layer``.

    Returns:
        A TransformerBridge named ``tiny-<family>``, in eval mode.

    Raises:
        MassiveLensError: for an unknown family or an override the config rejects.

    >>> tiny_model("qwen2", num_hidden_layers=3).cfg.n_layers
    3
    """
    tok = byte_tokenizer()
    model_cls, config = tiny_config(family, tok, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            hf = model_cls(config)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise MassiveLensError(f"tiny_model({family!r}) cannot be built with these sizes: {exc}") from exc
    return wrap_hf_model(hf, None if family in VISION_FAMILIES else tok, name=f"tiny-{family}")
