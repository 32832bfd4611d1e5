"""The one forward pass of :func:`massive_lens.trace_origin`.

Every hook slices the activation at the traced positions the moment it fires, so the pass
keeps ``[positions, d_model]`` (and ``[positions, d_mlp]`` for the MLP neurons) per layer and
never a full cache. Which hook holds what was checked on every tiny family:

- ``hook_embed`` (+ ``hook_pos_embed`` where a learned positional embedding fires) sums to
  ``blocks.0.hook_resid_pre``; Gemma's ``sqrt(d_model)`` embedding scale is already in it;
- ``blocks.{l}.hook_attn_out`` / ``hook_mlp_out`` are what is added to the residual stream;
  on sandwich-norm models we read ``ln1_post.hook_out`` / ``ln2_post.hook_out``, the output
  *after* the post-norm, explicitly, and ``ln2_post.hook_in`` (the raw MLP output);
- ``mlp.hook_post`` is the input of ``W_out``; ``mlp.hook_pre`` is the gate pre-activation of
  a gated MLP (the only pre-activation otherwise) and ``mlp.hook_pre_linear`` the up value;
- ``ln2.hook_scale`` divides the (centred, for LayerNorm) input: ``normalized = x / scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import Batch, ModelView
from massive_lens.core.reduce import ResidualReducer

# hook key -> per-block hook (post-norm variants are resolved per model in _hook_plan)
_BLOCK_KEYS = ("resid_mid", "resid_post", "post", "pre")


@dataclass
class Capture:
    """Activations at ``positions`` (index ``i`` of every tensor is ``positions[i]``)."""

    positions: Int[Tensor, " pos"]
    embed: Float[Tensor, "pos d_model"]
    pos_embed: Float[Tensor, "pos d_model"] | None
    resid_pre0: Float[Tensor, "pos d_model"]
    layers: dict[str, Float[Tensor, "layer pos _"]]  # attn, mlp, resid_mid, resid_post, post, pre, up, scale
    post_norm: bool
    gated: bool
    reducer: ResidualReducer | None = field(default=None, repr=False)

    def index(self, pos: int) -> int:
        return int((self.positions == pos).nonzero()[0, 0])


def _hook_plan(view: ModelView, layer: int, gated: bool, post_norm: bool) -> dict[str, str]:
    """Capture key -> hook name for one block."""
    plan = {
        "resid_mid": view.hook_name(layer, "resid_mid"),
        "resid_post": view.hook_name(layer, "resid_post"),
        "attn": view.hook_name(layer, "ln1_post.hook_out" if post_norm else "attn_out"),
        "mlp": view.hook_name(layer, "ln2_post.hook_out" if post_norm else "mlp_out"),
        "post": view.hook_name(layer, "mlp.hook_post"),
        "pre": view.hook_name(layer, "mlp.hook_pre"),
        "scale": view.hook_name(layer, "ln2.hook_scale"),
    }
    if gated:
        plan["up"] = view.hook_name(layer, "mlp.hook_pre_linear")
    if post_norm:
        plan["mlp_raw"] = view.hook_name(layer, "ln2_post.hook_in")
    return plan


def is_post_norm(view: ModelView) -> bool:
    return "blocks.0.ln2_post.hook_out" in view.model.hook_dict


def is_gated(view: ModelView) -> bool:
    return getattr(view.model.blocks[0].mlp, "W_gate", None) is not None


def capture(
    view: ModelView, batch: Batch, positions: Int[Tensor, " pos"], criterion: Criterion | None
) -> Capture:
    """One no-grad forward pass; with ``criterion`` also find the massive entries (in-hook)."""
    gated, post_norm = is_gated(view), is_post_norm(view)
    store: dict[tuple[str, int], Tensor] = {}
    idx = positions.to(view.input_device)

    def grab(key: str, layer: int):
        def hook(act: Tensor, hook: Any) -> None:
            if act.ndim == 3 and (key != "pos_embed" or act.shape[-1] == view.d_model):
                store[key, layer] = act[0, idx].detach().float().cpu()

        return hook

    hooks = [("hook_embed", grab("embed", -1)), ("blocks.0.hook_resid_pre", grab("resid_pre0", -1))]
    if "hook_pos_embed" in view.model.hook_dict:
        hooks.append(("hook_pos_embed", grab("pos_embed", -1)))
    for layer in range(view.n_layers):
        hooks += [(name, grab(key, layer)) for key, name in _hook_plan(view, layer, gated, post_norm).items()]
    reducer = None
    if criterion is not None:
        reducer = ResidualReducer(batch, criterion, entries=True)
        hooks += [(view.hook_name(layer, "resid_post"), reducer.hook(layer)) for layer in range(view.n_layers)]
    last = view.hook_name(view.n_layers - 1, "resid_post")
    view.forward(batch, hooks, stop_after=last)
    keys = sorted({key for key, layer in store if layer >= 0})
    layers = {key: torch.stack([store[key, layer] for layer in range(view.n_layers)]) for key in keys}
    layers["scale"] = layers["scale"][..., 0]
    return Capture(positions.cpu(), store["embed", -1], store.get(("pos_embed", -1)), store["resid_pre0", -1],
                   layers, post_norm, gated, reducer)


def post_norm_factor(cap: Capture, layer: int, index: int, dim: int) -> float:
    """``ln2_post`` output / input at one entry: the post-norm linearised at its measured scale."""
    raw = float(cap.layers["mlp_raw"][layer, index, dim])
    return 0.0 if raw == 0.0 else float(cap.layers["mlp"][layer, index, dim]) / raw


def norm_affine(module: Any, d_model: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, bool]:
    """Effective elementwise weight and bias of a (RMS or Layer) norm, and whether it centres.

    Probes the module with a zero-mean, unit-RMS vector ``v`` and ``-v`` (for which both
    normalisations are the identity up to eps): ``f(v) = v * w + b``. Works for Gemma's
    ``(1 + weight)`` convention without knowing it.
    """
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
