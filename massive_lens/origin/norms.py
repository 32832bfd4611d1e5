"""The norms around an MLP, read at one traced entry: the post-norm's measured factor, the
input norm's divisor, and a norm's effective elementwise weight and bias (probed, so any RMS or
Layer norm convention works without knowing it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from massive_lens.origin.capture import Capture


def post_norm_factor(cap: Capture, layer: int, index: int, dim: int) -> float:
    """``ln2_post`` output / input at one entry: the post-norm linearised at its measured scale."""
    raw = float(cap.at("mlp_raw", layer)[index, dim])
    return 0.0 if raw == 0.0 else float(cap.layers["mlp"][layer, index, dim]) / raw


def norm_scale(cap: Capture, layer: int, index: int, weight: Tensor, bias: Tensor, centred: bool) -> float:
    """The divisor of the MLP's input norm at one position: ``hook_scale`` where it fired, else
    solved (least squares) from the norm's input and output, ``out - b = (x - mean) * w / scale``."""
    scale = cap.row("scale", layer, index)
    if scale is not None:
        return float(scale)
    x, y = cap.row("norm_in", layer, index), cap.row("norm_out", layer, index)
    if y is None:
        return 1.0  # no pre-MLP norm: the MLP reads the residual as it is
    x = x - x.mean() if centred else x
    a, r = x * weight, y - bias
    return float(a.pow(2).sum() / (a * r).sum())


def norm_affine(module: Any, d_model: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, bool]:
    """Effective elementwise weight and bias of a (RMS or Layer) norm, and whether it centres.

    Probes the module with a zero-mean, unit-RMS vector ``v`` and ``-v`` (for which both
    normalisations are the identity up to eps): ``f(v) = v * w + b``. Works for Gemma's
    ``(1 + weight)`` convention without knowing it. ``module=None`` (no norm): the identity.
    """
    if module is None:
        return torch.ones(d_model), torch.zeros(d_model), False
    module = getattr(module, "_original_component", module)
    device = next(iter(module.parameters()), torch.empty(0)).device
    v = torch.ones(d_model, dtype=torch.float32)
    v[1::2] = -1.0
    if d_model % 2:
        v[-1] = 0.0
    probes = torch.stack([v, -v, v + 1.0, v.roll(1), -v.roll(1)])
    with torch.no_grad():
        out = module(probes[None].to(device=device, dtype=dtype))[0].float().cpu()
    rms = v.pow(2).mean().sqrt()
    weight = (out[0] - out[1]) / 2 / (v / rms).where(v != 0, torch.ones(()))
    if d_model % 2:
        weight[-1] = float((out[3] - out[4])[-1] / 2 / (v.roll(1)[-1] / rms))
    bias = (out[0] + out[1]) / 2
    centred = bool(torch.allclose(out[2], out[0], rtol=1e-3, atol=1e-5))
    return weight, bias, centred
