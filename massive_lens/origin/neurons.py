"""Neuron-level pieces of :func:`massive_lens.trace_origin`: per-neuron contributions,
super weights and why-this-token attributions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.model_view import ModelView
from massive_lens.origin.capture import Capture, norm_affine, post_norm_factor

NEURON_COLUMNS = ["pos", "dim", "layer", "kind", "neuron", "contribution", "share", "named", "post", "pre", "up",
                  "w_out"]
NAMED_SHARE = 0.9  # name same-sign neurons, largest first, until they explain 90% of the MLP's term ...
NAMED_MIN = 0.02  # ... skipping any below 2% of it
SUPER_COLUMNS = ["pos", "dim", "layer", "neuron", "value", "zscore", "rank", "n_entries",
                 "hf_param", "hf_row", "hf_col"]
WHY_COLUMNS = ["pos", "dim", "layer", "neuron", "input", "source", "source_layer", "contribution", "share", "value"]


def w_out(view: ModelView, layer: int) -> Float[Tensor, "d_mlp d_model"]:
    return view.model.blocks[layer].mlp.W_out


def neuron_rows(view: ModelView, cap: Capture, event: dict[str, Any], top_k: int) -> list[dict[str, Any]]:
    """Top ``top_k`` neurons (by |contribution|) of one MLP event at its (pos, dim)."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    factor = post_norm_factor(cap, layer, i, dim) if cap.post_norm else 1.0
    weights = w_out(view, layer)[:, dim].detach().float().cpu()
    post = cap.layers["post"][layer, i]
    contrib = post * weights * factor
    total = float(event["contribution"])
    rows, explained = [], 0.0
    for n in contrib.abs().topk(min(top_k, len(contrib))).indices.tolist():
        share = float(contrib[n]) / total if total else math.nan
        is_named = explained < NAMED_SHARE and share >= NAMED_MIN
        explained += share if is_named else 0.0
        up = float(cap.layers["up"][layer, i, n]) if cap.gated else math.nan
        rows.append(dict(pos=pos, dim=dim, layer=layer, kind=event["kind"], neuron=n,
                         contribution=float(contrib[n]), share=share, named=is_named, post=float(post[n]),
                         pre=float(cap.layers["pre"][layer, i, n]), up=up, w_out=float(weights[n])))
    return rows


def named(neurons: pd.DataFrame, event: dict[str, Any]) -> list[int]:
    """The neurons an event's story names: same sign as the event, largest first, until they
    explain 90% of the MLP's term (see ``NAMED_SHARE``)."""
    rows = neurons[(neurons.pos == event["pos"]) & (neurons.dim == event["dim"]) & (neurons.layer == event["layer"])]
    return rows[rows.named].neuron.tolist()


def hf_param(model: Any, layer: int, weight: Tensor) -> tuple[str, bool]:
    """Name of the Hugging Face parameter behind ``W_out`` and whether it is stored transposed
    (``down_proj.weight[dim, neuron]``), found by shared storage; TL naming otherwise."""
    original = getattr(model, "original_model", None)
    if original is not None:
        for name, param in original.named_parameters():
            if param.data_ptr() == weight.data_ptr() and param.numel() == weight.numel():
                return name.replace("._original_component", ""), tuple(param.shape) != tuple(weight.shape)
    return f"blocks.{layer}.mlp.W_out", False


def super_weight_rows(view: ModelView, pos: int, dim: int, layer: int, neurons: Sequence[int]) -> list[dict[str, Any]]:
    weight = w_out(view, layer)
    name, transposed = hf_param(view.model, layer, weight)
    flat = weight.detach().float().flatten()
    mean, std, mags = float(flat.mean()), float(flat.std()), flat.abs()
    rows = []
    for n in neurons:
        value = float(weight[n, dim].detach())
        row, col = (dim, n) if transposed else (n, dim)
        rows.append(dict(pos=pos, dim=dim, layer=layer, neuron=n, value=value, zscore=(value - mean) / std,
                         rank=int((mags > abs(value)).sum()) + 1, n_entries=len(flat),
                         hf_param=name, hf_row=row, hf_col=col))
    return rows


def _sources(cap: Capture, layer: int, i: int) -> list[tuple[str, int, Tensor]]:
    """(label, layer, full vector at the position) of everything written before MLP ``layer``."""
    out = [("embed", 0, cap.embed[i])]
    if cap.pos_embed is not None:
        out.append(("pos_embed", 0, cap.pos_embed[i]))
    for j in range(layer + 1):
        out.append(("attn", j, cap.layers["attn"][j, i]))
        if j < layer:
            out.append(("mlp", j, cap.layers["mlp"][j, i]))
    return out


def why_rows(view: ModelView, cap: Capture, event: dict[str, Any], neurons: Sequence[int]) -> list[dict[str, Any]]:
    """Attribute each neuron's pre-activation(s) at the position to the upstream components,
    through ``ln2`` at its measured scale (centred first for LayerNorm); the norm's bias and the
    MLP's input bias form one more source, ``bias``."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    mlp = view.model.blocks[layer].mlp
    weight, bias, centred = norm_affine(view.model.blocks[layer].ln2, view.d_model, view.dtype)
    scale = float(cap.layers["scale"][layer, i])
    inputs = [("gate", mlp.W_gate, None, "pre"), ("up", mlp.W_in, None, "up")] if cap.gated else \
        [("pre", mlp.W_in, getattr(mlp, "b_in", None), "pre")]
    sources = _sources(cap, layer, i)
    vectors = torch.stack([v - v.mean() if centred else v for _, _, v in sources]) * weight / scale
    rows = []
    for label, matrix, b_in, key in inputs:
        cols = matrix.detach().float().cpu()[:, list(neurons)]  # [d_model, n]
        parts = vectors @ cols  # [sources, n]
        extra = bias @ cols + (b_in.detach().float().cpu()[list(neurons)] if b_in is not None else 0.0)
        for k, n in enumerate(neurons):
            value = float(cap.layers[key][layer, i, n])
            named_parts = [(s, sl, float(parts[j, k])) for j, (s, sl, _) in enumerate(sources)]
            named_parts.append(("bias", layer, float(extra[k])))
            for source, source_layer, c in named_parts:
                rows.append(dict(pos=pos, dim=dim, layer=layer, neuron=n, input=label, source=source,
                                 source_layer=source_layer, contribution=c,
                                 share=c / value if value else math.nan, value=value))
    return rows
