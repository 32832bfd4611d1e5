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
from massive_lens.origin.capture import Capture, norm_affine, norm_scale, post_norm_factor

NEURON_COLUMNS = ["pos", "dim", "layer", "kind", "neuron", "contribution", "share", "named", "post", "pre", "up",
                  "w_out"]
NAMED_SHARE = 0.9  # name same-sign neurons, largest first, until they explain 90% of the MLP's term ...
NAMED_MIN = 0.02  # ... skipping any below 2% of it
SUPER_COLUMNS = ["pos", "dim", "layer", "neuron", "value", "zscore", "rank", "n_entries",
                 "hf_param", "hf_row", "hf_col"]
WHY_COLUMNS = ["pos", "dim", "layer", "neuron", "input", "source", "source_layer", "contribution", "share", "value"]
CHECK_TOL = 1e-3  # relative: neuron terms vs the MLP's term, sources vs the MLP's input


def w_out(view: ModelView, layer: int) -> Float[Tensor, "d_mlp d_model"]:
    return view.model.blocks[layer].mlp.W_out


def neuron_rows(view: ModelView, cap: Capture, event: dict[str, Any], top_k: int) -> list[dict[str, Any]]:
    """Top ``top_k`` neurons (by |contribution|) of one MLP event at its (pos, dim); none for an
    MLP without neurons (a mixture of experts), or (with a note) when the neuron terms do not
    add up to the MLP's term."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    plan = cap.plans[layer]
    if cap.at("post", layer) is None:
        return []
    factor = post_norm_factor(cap, layer, i, dim) if plan.post_norm else 1.0
    weights = w_out(view, layer)[:, dim].detach().float().cpu()
    post = cap.at("post", layer)[i]
    contrib = post * weights * factor
    total = float(event["contribution"])
    b_out = getattr(view.model.blocks[layer].mlp, "b_out", None)
    bias = float(b_out[dim].detach()) * factor if isinstance(b_out, Tensor) else 0.0
    if abs(float(contrib.sum()) + bias - total) > CHECK_TOL * max(abs(total), 1e-6):
        cap.notes.append(f"warning: the neuron terms of MLP {layer} sum to {float(contrib.sum()) + bias:.4g}, not "
                         f"to its term {total:.4g} at pos {pos}, dim {dim}: its hooks are not post @ W_out; no "
                         "neuron rows for it")
        return []
    rows, explained = [], 0.0
    for n in contrib.abs().topk(min(top_k, len(contrib))).indices.tolist():
        share = float(contrib[n]) / total if total else math.nan
        is_named = explained < NAMED_SHARE and share >= NAMED_MIN
        explained += share if is_named else 0.0
        up = float(cap.at("up", layer)[i, n]) if plan.gated else math.nan
        rows.append(dict(pos=pos, dim=dim, layer=layer, kind=event["kind"], neuron=n,
                         contribution=float(contrib[n]), share=share, named=is_named, post=float(post[n]),
                         pre=float(cap.at("pre", layer)[i, n]), up=up, w_out=float(weights[n])))
    return rows


def named(neurons: pd.DataFrame, event: dict[str, Any]) -> list[int]:
    """The neurons an event's story names: same sign as the event, largest first, until they
    explain 90% of the MLP's term (see ``NAMED_SHARE``)."""
    rows = neurons[(neurons.pos == event["pos"]) & (neurons.dim == event["dim"]) & (neurons.layer == event["layer"])]
    return rows[rows.named.astype(bool)].neuron.tolist()  # astype: an empty frame's column is object-typed


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
    if not neurons:
        return []
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
    """(label, layer, full vector at the position) of everything written before MLP ``layer``
    reads its input: the same block's attention too, unless the block is parallel (its MLP
    reads ``resid_pre``, like its attention)."""
    out = [("embed", 0, cap.embed[i])]
    if cap.pos_embed is not None:
        out.append(("pos_embed", 0, cap.pos_embed[i]))
    for j in range(layer + 1):
        if j < layer or not cap.plans[layer].parallel:
            out.append(("attn", j, cap.layers["attn"][j, i]))
        if j < layer:
            out.append(("mlp", j, cap.layers["mlp"][j, i]))
    return out


def why_rows(view: ModelView, cap: Capture, event: dict[str, Any], neurons: Sequence[int]) -> list[dict[str, Any]]:
    """Attribute each neuron's pre-activation(s) at the position to the upstream components,
    through the MLP's input norm (``ln2``; ``ln1`` when a parallel block shares it; none with
    post-norms only) at its measured scale (centred first for LayerNorm); the norm's bias and
    the MLP's input bias form one more source, ``bias``. In a parallel block the same block's
    attention is not upstream of its MLP. Checked: the sources must add up to the MLP's measured
    input (else no rows, and a note says why)."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    plan = cap.plans[layer]
    if cap.at("post", layer) is None:
        return []
    mlp = view.model.blocks[layer].mlp
    norm = getattr(view.model.blocks[layer], plan.mlp_norm) if plan.mlp_norm else None
    weight, bias, centred = norm_affine(norm, view.d_model, view.dtype)
    sources = _sources(cap, layer, i)
    total, measured = torch.stack([v for _, _, v in sources]).sum(0), cap.at("norm_in", layer)[i]
    miss = float((total - measured).abs().max() / measured.abs().max().clamp(min=1e-12))
    if miss > CHECK_TOL:
        cap.notes.append(f"warning: the components upstream of MLP {layer} miss its input by {miss:.1e} (relative) "
                         f"at pos {pos}: this block's MLP does not read the residual stream as assumed; no "
                         "why-this-token rows for it")
        return []
    scale = norm_scale(cap, layer, i, weight, bias, centred)
    inputs = [("gate", mlp.W_gate, None, "pre"), ("up", mlp.W_in, None, "up")] if plan.gated else \
        [("pre", mlp.W_in, getattr(mlp, "b_in", None), "pre")]
    vectors = torch.stack([v - v.mean() if centred else v for _, _, v in sources]) * weight / scale
    rows = []
    for label, matrix, b_in, key in inputs:
        cols = matrix.detach().float().cpu()[:, list(neurons)]  # [d_model, n]
        parts = vectors @ cols  # [sources, n]
        extra = bias @ cols + (b_in.detach().float().cpu()[list(neurons)] if b_in is not None else 0.0)
        values = cap.at(key, layer)[i, list(neurons)]
        off = float(((parts.sum(0) + extra) - values).abs().max() / values.abs().max().clamp(min=1e-6))
        if off > CHECK_TOL:
            cap.notes.append(f"warning: the upstream sources of MLP {layer}'s {label} pre-activations miss them by "
                             f"{off:.1e} (relative) at pos {pos}: its input norm is not linearised as assumed; no "
                             "why-this-token rows for it")
            return []
        for k, n in enumerate(neurons):
            value = float(values[k])
            named_parts = [(s, sl, float(parts[j, k])) for j, (s, sl, _) in enumerate(sources)]
            named_parts.append(("bias", layer, float(extra[k])))
            for source, source_layer, c in named_parts:
                rows.append(dict(pos=pos, dim=dim, layer=layer, neuron=n, input=label, source=source,
                                 source_layer=source_layer, contribution=c,
                                 share=c / value if value else math.nan, value=value))
    return rows
