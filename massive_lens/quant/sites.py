"""Which linear layers a low-bit setting quantizes, and what a residual rotation needs of them.

A pre-RMSNorm block reads the residual stream through a norm and writes back through the
attention output and the MLP down-projection. With a rotation ``Q`` of the residual stream:

* a **reader** (q, k, v, gate, up, a router; the unembedding) after a norm with gain ``g`` sees
  ``u Q`` (``u`` the normalized vector, gain 1) and computes with ``W diag(g) Q``;
* a **writer** (``o_proj``) computes with ``Q^T W`` and its output is in the rotated basis;
* the **down-projection** computes with ``Q^T W H`` on its input rotated online by a Hadamard ``H``
  (the product of gate and up cannot absorb ``H``, as in QuaRot).

The gain of each norm is read off the norm itself (a probe), and the norm is checked to be an
RMSNorm (``norm(x) = g * x / rms(x)``): a LayerNorm subtracts the mean, which a rotation does
not commute with, and a post-norm normalizes a sublayer output before it joins the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from massive_lens.errors import MassiveLensError


@dataclass
class Site:
    """One linear layer: ``role`` is ``reader``, ``writer``, ``down``, ``head`` or ``plain`` (no
    structure known); ``gain`` the norm gain before a reader; ``kv`` ``"k"``/``"v"`` for the
    key and value projections."""

    module: nn.Module
    weight: nn.Parameter
    role: str
    layer: int
    name: str
    kv: str | None = None
    norm: Any = None
    gain: Tensor | None = None


def _inner(component: Any) -> Any:
    inner = getattr(component, "original_component", None)
    return component if inner is None else inner


def _linears(component: Any) -> list[nn.Linear]:
    return [m for m in _inner(component).modules() if isinstance(m, nn.Linear)]


def structured_sites(model: Any, include_head: bool = False) -> list[Site] | None:
    """The sites of a bridge over a pre-norm decoder (readers, writers, down, head), or None
    when the model has no ``blocks[i].attn.o`` / ``mlp.out`` to tell them apart."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all(hasattr(b, n) for b in blocks for n in ("attn", "mlp", "ln1", "ln2")):
        return None
    sites: list[Site] = []
    for layer, block in enumerate(blocks):
        attn, mlp = block.attn, block.mlp
        if not (hasattr(attn, "o") and hasattr(mlp, "out")):
            return None
        o, out = _inner(attn.o), _inner(mlp.out)
        kv = {id(_inner(getattr(attn, n))): n for n in ("k", "v") if hasattr(attn, n)}
        for part, writer, norm in ((attn, o, block.ln1), (mlp, out, block.ln2)):
            for lin in _linears(part):
                role = ("writer" if part is attn else "down") if lin is writer else "reader"
                name = ("attn." if part is attn else "mlp.") + next(
                    (n for n, c in part.named_children() if _inner(c) is lin), "linear")
                sites.append(Site(lin, lin.weight, role, layer, name, kv=kv.get(id(lin)), norm=norm))
    if not any(s.role == "reader" for s in sites):
        return None  # no nn.Linear readers (GPT-2's Conv1D, say)
    if include_head:
        head = _inner(getattr(getattr(model, "original_model", model), "get_output_embeddings", lambda: None)())
        if isinstance(head, nn.Linear) and hasattr(model, "ln_final"):
            sites.append(Site(head, head.weight, "head", len(blocks), "head", norm=model.ln_final))
    return sites


def linear_sites(model: Any, include_head: bool = False) -> list[tuple[nn.Module, nn.Parameter, tuple[int, ...]]]:
    """Every linear map as (module whose first input is the linear input, weight, input axes of the weight).

    A model that knows its own linear layers (``MassiveLM``) lists them with
    ``quantization_sites(include_head)``; for a Hugging Face model (or a bridge over one)
    every ``nn.Linear`` is a site, the output head left out unless ``include_head``.

    Args:
        model: a MassiveLM, a TransformerBridge or a Hugging Face ``nn.Module``.
        include_head: also list the unembedding.

    Returns:
        ``(module, weight, input_axes)`` tuples.

    Raises:
        MassiveLensError: for another kind of model, or one with no ``nn.Linear`` layers.
    """
    own = getattr(model, "quantization_sites", None)
    if own is not None:
        return own(include_head)
    hf = getattr(model, "original_model", model)
    if not isinstance(hf, nn.Module):
        raise MassiveLensError(
            f"fake_quantized needs a MassiveLM, a TransformerBridge or an nn.Module; got "
            f"{type(model).__name__}"
        )
    head = getattr(hf, "get_output_embeddings", lambda: None)()
    head_ids = {id(m) for m in head.modules()} if head is not None and not include_head else set()
    sites = [
        (m, m.weight, (1,)) for m in hf.modules()
        if isinstance(m, nn.Linear) and id(m) not in head_ids
    ]
    if not sites:
        raise MassiveLensError(f"found no nn.Linear layers to quantize in {type(hf).__name__}")
    return sites


def plain(model: Any, include_head: bool) -> list[Site]:
    """Every linear layer as a ``plain`` site (:func:`linear_sites`, what
    :func:`~massive_lens.quant.fake.fake_quantized` quantizes). A site's ``layer`` is the block
    that holds its weight (a ``MassiveLM``'s ``blocks``; -1 outside them or without blocks) and its
    name the weight's name in that block (``attn.W_Q``), as ``measure_outliers`` reads them."""
    blocks = getattr(model, "blocks", None)
    blocks = list(blocks) if isinstance(blocks, nn.ModuleList) else []
    owner = {id(p): (i, n) for i, block in enumerate(blocks) for n, p in block.named_parameters()}
    return [Site(m, w, "plain", *owner.get(id(w), (-1, type(m).__name__)))
            for m, w, _ in linear_sites(model, include_head)]


def norm_gain(norm: Any, width: int, where: str) -> Tensor:
    """The gain ``g`` of an RMSNorm, read off the module; an error when it is not ``g * x / rms(x)``."""
    module = _inner(norm)
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    scale = 1e3  # rms of each probe row: eps is negligible next to it
    with torch.no_grad():
        probe = torch.eye(width, device=device, dtype=dtype) * scale * width**0.5
        gain = torch.diagonal(module(probe)).float() / width**0.5  # row i: g_i sqrt(width)
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(0)).to(device, dtype) * 3 + 1
        want = gain * (x.float() / x.float().pow(2).mean(-1, keepdim=True).sqrt())
        got = module(x).float()
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    if not err <= tol:
        raise MassiveLensError(
            f"{where} is a {type(module).__name__} that is not an RMSNorm (norm(x) differs from "
            f"g * x / rms(x) by {err:.1e} of its size: it subtracts the mean or adds a bias), so a rotation "
            "of the residual stream does not commute with it; use rotation=None for this model")
    if bool((gain == 0).any()):
        raise MassiveLensError(f"{where} has a gain of exactly zero in {int((gain == 0).sum())} dims; the "
                               "rotation cannot be simulated through it; use rotation=None")
    return gain


def rotation_sites(model: Any, include_head: bool) -> list[Site]:
    """The structured sites with each reader's norm gain, or an error naming why a residual
    rotation cannot be applied to ``model``."""
    name = getattr(getattr(model, "cfg", None), "model_name", type(model).__name__)
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all(hasattr(b, n) for b in blocks for n in ("attn", "mlp", "ln1", "ln2")):
        raise MassiveLensError(
            f"{name}: a rotation needs a TransformerBridge over a pre-norm decoder (blocks with ln1, attn, ln2, "
            "mlp); this model has no such blocks; use rotation=None")
    post = [n for n in ("ln1_post", "ln2_post") if hasattr(blocks[0], n)]
    if post:
        raise MassiveLensError(
            f"{name} normalizes each sublayer output before adding it to the residual stream ({post[0]}, a "
            "post-norm), so a rotation of the stream does not commute with it; use rotation=None")
    width = int(model.cfg.d_model)
    norm_gain(blocks[0].ln1, width, f"{name} layer 0's norm")
    sites = structured_sites(model, include_head)
    if sites is None:
        raise MassiveLensError(f"{name}: cannot tell the layers that read the residual stream from those that write "
                               "it (a rotation needs attn.o and mlp.out as nn.Linear; a mixture of experts or GPT-2's "
                               "Conv1D has none); use rotation=None")
    gains: dict[int, Tensor] = {}
    for site in sites:
        if site.role in ("reader", "head"):
            if id(site.norm) not in gains:
                gains[id(site.norm)] = norm_gain(site.norm, width, f"{name} layer {site.layer}'s norm")
            site.gain = gains[id(site.norm)]
            if site.module.in_features != width:
                raise MassiveLensError(f"{name} layer {site.layer}: {site.name} reads {site.module.in_features} "
                                       f"features, not the residual width {width}; use rotation=None")
        elif site.module.out_features != width:  # a writer or the down-projection
            raise MassiveLensError(f"{name} layer {site.layer}: {site.name} writes {site.module.out_features} "
                                   f"features, not the residual width {width}; use rotation=None")
    return sites
