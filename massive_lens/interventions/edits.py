"""The edit functions of the interventions, one per hook kind, bound with ``functools.partial``
(like TransformerLens's ``patching.py``): the residual-stream step (targets, online sinks,
the edit, the record), the attention edits (drop the sinks, replace the sink term, the bias
slot), the record of the attention still on the sinks (a reducer over the attention pass's layers)
and the residual patch.

>>> state = HookState(sinks=[0])
>>> pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
>>> drop_sinks(pattern, None, state=state, renormalize=True)[0, 0].tolist()
[[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.patching import layer_pos_patch_setter

from massive_lens.attention.sinks import sink_term
from massive_lens.core.attention_pass import PassLayer
from massive_lens.core.criterion import Criterion
from massive_lens.interventions.calibration_result import massive_entries, online_sinks
from massive_lens.interventions.state import HookState


@dataclass(frozen=True)
class ResidPlan:
    """What the resid_post hook of one layer does (column indices into the calibrated dims)."""

    layer: int
    first: Tensor  # dims first massive here: their targets are set here
    edit: Tensor  # dims edited here
    fill: Tensor | Callable | None  # the value each edited dim gets, or a draw of them (None: no edit)
    measure: Tensor  # dims whose targets' |value| is recorded here
    detect: bool  # find the later sinks online here
    last_first: bool  # the last layer where targets are set (record them)
    sticky: bool  # where="every": edit the targets too, not only entries massive now
    control: bool


def reset(act: Tensor, hook: Any, *, state: HookState) -> None:
    state.reset()


def resid_step(resid: Float[Tensor, "batch pos d_model"], hook: Any, *, state: HookState, dims: Tensor,
                plan: ResidPlan, criterion: Criterion) -> Tensor:
    """Set targets and find sinks (on the values as they arrive), edit, then record what stays."""
    hits = massive_entries(resid, dims, criterion) if len(plan.first) or len(plan.edit) else None
    if plan.detect:
        state.sinks = online_sinks(resid, state.calib)
    if len(plan.first):
        if state.targets is None or state.targets.shape[:2] != resid.shape[:2]:
            state.targets = torch.zeros(*resid.shape[:2], len(dims), dtype=torch.bool, device=resid.device)
        state.targets[..., plan.first] = hits[..., plan.first]
        if plan.last_first:
            state.record.targets.append(state.targets.any(-1).cpu())
    out = resid
    if plan.fill is not None and len(plan.edit):
        where = hits[..., plan.edit]
        if plan.sticky and state.targets is not None:
            where = where | state.targets[..., plan.edit]
        out = resid.clone()
        if plan.control:
            massive = torch.zeros_like(resid, dtype=torch.bool)
            massive[..., dims.to(resid.device)] = hits
            zero_median_entries(out, where.sum((1, 2)), massive=massive)
        else:
            cols = dims[plan.edit].to(resid.device)
            fill = plan.fill(tuple(resid.shape[:2])) if callable(plan.fill) else plan.fill
            out[..., cols] = torch.where(where, fill.to(out), out[..., cols])
            for dim, n in zip(dims[plan.edit].tolist(), where.sum((0, 1)).tolist(), strict=True):
                if n:
                    state.record.edited[dim] = state.record.edited.get(dim, 0) + int(n)
    if len(plan.measure) and state.targets is not None:
        targets = state.targets[..., plan.measure].to(torch.float32)
        values = out.detach()[..., dims[plan.measure].to(out.device)].abs().float()
        state.record.add_values(plan.layer, dims[plan.measure].tolist(), (values * targets).sum((0, 1)).double().cpu(),
                                targets.sum((0, 1)).double().cpu())
    return out


def zero_median_entries(resid: Float[Tensor, "batch pos d_model"], counts: Tensor,
                         massive: Bool[Tensor, "batch pos d_model"]) -> None:
    """Zero, per sequence, ``counts[b]`` non-massive entries whose magnitude is nearest the
    median magnitude of the hidden state (the paper's control)."""
    for b, k in enumerate(counts.tolist()):
        if k:
            mag = resid[b].abs().flatten()
            gap = (mag - mag.median()).abs().masked_fill(massive[b].flatten(), float("inf"))
            resid[b].view(-1)[gap.topk(int(k), largest=False).indices] = 0.0


def record_sink_attention(at: PassLayer, *, state: HookState, first: int) -> None:
    """Record the attention non-sink queries still pay to the sinks (and to a bias slot) at one
    layer of the attention pass, whichever path read it: ``at.cols`` are the columns of
    :meth:`~massive_lens.interventions.state.HookState.sink_columns` (the sinks of this forward), read
    after the intervention's own edits; the sinks themselves are recorded at layer ``first``. Only in
    the passes its hooks run in (the fused kernel also reads a pass run without them, such as the
    perplexity's check of its output head)."""
    if not state.passes:
        return
    batch, heads, queries_n, pos = at.shape
    sinks = state.mask(batch, pos, at.cols.device)
    if at.layer == first:
        state.record.sinks.append(sinks.cpu())
    cols = sinks.any(0).nonzero().flatten()
    queries = (~sinks).to(torch.float32)
    n = float(queries.sum()) * heads
    total = torch.einsum("bhqc,bc,bq->", at.cols.detach().float(), sinks[:, cols].to(torch.float32), queries)
    state.record.add_mass(state.record.mass, at.layer, float(total), n)
    slot = state.stash.get("slot")
    if slot is not None and slot.shape[-1] == queries_n:
        state.record.add_mass(state.record.slot, at.layer,
                              float(torch.einsum("bhq,bq->", slot.detach().float(), queries)), n)


def drop_sinks(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *, state: HookState,
                renormalize: bool) -> Tensor:
    sinks = state.mask(pattern.shape[0], pattern.shape[-1], pattern.device)
    kept = pattern * (~sinks)[:, None, None, :].to(pattern.dtype)
    if renormalize:
        total = kept.sum(-1, keepdim=True)
        kept = torch.where(total > 1e-9, kept / total.clamp(min=1e-9), pattern)
    return torch.where(sinks[:, None, :, None], pattern, kept)  # sink queries keep their own row


def replace_sink_term(z: Float[Tensor, "batch pos head_index d_head"], hook: Any, *, state: HookState,
                       mean: Tensor | None) -> Tensor:
    sinks = state.mask(z.shape[0], z.shape[1], z.device)
    sink_z = sink_term(state.stash["pattern"], state.stash["v"], sinks)
    target = torch.zeros_like(sink_z) if mean is None else mean.to(z).expand_as(sink_z)
    edited = z - sink_z + target
    return torch.where(sinks[:, :, None, None], z, edited)  # sink queries keep their own output


def slot_pattern(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *, state: HookState,
                  key: Tensor, scale: float) -> Tensor:
    """softmax over [scores without sink keys, q . k' * scale]; the slot's share is stashed."""
    sinks = state.mask(pattern.shape[0], pattern.shape[-1], pattern.device)
    q = state.stash["q"]  # [batch query head d_head]
    group = q.shape[2] // key.shape[0]
    slot = torch.einsum("bqhd,hd->bhq", q, key.to(q).repeat_interleave(group, 0)) * scale
    scores = state.stash["scores"].masked_fill(sinks[:, None, None, :], float("-inf"))
    full = torch.cat([scores, slot[..., None]], -1).softmax(-1)
    state.stash["slot"] = full[..., -1]
    return full[..., :-1].to(pattern.dtype)


def add_slot_value(z: Float[Tensor, "batch pos head_index d_head"], hook: Any, *, state: HookState,
                    value: Tensor) -> Tensor:
    group = z.shape[2] // value.shape[0]
    share = state.stash["slot"]  # [batch head query]
    return z + torch.einsum("bhq,hd->bqhd", share.to(z), value.to(z).repeat_interleave(group, 0))


def put_template(act: Float[Tensor, "batch pos d_model"], hook: Any, *, state: HookState, vector: Tensor) -> Tensor:
    """A norm's output at the targeted positions set to the calibrated post-norm ``vector``."""
    if state.targets is None or tuple(state.targets.shape[:2]) != tuple(act.shape[:2]):
        return act
    where = state.targets.any(-1).to(act.device)
    return torch.where(where[..., None], vector.to(act), act)


def keep(act: Tensor, hook: Any, *, cache: dict[str, Tensor], name: str) -> None:
    cache[name] = act.detach().clone()


def patch_positions(resid: Float[Tensor, "batch pos d_model"], hook: Any, *, clean: Tensor,
                     positions: list[int]) -> Tensor:
    resid = resid.clone()
    for pos in positions:
        if pos < resid.shape[1]:
            layer_pos_patch_setter(resid, (None, pos), clean.to(resid).expand(resid.shape[0], -1, -1))
    return resid
