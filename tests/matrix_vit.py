"""The vision transformers of the conformance matrix (``matrix.py``): every architecture of
TransformerLens's bridge whose Hugging Face class reads ``pixel_values`` (ViT, DeiT, with or
without a classifier head), as a tiny random model that reads 32x32 images in 8x8 patches.

The planted massive activation is the decoder one (``matrix.plant``), with the ``[CLS]``
token in BOS's place: ``[CLS]`` becomes a one-hot on the trigger dimension, where every other
position carries -1 (its column of the patch projection is zeroed, of the position embeddings
set to -1), so the wired neuron fires at ``[CLS]`` only. The inputs are seeded random images.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

VISION_SHAPE = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8,
                    num_channels=3)


def vision_architectures() -> list[str]:
    """TransformerLens's supported architectures whose transformers class reads ``pixel_values``."""
    found = []
    for arch in SUPPORTED_ARCHITECTURES:
        cls = getattr(transformers, arch, None)
        if cls is not None and "ConditionalGeneration" not in arch and cls.main_input_name == "pixel_values":
            found.append(arch)
    return sorted(found)


def is_vision(arch: str) -> bool:
    return getattr(getattr(transformers, arch, None), "main_input_name", None) == "pixel_values"


def tiny_vit(arch: str, layers: int, eager: bool = False) -> Any:
    """A seeded random ViT of ``arch`` with ``VISION_SHAPE``."""
    cls = getattr(transformers, arch)
    config = cls.config_class(num_hidden_layers=layers, **VISION_SHAPE)
    if eager:
        config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).eval()


def images(n: int, seed: int = 1) -> torch.Tensor:
    """``n`` seeded random images ``[n, 3, 32, 32]``."""
    gen = torch.Generator().manual_seed(seed)
    size = VISION_SHAPE["image_size"]
    return torch.rand(n, VISION_SHAPE["num_channels"], size, size, generator=gen)


def cls_trigger(model: Any, trigger_dim: int) -> None:
    """``[CLS]``'s embedding becomes a one-hot on ``trigger_dim``; every other position holds -1 there."""
    emb = model.embed.original_component
    with torch.no_grad():
        emb.cls_token.zero_()
        emb.cls_token[..., trigger_dim] = 1.0
        emb.position_embeddings[:, 0] = 0.0
        emb.position_embeddings[:, 1:, trigger_dim] = -1.0
        projection = emb.patch_embeddings.projection
        projection.weight[trigger_dim] = 0.0
        projection.bias[trigger_dim] = 0.0
        for name in ("distillation_token", "register_tokens"):
            extra = getattr(emb, name, None)
            if extra is not None:
                extra[..., trigger_dim] = 0.0
