"""Neuron-level pieces of :func:`massive_lens.trace_origin`: per-neuron contributions,
super weights and why-this-token attributions.

A neuron is ``(expert, neuron)``: ``expert`` is -1 for a dense MLP (and for a mixture of
experts' shared expert), else the routed expert (:mod:`massive_lens.origin.experts`), whose
terms are weighted by the router (``route``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import rel_error
from massive_lens.core.weight_cache import derived
from massive_lens.origin.blocks import block_plan
from massive_lens.origin.capture import Capture
from massive_lens.origin.experts import CHECK_TOL, SHARED, UnitTerms, input_columns, unit_terms
from massive_lens.origin.norms import norm_affine, norm_scale, post_norm_factor

NEURON_COLUMNS = ["pos", "dim", "layer", "kind", "expert", "neuron", "contribution", "share", "named", "post", "pre",
                  "up", "w_out", "route"]
NAMED_SHARE = 0.9  # name same-sign neurons, largest first, until they explain 90% of the MLP's term ...
NAMED_MIN = 0.02  # ... skipping any below 2% of it
SUPER_COLUMNS = ["pos", "dim", "layer", "expert", "neuron", "value", "zscore", "rank", "n_entries",
                 "hf_param", "hf_row", "hf_col"]
WHY_COLUMNS = ["pos", "dim", "layer", "expert", "neuron", "input", "source", "source_layer", "contribution", "share",
               "value"]
Unit = int | tuple[int, int]  # a dense MLP's neuron, or (expert, neuron)


def w_out(view: ModelView, layer: int) -> Float[Tensor, "d_mlp d_model"]:
    return view.block(layer).mlp.W_out


def neuron_rows(view: ModelView, cap: Capture, event: dict[str, Any], top_k: int) -> list[dict[str, Any]]:
    """Top ``top_k`` neurons (by |contribution|) of one MLP event at its (pos, dim); none for an
    MLP without neurons (a mixture of experts), or (with a note) when the neuron terms do not
    add up to the MLP's term."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    plan = cap.plans[layer]
    if plan.experts is not None:
        return _expert_rows(cap, event, top_k)
    if cap.at("post", layer) is None:
        return []
    factor = post_norm_factor(cap, layer, i, dim) if plan.post_norm else 1.0
    weights = w_out(view, layer)[:, dim].detach().float().cpu()
    post = cap.row("post", layer, i)
    contrib = post * weights * factor
    total = float(event["contribution"])
    b_out = getattr(view.block(layer).mlp, "b_out", None)
    bias = float(b_out[dim].detach()) * factor if isinstance(b_out, Tensor) else 0.0
    if abs(float(contrib.sum()) + bias - total) > CHECK_TOL * max(abs(total), 1e-6):
        cap.notes.append(f"warning: the neuron terms of MLP {layer} sum to {float(contrib.sum()) + bias:.4g}, not "
                         f"to its term {total:.4g} at pos {pos}, dim {dim}: its hooks are not post @ W_out; no "
                         "neuron rows for it")
        return []
    up = cap.row("up", layer, i) if plan.gated else torch.full_like(post, math.nan)
    units = UnitTerms(torch.full((len(post),), -1), torch.arange(len(post)), contrib, post, cap.row("pre", layer, i),
                      up, weights, torch.ones(len(post)), bias)
    return _top_rows(event, units, top_k)


def _top_rows(event: dict[str, Any], units: UnitTerms, top_k: int) -> list[dict[str, Any]]:
    """The ``top_k`` units by |contribution|, the same-sign largest named (see ``NAMED_SHARE``)."""
    total = float(event["contribution"])
    rows, explained = [], 0.0
    for k in units.contribution.abs().topk(min(top_k, len(units.contribution))).indices.tolist():
        share = float(units.contribution[k]) / total if total else math.nan
        is_named = explained < NAMED_SHARE and share >= NAMED_MIN
        explained += share if is_named else 0.0
        rows.append(dict(pos=event["pos"], dim=event["dim"], layer=event["layer"], kind=event["kind"],
                         expert=int(units.expert[k]), neuron=int(units.neuron[k]),
                         contribution=float(units.contribution[k]), share=share, named=is_named,
                         post=float(units.post[k]), pre=float(units.pre[k]), up=float(units.up[k]),
                         w_out=float(units.w_out[k]), route=float(units.route[k])))
    return rows


def _expert_rows(cap: Capture, event: dict[str, Any], top_k: int) -> list[dict[str, Any]]:
    """Top (expert, neuron) units of a mixture-of-experts event, checked to add up."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    plan = cap.plans[layer]
    factor = post_norm_factor(cap, layer, i, dim) if plan.post_norm else 1.0
    raw = cap.at("mlp_raw", layer) if plan.post_norm else cap.layers["mlp"][layer]
    units = unit_terms(plan.experts, _moe_data(cap, layer), i, dim, raw[i])
    total = float(event["contribution"])
    if units is not None:
        units.contribution = units.contribution * factor
        units.bias *= factor
    if units is None or abs(float(units.contribution.sum()) + units.bias - total) > CHECK_TOL * max(abs(total), 1e-6):
        cap.notes.append(f"warning: the expert neurons of MLP {layer} do not add up to its term at pos {pos}, dim "
                         f"{dim} (router-weighted expert outputs plus the shared expert): no neuron rows for it")
        return []
    return _top_rows(event, units, top_k)


def _moe_data(cap: Capture, layer: int) -> dict[str, Tensor]:
    return {k[4:]: v for k, v in cap.neuron_data.get(layer, {}).items() if k.startswith("moe_")}


def named(neurons: pd.DataFrame | list[dict[str, Any]], event: dict[str, Any], *, experts: bool = True) -> list[Unit]:
    """The neurons an event's story names: same sign as the event, largest first, until they
    explain 90% of the MLP's term (see ``NAMED_SHARE``); ``(expert, neuron)`` in a mixture of
    experts (none with ``experts=False``)."""
    if isinstance(neurons, pd.DataFrame):
        at = (neurons.pos == event["pos"]) & (neurons.dim == event["dim"]) & (neurons.layer == event["layer"])
        rows = neurons[at]
        rows = rows[rows.named.astype(bool)].to_dict("records")  # astype: an empty frame's column is object-typed
    else:  # the event's own rows, as neuron_rows returns them
        rows = [r for r in neurons if r["named"]]
    if not any(r.get("expert", -1) >= 0 for r in rows):
        return [int(r["neuron"]) for r in rows]
    return [(int(r["expert"]), int(r["neuron"])) for r in rows] if experts else []


def _hf_names(model: Any, fresh: bool = False) -> dict[tuple[int, int], tuple[str, tuple[int, ...]]]:
    """``(data_ptr, numel)`` -> (name, shape) of the Hugging Face parameters (the first name of a shared one;
    empty without ``original_model``): one scan, kept with the Hugging Face model (``fresh``: scanned again)
    and checked where it is used (:func:`hf_param`)."""
    hf = getattr(model, "original_model", None)
    if hf is None:
        return {}
    kept = None if fresh else _NAMES.get(hf)
    if kept is None:
        kept = _NAMES[hf] = _scan(hf)
    return kept[0]


def _scan(hf: Any) -> tuple[dict[tuple[int, int], tuple[str, tuple[int, ...]]], dict[tuple[int, int], str]]:
    """:func:`_hf_names`' map, and each parameter's path as ``get_parameter`` reads it."""
    names: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}
    paths: dict[tuple[int, int], str] = {}
    stack, seen = [("", hf)], set()
    while stack:  # named_parameters()' order (modules first to last, each once), a plain walk: ~5x faster
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, param in module._parameters.items():
            if param is not None and (key := (param.data_ptr(), param.numel())) not in names:
                names[key] = ((prefix + name).replace("._original_component", ""), tuple(param.shape))
                paths[key] = prefix + name
        stack.extend(reversed([(f"{prefix}{name}.", child) for name, child in module._modules.items()
                               if child is not None]))
    return names, paths


def _still_there(model: Any, key: tuple[int, int]) -> bool:
    """Whether the kept path of the parameter ``key`` names still holds that storage (the model may have changed
    since its names were scanned)."""
    try:
        param = model.original_model.get_parameter(_NAMES[model.original_model][1][key])
    except (AttributeError, KeyError):
        return False
    return (param.data_ptr(), param.numel()) == key


def hf_param(model: Any, layer: int, weight: Tensor) -> tuple[str, bool]:
    """Name of the Hugging Face parameter behind ``W_out`` and whether it is stored transposed
    (``down_proj.weight[dim, neuron]``), found by shared storage (in ``_hf_names``' kept map, scanned
    again where it misses or no longer holds); TL naming otherwise."""
    key = (weight.data_ptr(), weight.numel())
    found = _hf_names(model).get(key)
    if getattr(model, "original_model", None) is not None and (found is None or not _still_there(model, key)):
        found = _hf_names(model, fresh=True).get(key)
    if found is not None:
        return found[0], found[1] != tuple(weight.shape)
    return ModelView.block_param(layer, "mlp.W_out"), False


# per Hugging Face model: _scan's names and paths (checked where used: hf_param)
_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def super_weight_rows(view: ModelView, pos: int, dim: int, layer: int, neurons: Sequence[Unit],
                      seen: dict[Any, Any] | None = None) -> list[dict[str, Any]]:
    """``W_out[neuron, dim]`` of each named neuron (an expert's down weight, by expert), with
    its z-score and rank among the matrix's entries and its Hugging Face name and index.
    ``seen`` (a dict kept by the caller for one trace) holds each layer's matrix statistics, so
    several births in one layer read its ``W_out`` once."""
    if not neurons:
        return []
    if isinstance(neurons[0], tuple):
        return _expert_super_rows(view, pos, dim, layer, neurons)
    weight = w_out(view, layer)
    seen = {} if seen is None else seen
    if layer not in seen:
        mags = weight.detach().float()
        mags = mags.T if mags.T.is_contiguous() else mags.contiguous()  # the stored order: no copy
        stats = derived(weight, None, "entry_mean_std", lambda _: _mean_std(mags))  # kept with the parameter
        ranks = EntryRanks(mags, view.block(layer).mlp)  # its tail kept with the MLP
        seen[layer] = (*hf_param(view.model, layer, weight), *stats, ranks)
    name, transposed, mean, std, ranks = seen[layer]
    rows = []
    for n in neurons:
        value = float(weight[n, dim].detach())
        row, col = (dim, n) if transposed else (n, dim)
        rows.append(dict(pos=pos, dim=dim, layer=layer, expert=-1, neuron=n, value=value, zscore=(value - mean) / std,
                         rank=ranks.rank(value), n_entries=ranks.n, hf_param=name, hf_row=row, hf_col=col))
    return rows


class EntryRanks:
    """Ranks by magnitude among a matrix's entries: ``rank(v)`` is one plus the number of
    entries with ``|entry| > |v|``. The largest ``TAIL`` share of magnitudes is kept sorted, with
    the matrix's parameter while it is unchanged (:func:`~massive_lens.core.weight_cache.derived`),
    so a large value, as a super weight is, costs a binary search and a smaller one a count over
    the matrix. Exact either way.

    >>> ranks = EntryRanks(torch.tensor([[3.0, -1.0], [0.5, -7.0]]))
    >>> ranks.rank(-7.0), ranks.rank(1.0), ranks.rank(0.1)
    (1, 3, 5)
    """

    TAIL = 0.01
    SAMPLE = 20_000  # magnitudes read to place the tail's floor

    def __init__(self, matrix: Tensor, owner: Any = None):
        self.matrix = matrix.detach()
        self.n = self.matrix.numel()
        self.floor, self.tail = derived(self.matrix, owner, "entry_tail", _tail)  # owner: see derived
        cpu = self.matrix.device.type == "cpu" and self.matrix.dtype == torch.float32
        self.array = self.matrix.numpy() if cpu else None  # NumPy counts 4-5x faster than torch on the CPU

    def rank(self, value: float) -> int:
        v = abs(value)
        if v >= self.floor:  # every entry larger than v is in the tail
            return len(self.tail) - int(np.searchsorted(self.tail, v, side="right")) + 1
        m = self.matrix if self.array is None else self.array  # |entry| > v, counted without a copy of |entry|
        count = np.count_nonzero if self.array is not None else torch.count_nonzero
        return int(count(m > v)) + int(count(m < -v)) + 1


def _tail(matrix: Tensor) -> tuple[float, np.ndarray]:
    """The floor above which :attr:`EntryRanks.TAIL` of a matrix's magnitudes lie (placed on a sample of
    :attr:`EntryRanks.SAMPLE`), and every magnitude above it, sorted."""
    mags = matrix.float().abs().flatten().cpu().numpy()
    if not len(mags):
        return math.inf, mags
    floor = float(np.quantile(mags[:: max(1, len(mags) // EntryRanks.SAMPLE)], 1 - EntryRanks.TAIL))
    return floor, np.sort(mags[mags > floor])


def _mean_std(matrix: Tensor) -> tuple[float, float]:
    """Mean and (n - 1) standard deviation of a matrix's entries, in two float32 passes (torch's
    cascade sums; ``torch.std_mean`` is several times slower on a large matrix)."""
    mean = matrix.mean()
    return float(mean), float(torch.linalg.vector_norm(matrix - mean)) / math.sqrt(max(matrix.numel() - 1, 1))


def _expert_super_rows(view: ModelView, pos: int, dim: int, layer: int,
                       units: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    experts = block_plan(view, layer).experts
    rows = []
    for e, n in units:
        if e == SHARED:
            down = experts.shared_down.weight.detach().float().cpu().T
            name, row, col = f"{experts.shared_path}.weight", dim, n
        else:
            down = experts.down(e)
            name, row, col = experts.super_name(e, n, dim)
        flat = down.flatten()
        value = float(down[n, dim])
        rows.append(dict(pos=pos, dim=dim, layer=layer, expert=e, neuron=n, value=value,
                         zscore=(value - float(flat.mean())) / float(flat.std()),
                         rank=int((flat.abs() > abs(value)).sum()) + 1, n_entries=len(flat),
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


def why_rows(view: ModelView, cap: Capture, event: dict[str, Any], neurons: Sequence[Unit]) -> list[dict[str, Any]]:
    """Attribute each neuron's pre-activation(s) at the position to the upstream components,
    through the MLP's input norm (``ln2``; ``ln1`` when a parallel block shares it; none with
    post-norms only) at its measured scale (centred first for LayerNorm); the norm's bias and
    the MLP's input bias form one more source, ``bias``. In a parallel block the same block's
    attention is not upstream of its MLP. Checked: the sources must add up to the MLP's measured
    input (else no rows, and a note says why)."""
    layer, pos, dim = event["layer"], event["pos"], event["dim"]
    i = cap.index(pos)
    plan = cap.plans[layer]
    columns = _input_columns(view, cap, layer, i, neurons)
    if columns is None:
        return []
    norm = getattr(view.block(layer), plan.mlp_norm) if plan.mlp_norm else None
    if layer not in cap.norms:  # probed once per layer and trace
        cap.norms[layer] = norm_affine(norm, view.d_model, view.dtype)
    weight, bias, centred = cap.norms[layer]
    sources = _sources(cap, layer, i)
    total, measured = torch.stack([v for _, _, v in sources]).sum(0), cap.row("norm_in", layer, i)
    miss = rel_error(total, measured)
    if miss > CHECK_TOL:
        cap.notes.append(f"warning: the components upstream of MLP {layer} miss its input by {miss:.1e} (relative) "
                         f"at pos {pos}: this block's MLP does not read the residual stream as assumed; no "
                         "why-this-token rows for it")
        return []
    scale = norm_scale(cap, layer, i, weight, bias, centred)
    vectors = torch.stack([v - v.mean() if centred else v for _, _, v in sources]) * weight / scale
    rows = []
    for label, cols, b_in, values in columns:
        parts = vectors @ cols  # [sources, n]
        extra = bias @ cols + b_in
        off = float(((parts.sum(0) + extra) - values).abs().max() / values.abs().max().clamp(min=1e-6))
        if off > CHECK_TOL:
            cap.notes.append(f"warning: the upstream sources of MLP {layer}'s {label} pre-activations miss them by "
                             f"{off:.1e} (relative) at pos {pos}: its input norm is not linearised as assumed; no "
                             "why-this-token rows for it")
            return []
        for k, unit in enumerate(neurons):
            expert, n = unit if isinstance(unit, tuple) else (-1, unit)
            value = float(values[k])
            named_parts = [(s, sl, float(parts[j, k])) for j, (s, sl, _) in enumerate(sources)]
            named_parts.append(("bias", layer, float(extra[k])))
            for source, source_layer, c in named_parts:
                rows.append(dict(pos=pos, dim=dim, layer=layer, expert=expert, neuron=n, input=label, source=source,
                                 source_layer=source_layer, contribution=c,
                                 share=c / value if value else math.nan, value=value))
    return rows


def _input_columns(view: ModelView, cap: Capture, layer: int, i: int,
                   neurons: Sequence[Unit]) -> list[tuple[str, Tensor, Tensor, Tensor]] | None:
    """Per pre-activation kind (``gate``, ``up`` or ``pre``): the units' input weights
    ``[d_model, n]``, biases ``[n]`` and measured values ``[n]``; None where not available."""
    plan = cap.plans[layer]
    if plan.experts is not None:
        data = _moe_data(cap, layer)
        found = input_columns(plan.experts, list(neurons)) if "x" in data else None
        if found is None:
            cap.notes.append(f"note: MLP {layer}'s expert neurons are named, but their pre-activations are not "
                             "split (a custom expert gate, or a shared expert's neuron): no why-this-token rows")
            return None
        x = data["x"][i]
        return [(label, cols, b, x @ cols + b) for label, cols, b in found]
    if cap.at("post", layer) is None:
        return None
    mlp = view.block(layer).mlp
    inputs = [("gate", mlp.W_gate, None, "pre"), ("up", mlp.W_in, None, "up")] if plan.gated else \
        [("pre", mlp.W_in, getattr(mlp, "b_in", None), "pre")]
    out = []
    for label, matrix, b_in, key in inputs:
        cols = matrix.detach().float().cpu()[:, list(neurons)]
        b = b_in.detach().float().cpu()[list(neurons)] if isinstance(b_in, Tensor) else torch.zeros(len(neurons))
        out.append((label, cols, b, cap.row(key, layer, i)[list(neurons)]))
    return out
