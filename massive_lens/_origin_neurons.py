"""Neuron-level pieces of :func:`massive_lens.trace_origin`: per-neuron contributions,
super weights, why-this-token attributions and the causal checks (``verify=True``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens._model_view import Batch, ModelView
from massive_lens._origin_capture import Capture, norm_affine, post_norm_factor

NEURON_COLUMNS = ["pos", "dim", "layer", "kind", "neuron", "contribution", "share", "named", "post", "pre", "up",
                  "w_out"]
NAMED_SHARE = 0.9  # name same-sign neurons, largest first, until they explain 90% of the MLP's term ...
NAMED_MIN = 0.02  # ... skipping any below 2% of it
SUPER_COLUMNS = ["pos", "dim", "layer", "neuron", "value", "zscore", "rank", "n_entries",
                 "hf_param", "hf_row", "hf_col"]
WHY_COLUMNS = ["pos", "dim", "layer", "neuron", "input", "source", "source_layer", "contribution", "share", "value"]
VERIFY_COLUMNS = ["pos", "dim", "intervention", "scope", "layer", "neurons", "value", "ablated", "remaining",
                  "last_layer", "value_last", "ablated_last", "remaining_last", "ppl", "ppl_ablated"]


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


# --------------------------------------------------------------------------- verification


@contextlib.contextmanager
def zeroed_weights(view: ModelView, entries: Sequence[tuple[int, int, int]]) -> Iterator[None]:
    """Temporarily zero ``W_out[neuron, dim]`` of each (layer, neuron, dim); always restored."""
    saved = []
    try:
        with torch.no_grad():
            for layer, n, d in entries:
                weight = w_out(view, layer)
                saved.append((weight, n, d, weight[n, d].clone()))
                weight[n, d] = 0.0
        yield
    finally:
        with torch.no_grad():
            for weight, n, d, value in reversed(saved):
                weight[n, d] = value


def _mask_hook(mask: Float[Tensor, "batch d_mlp"]):
    """Multiply each batch row's neuron activations by its row of ``mask`` (0 = zeroed)."""

    def hook(post: Tensor, hook: Any) -> Tensor:
        return post * mask.to(post.device, post.dtype)[:, None, :]

    return hook


def neuron_hooks(view: ModelView, masks: dict[int, Tensor]) -> list[tuple[str, Any]]:
    return [(view.hook_name(layer, "mlp.hook_post"), _mask_hook(mask)) for layer, mask in masks.items()]


def _masks(by_layers: Sequence[dict[int, list[int]]], d_mlp: int) -> dict[int, Tensor]:
    """Per layer, a ``[len(by_layers), d_mlp]`` keep-mask: row ``i`` zeroes ``by_layers[i]``."""
    masks: dict[int, Tensor] = {}
    for row, by_layer in enumerate(by_layers):
        for layer, ns in by_layer.items():
            masks.setdefault(layer, torch.ones(len(by_layers), d_mlp))[row, ns] = 0.0
    return masks


def resid_at(
    view: ModelView, batch: Batch, pos: int, dim: int, hooks: list[tuple[str, Any]]
) -> Float[Tensor, "batch layer"]:
    """``resid_post[:, pos, dim]`` at every layer under ``hooks`` (stops before the unembedding)."""
    values = torch.zeros(batch.tokens.shape[0], view.n_layers)

    def grab(layer: int):
        def hook(resid: Tensor, hook: Any) -> None:
            values[:, layer] = resid[:, pos, dim].detach().float().cpu()

        return hook

    names = [view.hook_name(layer, "resid_post") for layer in range(view.n_layers)]
    view.forward(batch, list(hooks) + [(n, grab(layer)) for layer, n in enumerate(names)], stop_after=names[-1])
    return values


def ppl(model: Any, tokens: Tensor | None, hooks: list[tuple[str, Any]]) -> float:
    if tokens is None:
        return math.nan
    from massive_lens.evaluate import perplexity

    return perplexity(model, tokens, hooks=hooks, progress=False).perplexity


def verification_rows(
    view: ModelView, batch: Batch, base: Float[Tensor, " layer"], births: list[dict[str, Any]],
    neurons: pd.DataFrame, peak_layer: int, tokens: Tensor | None, base_ppl: float,
) -> list[dict[str, Any]]:
    """Zero the named neurons (then, separately, only their ``W_out[n, dim]`` weights) of each
    MLP birth and of all births together; measure what is left of the value, and perplexity.

    Neuron ablations of all scopes run as one batched pass (row ``i`` zeroes scope ``i``);
    weight ablations edit the weights, so each scope has its own pass (weights restored)."""
    scopes = [(f"MLP {b['layer']}", b["layer"], [b]) for b in births]
    if len(births) > 1:
        scopes.append(("all births", peak_layer, births))
    chosen = []
    for scope, layer, events in scopes:
        by_layer = {e["layer"]: named(neurons, e) for e in events}
        by_layer = {k: v for k, v in by_layer.items() if v}
        if by_layer:
            chosen.append((scope, layer, by_layer))
    if not chosen:
        return []
    pos, dim = births[0]["pos"], births[0]["dim"]
    d_mlp = w_out(view, births[0]["layer"]).shape[0]
    rep = Batch(batch.tokens.repeat(len(chosen), 1), batch.mask.repeat(len(chosen), 1), batch.has_bos)
    by_neurons = resid_at(view, rep, pos, dim, neuron_hooks(view, _masks([c[2] for c in chosen], d_mlp)))
    rows = []
    for i, (scope, layer, by_layer) in enumerate(chosen):
        hooks = neuron_hooks(view, _masks([by_layer], d_mlp))
        with zeroed_weights(view, [(k, n, dim) for k, ns in by_layer.items() for n in ns]):
            by_weights = resid_at(view, batch, pos, dim, [])[0]
            weights_ppl = ppl(view.model, tokens, [])
        for intervention, ablated, after_ppl in (("zero_neurons", by_neurons[i], ppl(view.model, tokens, hooks)),
                                                 ("zero_super_weights", by_weights, weights_ppl)):
            rows.append(_row(pos, dim, intervention, scope, layer, by_layer, base, ablated, base_ppl, after_ppl))
    return rows


def _row(pos: int, dim: int, intervention: str, scope: str, layer: int, by_layer: dict[int, list[int]],
         base: Tensor, ablated: Tensor, base_ppl: float, after_ppl: float) -> dict[str, Any]:
    last = len(base) - 1
    return dict(pos=pos, dim=dim, intervention=intervention, scope=scope, layer=layer,
                neurons=", ".join(f"{k}:{n}" for k, ns in by_layer.items() for n in ns),
                value=float(base[layer]), ablated=float(ablated[layer]), remaining=float(ablated[layer] / base[layer]),
                last_layer=last, value_last=float(base[last]), ablated_last=float(ablated[last]),
                remaining_last=float(ablated[last] / base[last]), ppl=base_ppl, ppl_ablated=after_ppl)
