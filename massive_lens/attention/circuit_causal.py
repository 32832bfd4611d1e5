"""The causal check of :func:`~massive_lens.attention.sink_circuit`: each removal alone, on a corpus.

For every sequence of the corpus, a clean pass splits the sink heads' key exactly
(:mod:`~massive_lens.attention.circuit_split`) and reads the loss; then one pass per removal,
each applied to every sink head at once and nowhere else:

- ``massive dims``: the massive dims projected out of the sink's key input in that layer only
  (their part of the key, at the norm's measured scale, is taken off the logit on the sink);
- ``dominant writer``: the head's dominant key-side writer's part of the key taken off;
- ``b_Q``: the query bias zeroed in the head (where the model has one; every key's logit moves);
- ``shared direction``: the sink key's component along the head's mean query (the ``W_K``
  direction the sink key and the queries share) taken off.

A key-side removal edits the scores on the sink only (``scores[:, h, i, sink] -= c q_i . part``
for queries after the sink), with each query as that pass computes it; the sink position's own
residual never changes (it attends only to itself), so the clean pass's parts stay exact. Each
removal is reported as the attention on the first token before and after and the next-token loss
ratio, with 95% intervals over sequences (normal approximation; the loss ratio paired).

**Controls of the same size.** Removing the largest part may kill the sink only because it is
large. So each removal is set beside removals of the same size at the same head, in the same
pass (no extra pass): the **runner-up** writer's part (for ``dominant writer``) and
``CONTROL_DRAWS`` seeded **random directions** in the key of the same norm as the removed part
(for ``b_Q``: random query directions of ``b_Q``'s norm, rotated as ``b_Q`` is). A control is
computed at the head it controls, replacing that head's removal in the pass (the heads upstream
cut as in the pass), from the pass's own queries, keys and scores: with ``m_i`` the sink logit's
margin over the content keys (``s_sink - logsumexp(s_content)``), a key-side removal of ``d_i``
leaves the sink ``sigmoid(m_i - d_i)``. A removal is **specific** at a head when it kills the
sink there while no control does (its mass after stays above the threshold, for the worst random
draw too) and each control leaves more attention than the removal (paired 95% interval over
sequences above zero).

The passes, ``1 + 4`` per batch (``1 + 3`` without a query bias), are estimated from the split's
own timed pass and logged before the check starts (refused over ``max_seconds``), counted on a
tqdm bar (``progress=False`` hides it), and re-estimated after the first pass.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.attention.circuit_split import CircuitCapture, content_lse, rotate, split_layer
from massive_lens.core.attention_pass import PassLayer, attention_reading, choose_path
from massive_lens.core.corpora import sequences
from massive_lens.core.criterion import Criterion
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.pass_reader import AttentionEdit
from massive_lens.core.stats import normal_interval
from massive_lens.errors import MassiveLensError

log = logging.getLogger(__name__)
REMOVALS = ("massive dims", "dominant writer", "b_Q", "shared direction")
CONTROL_DRAWS = 5  # random directions of the same norm per removal and head
CAUSAL_COLUMNS = ["layer", "head", "removal", "mass_before", "mass_before_low", "mass_before_high", "mass_after",
                  "mass_after_low", "mass_after_high", "loss_ratio", "loss_ratio_low", "loss_ratio_high", "kills",
                  "margin", "removed_logit", "runner_up_after", "runner_up_gap_low", "runner_up_gap_high",
                  "random_after", "random_after_min", "random_logit", "random_gap_low", "random_gap_high",
                  "controls_kill", "specific", "applies", "n_seqs", "est_seconds"]


def _mass(pattern: Tensor, valid: Tensor, head: int) -> Tensor:
    """[B]: each sequence's mean attention on the sink over the queries after it."""
    w = valid.to(pattern.device).float()
    return (pattern[:, head] * w).sum(-1) / w.sum(-1).clamp(min=1)


def _mean_over(x: Tensor, valid: Tensor) -> Tensor:
    """[..., B]: the mean over the queries after the sink of ``x`` [..., B, P]."""
    w = valid.to(x.device)
    return torch.where(w, x, 0.0).sum(-1) / w.float().sum(-1).clamp(min=1)  # (the sink's own row may be inf)


def _directions(seed: int, layer: int, head: int, dh: int) -> Tensor:
    """[CONTROL_DRAWS dh]: seeded random unit directions for one head."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 7_919 + head)
    d = torch.randn(CONTROL_DRAWS, dh, generator=gen, dtype=torch.float64).float()
    return d / d.norm(dim=-1, keepdim=True)


def _key_parts(view: ModelView, cap: CircuitCapture, heads: pd.DataFrame, seed: int = 0
               ) -> tuple[dict[Any, Any], dict[int, Any]]:
    """Per (layer, head, removal): the key part [B dh] to take off (``b_Q``: whether the head has one);
    per (layer, head, removal, "controls"): the control parts (``runner-up`` [B dh], ``random``
    [draw B dh]; for ``b_Q``: random query directions [draw dh] of ``b_Q``'s norm)."""
    splits = {layer: split_layer(view, cap, layer) for layer in sorted(set(heads["layer"]))}
    parts: dict[Any, Any] = {}
    for r in heads.itertuples():
        s, keep = splits[r.layer], cap.keep[r.layer]
        keys = s.keys[:, :, r.kv_head]  # [B part dh]
        massive = [i for i, d in enumerate(s.dims) if d == "massive"]
        runner = getattr(r, "runner_up", "")
        q = s.q[:, :, r.head][s.valid]  # [n dh]
        d = q.mean(0)
        d = d / d.norm().clamp(min=1e-12)
        k = keep.k[:, r.kv_head]
        rand = _directions(seed, int(r.layer), int(r.head), k.shape[-1]).to(k.device)
        parts[r.layer, r.head, "massive dims"] = keys[:, massive].sum(1)
        dominant = [i for i, n in enumerate(s.names) if n == r.dominant]
        parts[r.layer, r.head, "dominant writer"] = keys[:, dominant].sum(1)
        parts[r.layer, r.head, "shared direction"] = (k @ d)[:, None] * d
        parts[r.layer, r.head, "b_Q"] = s.has_bq
        for removal in ("massive dims", "dominant writer", "shared direction"):
            part = parts[r.layer, r.head, removal]
            controls = {"random": rand[:, None] * part.norm(dim=-1)[None, :, None]}  # [draw B dh]
            if removal == "dominant writer" and runner:
                controls["runner-up"] = keys[:, [i for i, n in enumerate(s.names) if n == runner]].sum(1)
            parts[r.layer, r.head, removal, "controls"] = controls
        if s.has_bq:  # rotation keeps the norm: b_Q's at any position
            parts[r.layer, r.head, "b_Q", "controls"] = {"random": rand * float(s.q_bias[0, 0, r.head].norm())}
    return parts, splits


class ControlRecord:
    """What one edited pass measured at each head: the removal's own mass there (``after``), and
    each control's, put in the removal's place at that head only (per sequence)."""

    def __init__(self) -> None:
        self.after: dict[tuple[int, int], Tensor] = {}  # [B]
        self.controls: dict[tuple[int, int], dict[str, Tensor]] = {}  # name -> [B] or [draw B]
        self.logits: dict[tuple[int, int], dict[str, Tensor]] = {}  # removed / random logit on the sink [B]
        self.applies: dict[tuple[int, int], bool] = {}  # the removal removed something at the head


def _sink_mass(scores: Tensor, keys: Tensor, valid: Tensor) -> Tensor:
    """[B] or [draw B]: the mean attention on the sink (key 0) from ``scores`` [B Q K] or [draw B Q K]."""
    x = scores if scores.dim() == 4 else scores[None]
    lse = content_lse(x.transpose(0, 1), keys).transpose(0, 1)  # [draw B Q]
    mass = _mean_over(torch.sigmoid(x[..., 0] - lse), valid)
    return mass if scores.dim() == 4 else mass[0]


def _cut(head: tuple[Tensor, Tensor, Tensor, Tensor, float], part: Tensor) -> tuple[Tensor, Tensor]:
    """One head's attention on the sink with ``part`` [..., B dh] taken off the sink's key, from
    ``head`` = (queries [B Q dh], sink logits [B Q], content log-sum-exp [B Q], valid [B Q], scale):
    (mass [..., B], the logit taken off [..., B]), means over the queries after the sink."""
    q, s0, lse, valid, scale = head
    change = scale * torch.einsum("bqe,...be->...bq", q, part.to(q.device, torch.float32))
    change = change.masked_fill(~valid.to(q.device), 0.0)
    return _mean_over(torch.sigmoid(s0 - change - lse), valid), _mean_over(change, valid)


def _key_edit(layer: int, chosen: list[int], removal: str, parts: dict[Any, Any], scale: float, keys: Tensor,
              valid: Tensor, record: ControlRecord) -> AttentionEdit:
    """The key-side removal at ``layer``'s ``chosen`` heads: the part's logit taken off each query's
    score on the sink, with each control measured in its place."""
    def edit(scores: Tensor, q_all: Tensor, k_all: Tensor) -> Tensor:
        lse = content_lse(scores, keys)  # [B H Q]: the content keys, unedited by a key-side removal
        scores = scores.clone()
        for h in chosen:
            q = q_all[:, :, h].float()  # [B Q dh]
            head = (q, scores[:, h, :, 0].float(), lse[:, h], valid, scale)
            part = parts[layer, h, removal]
            record.applies[layer, h] = bool(part.abs().sum() > 0)  # massive dims at a layer without any: nothing
            record.after[layer, h], removed = _cut(head, part)
            ctrl = {name: _cut(head, p) for name, p in parts[layer, h, removal, "controls"].items()}
            record.controls[layer, h] = {name: m for name, (m, _) in ctrl.items()}
            record.logits[layer, h] = {"removed": removed, "random": ctrl["random"][1]}
            change = scale * torch.einsum("bqe,be->bq", q, part.to(q.device, torch.float32))
            scores[:, h, 1:, 0] -= change[:, 1:].to(scores.dtype)
        return scores

    return AttentionEdit(scores=edit)


def _bq_edit(view: ModelView, layer: int, chosen: list[int], parts: dict[Any, Any], split: Any, keep: Any,
             keys: Tensor, valid: Tensor, record: ControlRecord) -> AttentionEdit | None:
    """``b_Q`` zeroed in ``layer``'s ``chosen`` heads that have one, with the random query directions of
    its norm measured in its place."""
    attn = view.block(layer).attn
    with_bq = [h for h in chosen if parts[layer, h, "b_Q"]]
    if not with_bq:
        return None

    def zero_bq(q: Tensor) -> Tensor:
        b = attn.b_Q.detach().reshape(q.shape[2], -1).to(q.dtype)
        q = q.clone()
        q[:, :, with_bq] -= b[with_bq]
        return q

    def controls(scores: Tensor, q_all: Tensor, k_all: Tensor) -> None:
        k_all = k_all.detach().float()
        group = scores.shape[1] // k_all.shape[2]
        n = len(scores)
        cos = None if keep.cos is None else keep.cos.expand(n, -1, -1)[None].to(scores.device)  # [1 B Q r]
        sin = None if keep.sin is None else keep.sin.expand(n, -1, -1)[None].to(scores.device)
        for h in with_bq:
            k = k_all[:, :, h // group]  # [B K dh]
            edited = scores[:, h].float()  # b_Q removed at h
            bq = split.q_bias[:, :, h].to(k.device)  # [B Q dh], rotated to each query
            rand = parts[layer, h, "b_Q", "controls"]["random"].to(k.device)  # [draw dh]
            r = rand[:, None, None].expand(-1, n, scores.shape[2], -1)  # [draw B Q dh]
            r = rotate(r, cos, sin)
            swap = split.scale * torch.einsum("dbqe,bke->dbqk", bq[None] - r, k)  # put b_Q back, take r off
            record.after[layer, h], record.applies[layer, h] = _sink_mass(edited, keys, valid), True
            record.controls[layer, h] = {"random": _sink_mass(edited[None] + swap, keys, valid)}
            record.logits[layer, h] = {"removed": _mean_over(split.scale * torch.einsum("bqe,be->bq", bq, k[:, 0]),
                                                             valid),
                                       "random": _mean_over(split.scale * torch.einsum("dbqe,be->dbq", r, k[:, 0]),
                                                            valid)}

    return AttentionEdit(queries=zero_bq, scores=controls)


def _edits(view: ModelView, heads: pd.DataFrame, removal: str, parts: dict[Any, Any], splits: dict[int, Any],
           cap: CircuitCapture, valid: Tensor, record: ControlRecord) -> dict[int, AttentionEdit]:
    """Per layer, the removal's edit of its sink heads (none for ``"none"``)."""
    edits: dict[int, AttentionEdit] = {}
    keys = cap.batch.mask
    for layer, group in heads.groupby("layer"):
        layer, chosen = int(layer), [int(h) for h in group["head"]]
        edit = None
        if removal == "b_Q":
            edit = _bq_edit(view, layer, chosen, parts, splits[layer], cap.keep[layer], keys, valid, record)
        elif removal != "none":
            edit = _key_edit(layer, chosen, removal, parts, splits[layer].scale, keys, valid, record)
        if edit is not None:
            edits[layer] = edit
    return edits


def _keep_mass(at: PassLayer, *, heads: pd.DataFrame, valid: Tensor, masses: dict[tuple[int, int], Tensor]) -> None:
    """The attention on the sink of the chosen heads at one layer, as the edited pass read it."""
    pattern = at.cols.detach().float()[..., 0]
    for h in heads.loc[heads["layer"] == at.layer, "head"]:
        masses[at.layer, int(h)] = _mass(pattern, valid, int(h)).cpu()


def causal_check(view: ModelView, heads: pd.DataFrame, corpus: Any, *, n_seqs: int, seq_len: int,
                 criterion: Criterion, threshold: float, token_seconds: float = 0.0,
                 max_seconds: float | None = None, progress: bool = True, seed: int = 0) -> pd.DataFrame:
    """Each removal alone on ``n_seqs`` sequences of ``corpus``, with its controls (see the module
    docstring); one row per (head, removal) with the columns :data:`CAUSAL_COLUMNS`. Before any pass
    the cost is estimated from ``token_seconds`` (the split's own pass, per token), logged and refused
    over ``max_seconds``; a tqdm bar (``progress``) counts the passes that run."""
    tokens = sequences(view, corpus, seq_len, n_seqs)
    loss = NextTokenLoss(view)
    batches = loss.batches(tokens)
    arms = [r for r in REMOVALS if r != "b_Q" or bool((heads["b_q"] != 0).any())]  # b_Q: only with a query bias
    n_passes = len(batches) * (1 + len(arms))
    first = token_seconds * tokens.numel() * (1 + len(arms))
    log.info("sink_circuit causal check: %d sequences of %d tokens, %d passes (%d batches x (1 clean + %s)), "
             "about %.0fs", len(tokens), tokens.shape[1], n_passes, len(batches), ", ".join(arms), first)
    if max_seconds is not None and first > max_seconds:
        raise MassiveLensError(f"{view.name}: the causal check would take about {first:.0f}s ({len(tokens)} sequences "
                               f"x {1 + len(arms)} passes), over max_seconds={max_seconds:g}; lower n_seqs or "
                               "seq_len, or raise max_seconds")
    layers = sorted(int(x) for x in set(heads["layer"]))
    base_loss, edited_loss = [], {r: [] for r in arms}
    before: dict[tuple[int, int], list[Tensor]] = {}
    margin: dict[tuple[int, int], list[Tensor]] = {}
    after: dict[tuple[str, int, int], list[Tensor]] = {}
    records: dict[str, list[ControlRecord]] = {r: [] for r in arms}
    est = float("nan")
    bar = tqdm(total=n_passes, desc=f"sink_circuit causal check (about {first:.0f}s)", unit="pass",
               disable=not progress, leave=False)
    try:
        for n, x in enumerate(batches):
            batch = view.full_batch(x)
            valid = batch.mask.clone()
            valid[:, :1] = False
            cap = CircuitCapture(view, batch, layers, criterion)
            start = time.perf_counter()
            base_loss.append(cap.run(lambda hooks, x=x: loss(x, hooks=hooks).loss))
            bar.update(1)
            if n == 0:
                per_pass = time.perf_counter() - start
                est = per_pass * n_passes
                bar.set_description(f"sink_circuit causal check ({n_passes} passes of {per_pass:.1f}s)")
                log.info("sink_circuit causal check, after its first pass: %d passes of %.2fs each, about %.0fs",
                         n_passes, per_pass, est)
            for r in heads.itertuples():
                keep = cap.keep[r.layer]
                before.setdefault((r.layer, r.head), []).append(_mass(keep.pattern, valid, r.head).cpu())
                m = _mean_over(keep.scores[:, r.head] - keep.content_lse[:, r.head], valid)
                margin.setdefault((r.layer, r.head), []).append(m.cpu())
            parts, splits = _key_parts(view, cap, heads, seed)
            for removal in arms:
                masses: dict[tuple[int, int], Tensor] = {}
                record = ControlRecord()
                # the removals are edits of the attention: read on the eager path (the kernel would skip them)
                reader = attention_reading(view, partial(_keep_mass, heads=heads, valid=valid, masses=masses),
                                           path=choose_path(view, "eager", batch), columns=[0], layers=layers,
                                           edits=_edits(view, heads, removal, parts, splits, cap, valid, record))
                with reader:
                    edited_loss[removal].append(loss(x, hooks=reader.hooks).loss)
                bar.update(1)
                records[removal].append(record)
                for (layer, head), m in masses.items():
                    after.setdefault((removal, layer, head), []).append(m)
    finally:
        bar.close()
    base = torch.cat(base_loss)
    rows = []
    for removal in arms:
        ratio = torch.cat(edited_loss[removal]) / base
        lr, hr = normal_interval(ratio)
        for r in heads.itertuples():
            b = torch.cat(before[r.layer, r.head])
            a = torch.cat(after[removal, r.layer, r.head])
            (bl, bh), (al, ah) = normal_interval(b), normal_interval(a)
            row = dict(layer=r.layer, head=r.head, removal=removal, mass_before=float(b.mean()),
                       mass_before_low=bl, mass_before_high=bh, mass_after=float(a.mean()), mass_after_low=al,
                       mass_after_high=ah, loss_ratio=float(ratio.mean()), loss_ratio_low=lr, loss_ratio_high=hr,
                       kills=bool(b.mean() > threshold >= a.mean()), margin=float(torch.cat(margin[r.layer, r.head])
                                                                                   .mean()),
                       n_seqs=len(base), est_seconds=est)
            row.update(_control_row(records[removal], (r.layer, r.head), a, float(b.mean()), threshold, row["kills"],
                                    1e-4 if view.dtype == torch.float32 else 2e-2))
            rows.append(row)
    return pd.DataFrame(rows, columns=CAUSAL_COLUMNS)


def _control_row(records: list[ControlRecord], key: tuple[int, int], actual: Tensor, before: float,
                 threshold: float, kills: bool, tol: float) -> dict[str, Any]:
    """The control columns of one (head, removal) row (NaN where a control does not apply)."""
    nan = float("nan")
    out: dict[str, Any] = dict(removed_logit=nan, runner_up_after=nan, runner_up_gap_low=nan, runner_up_gap_high=nan,
                               random_after=nan, random_after_min=nan, random_logit=nan, random_gap_low=nan,
                               random_gap_high=nan, controls_kill=False, specific=False, applies=False)
    kept = [rec for rec in records if key in rec.controls]
    if len(kept) != len(records) or not kept:
        return out
    out["applies"] = any(rec.applies[key] for rec in kept)
    at = torch.cat([rec.after[key].cpu() for rec in kept])  # the removal's mass at the head, as the pass gave it
    out["removed_logit"] = float(torch.cat([rec.logits[key]["removed"].cpu() for rec in kept]).mean())
    lows, controls_kill = [], False
    rand = torch.cat([rec.controls[key]["random"].cpu() for rec in kept], -1)  # [draw n]
    out["random_after"], out["random_after_min"] = float(rand.mean()), float(rand.mean(-1).min())
    out["random_logit"] = float(torch.cat([rec.logits[key]["random"].cpu() for rec in kept], -1).mean())
    out["random_gap_low"], out["random_gap_high"] = normal_interval(rand.mean(0) - at)
    lows.append(out["random_gap_low"])
    controls_kill |= before > threshold >= out["random_after_min"]
    if all("runner-up" in rec.controls[key] for rec in kept):
        ru = torch.cat([rec.controls[key]["runner-up"].cpu() for rec in kept])
        out["runner_up_after"] = float(ru.mean())
        out["runner_up_gap_low"], out["runner_up_gap_high"] = normal_interval(ru - at)
        lows.append(out["runner_up_gap_low"])
        controls_kill |= before > threshold >= out["runner_up_after"]
    if not torch.allclose(at, actual.to(at.dtype), atol=tol):  # the head-level recomputation must be the pass's
        raise MassiveLensError(f"sink_circuit: the attention recomputed at head {key} from the margin "
                               f"({float(at.mean()):.4f}) is not the pass's ({float(actual.mean()):.4f}); the "
                               "controls would not be comparable")
    out["controls_kill"] = bool(controls_kill)
    out["specific"] = bool(kills and out["applies"] and not controls_kill and min(lows) > 0)
    return out


def removal_line(causal: pd.DataFrame, removal: str, threshold: float) -> str:
    """One sentence on one removal over the heads: how many it kills, the attention before and after
    (on the causal check's corpus, medians over those heads), and its loss ratio (every sink head cut
    at once); with controls, in how many heads it is specific."""
    rows = causal[causal["removal"] == removal]
    idle = ""
    if "applies" in rows and not rows["applies"].astype(bool).all():  # e.g. no massive dims at the layer
        n_idle = int((~rows["applies"].astype(bool)).sum())
        rows = rows[rows["applies"].astype(bool)]
        idle = f"; it removes nothing in {n_idle} heads (left out: " + (
            "no massive dims at their layer)" if removal == "massive dims" else "nothing to remove there)")
        if rows.empty:
            return f"removing {removal} removes nothing in any of the {n_idle} heads{idle[idle.index(' ('):]}"
    killed = rows[rows["kills"].astype(bool)]
    r0 = rows.iloc[0]
    loss = (f"loss x{r0.loss_ratio:.3g} [{r0.loss_ratio_low:.3g}, {r0.loss_ratio_high:.3g}] with every sink head "
            "cut at once")
    specific = ""
    if "specific" in rows and rows["random_after"].notna().any():
        specific = f"; specific against controls of the same size in {int(rows['specific'].sum())}"
    if len(killed):
        return (f"removing {removal} drops the corpus attention on the first token (median over the heads it kills) "
                f"from {killed['mass_before'].median():.2f} to {killed['mass_after'].median():.2f} in {len(killed)} "
                f"of {len(rows)} heads{specific}{idle} ({loss})")
    return (f"removing {removal} kills the sink in none of the {len(rows)} heads (corpus attention, median "
            f"{rows['mass_before'].median():.2f} -> {rows['mass_after'].median():.2f}, threshold {threshold:g}; "
            f"{loss}){idle}")
