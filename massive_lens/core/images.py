"""Images as inputs: the positions of a vision transformer and a :class:`Batch` of pixels.

A ViT cuts an image into a grid of patches and reads one position per patch, after a few
positions of its own: the ``[CLS]`` token, and in some models more learned tokens (DeiT's
distillation token, the *registers* of Darcet et al.). Sun et al. (section 5) find massive
activations in CLIP and DINOv2 ViTs too; with registers, the registers take the sink's role
that BOS plays in a language model. Each position is one of three kinds: ``cls``,
``register`` (any learned token after ``[CLS]``) and ``patch``.

An image batch is a :class:`Batch` whose ``pixel_values`` is set; its ``tokens`` are the
position indices (an image has no token ids), so every analysis that counts positions runs
unchanged. :func:`image_layout` reads where the patches lie from the model's embeddings.

>>> from massive_lens.models import tiny_model
>>> layout = image_layout(tiny_model("deit"))
>>> layout.labels[:3], layout.grid, layout.n_positions
(['[CLS]', '[DIST]', 'patch 0,0'], (4, 4), 18)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from massive_lens.core.tokens import TOKEN_KINDS, Batch
from massive_lens.errors import MassiveLensError


@dataclass(frozen=True)
class ImageLayout:
    """Where a ViT's positions come from: ``specials`` (``[CLS]`` first, then registers),
    then a ``grid`` of ``rows x cols`` patches in row-major order, for images of
    ``channels x height x width``."""

    specials: tuple[str, ...]
    grid: tuple[int, int]
    channels: int
    size: tuple[int, int]

    @property
    def n_positions(self) -> int:
        return len(self.specials) + self.grid[0] * self.grid[1]

    @property
    def labels(self) -> list[str]:
        """A name per position: ``[CLS]``, ``[DIST]`` or ``[REG<i>]``, then ``patch <row>,<col>``."""
        rows, cols = self.grid
        return [*self.specials, *(f"patch {r},{c}" for r in range(rows) for c in range(cols))]

    def kinds(self) -> Int[Tensor, " pos"]:
        """Index into ``TOKEN_KINDS`` per position: ``cls``, ``register`` or ``patch``."""
        kinds = torch.full((self.n_positions,), TOKEN_KINDS.index("patch"))
        kinds[: len(self.specials)] = TOKEN_KINDS.index("register")
        kinds[0] = TOKEN_KINDS.index("cls")
        return kinds


def image_layout(model: Any) -> ImageLayout | None:
    """The :class:`ImageLayout` of a ViT-style model (a bridge whose embedding wraps a module
    with ``patch_embeddings`` and a ``cls_token``), or None for any other model."""
    embed = getattr(model, "embed", None)
    inner = getattr(embed, "original_component", None)
    patches = getattr(inner, "patch_embeddings", None)
    if patches is None or getattr(inner, "cls_token", None) is None:
        return None
    size, patch = _pair(patches.image_size), _pair(patches.patch_size)
    registers = getattr(inner, "register_tokens", None)
    n_registers = 0 if registers is None else int(registers.shape[1])
    specials = ("[CLS]", *(["[DIST]"] if getattr(inner, "distillation_token", None) is not None else []),
                *(f"[REG{i}]" for i in range(n_registers)))
    return ImageLayout(specials, (size[0] // patch[0], size[1] // patch[1]), int(patches.num_channels), size)


def image_batch(inputs: Any, layout: ImageLayout, name: str) -> Batch:
    """``pixel_values`` (``[batch, channels, height, width]``, or one image ``[channels,
    height, width]``) as a :class:`Batch`, checked against ``layout``; anything else (text,
    token ids) is a :class:`MassiveLensError`."""
    expected = f"[batch, {layout.channels}, {layout.size[0]}, {layout.size[1]}]"
    if isinstance(inputs, (str, list, tuple)) or (isinstance(inputs, Tensor) and not inputs.is_floating_point()):
        what = "token ids" if isinstance(inputs, Tensor) else "text"
        raise MassiveLensError(
            f"{name} is a vision model: it reads images, not {what}. Pass pixel_values, a float tensor "
            f"{expected}, e.g. AutoImageProcessor.from_pretrained(name)(images, return_tensors='pt')['pixel_values']")
    if not isinstance(inputs, Tensor):  # e.g. an image processor's whole output
        raise MassiveLensError(f"{name} reads images: pass pixel_values as a float tensor {expected}, "
                               f"got {type(inputs).__name__}")
    pixels = inputs[None] if inputs.ndim == 3 else inputs
    if pixels.ndim != 4 or pixels.shape[0] == 0 or tuple(pixels.shape[1:]) != (layout.channels, *layout.size):
        raise MassiveLensError(
            f"pixel_values for {name} must be {expected} (or one image without the batch dim), got "
            f"{tuple(inputs.shape)}; resize the images to {layout.size[0]}x{layout.size[1]} (the model's image "
            "processor does)")
    if not bool(torch.isfinite(pixels).all()):
        raise MassiveLensError(f"pixel_values for {name} hold NaN or inf")
    return pixel_batch(pixels, layout)


def pixel_batch(pixels: Float[Tensor, "batch channel height width"], layout: ImageLayout) -> Batch:
    """Checked pixels as a :class:`Batch`: every position real, ``tokens`` the position index."""
    n = layout.n_positions
    tokens = torch.arange(n).repeat(len(pixels), 1)
    return Batch(tokens, torch.ones(len(pixels), n, dtype=torch.bool), False, pixels)


def check_not_images(inputs: Any, name: str) -> None:
    """Error when a text model is given images (a 3- or 4-dim float tensor)."""
    if isinstance(inputs, Tensor) and inputs.is_floating_point() and inputs.ndim in (3, 4):
        raise MassiveLensError(f"got images (pixel_values {tuple(inputs.shape)}) but {name} is a text model; "
                               "pass text or token ids, or load a vision model (ViT, DeiT) for images")


def not_text(name: str, architecture: str) -> MassiveLensError:
    """The error for what needs text (a tokenizer, token ids, a corpus) on a vision model."""
    return MassiveLensError(
        f"{name} ({architecture}): a vision model reads images (pixel_values), not text or token ids, so "
        "analyses of text (perplexity, corpus scans, interventions calibrated on text) do not apply to it; "
        "find_massive, layer_profile, trace_origin, sink_attention and decompose_attention take its pixel_values")


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (tuple, list)) else (int(value), int(value))
