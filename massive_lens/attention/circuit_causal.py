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
ratio, with paired 95% intervals over sequences (normal approximation). The cost is ``1 + 4`` forward passes per
batch of sequences, estimated from the split's own timed pass and logged before the check starts
(refused over ``max_seconds``), then re-estimated after its first pass.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.circuit_split import CircuitCapture, split_layer
from massive_lens.core.corpora import sequences
from massive_lens.core.criterion import Criterion
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

log = logging.getLogger(__name__)
REMOVALS = ("massive dims", "dominant writer", "b_Q", "shared direction")
CAUSAL_COLUMNS = ["layer", "head", "removal", "mass_before", "mass_before_low", "mass_before_high", "mass_after",
                  "mass_after_low", "mass_after_high", "loss_ratio", "loss_ratio_low", "loss_ratio_high", "kills",
                  "n_seqs", "est_seconds"]


def interval(values: Tensor) -> tuple[float, float]:
    """95% interval of a mean over sequences, normal approximation (``mean +- 1.96 sd / sqrt(n)``);
    paired where ``values`` are per-sequence ratios or differences. One sequence: no width."""
    v = values.double()
    half = 1.96 * float(v.std()) / len(v) ** 0.5 if len(v) > 1 else 0.0
    return float(v.mean()) - half, float(v.mean()) + half


def _mass(pattern: Tensor, valid: Tensor, head: int) -> Tensor:
    """[B]: each sequence's mean attention on the sink over the queries after it."""
    w = valid.to(pattern.device).float()
    return (pattern[:, head] * w).sum(-1) / w.sum(-1).clamp(min=1)


def _key_parts(view: ModelView, cap: CircuitCapture, heads: pd.DataFrame) -> tuple[dict[Any, Any], dict[int, Any]]:
    """Per (layer, head, removal): the key part [B dh] to take off (None: not applicable)."""
    splits = {layer: split_layer(view, cap, layer) for layer in sorted(set(heads["layer"]))}
    parts: dict[Any, Any] = {}
    for r in heads.itertuples():
        s, keep = splits[r.layer], cap.keep[r.layer]
        keys = s.keys[:, :, r.kv_head]  # [B part dh]
        massive = [i for i, d in enumerate(s.dims) if d == "massive"]
        dominant = [i for i, n in enumerate(s.names) if n == r.dominant]
        q = s.q[:, :, r.head][s.valid]  # [n dh]
        d = q.mean(0)
        d = d / d.norm().clamp(min=1e-12)
        k = keep.k[:, r.kv_head]
        parts[r.layer, r.head, "massive dims"] = keys[:, massive].sum(1)
        parts[r.layer, r.head, "dominant writer"] = keys[:, dominant].sum(1)
        parts[r.layer, r.head, "shared direction"] = (k @ d)[:, None] * d
        parts[r.layer, r.head, "b_Q"] = s.has_bq
    return parts, splits


def _hooks(view: ModelView, heads: pd.DataFrame, removal: str, parts: dict[Any, Any], splits: dict[int, Any],
           masses: dict[tuple[int, int], Tensor], valid: Tensor) -> list[tuple[str, Any]]:
    hooks: list[tuple[str, Any]] = []
    for layer, group in heads.groupby("layer"):
        layer, chosen = int(layer), [int(h) for h in group["head"]]
        rot = view.has_hook(layer, "attn.hook_rot_q")
        seen: dict[str, Tensor] = {}
        attn = view.block(layer).attn

        def keep_q(q: Tensor, hook: Any, seen: dict[str, Tensor] = seen) -> None:
            seen["q"] = q.detach()

        def zero_bq(q: Tensor, hook: Any, chosen: list[int] = chosen, attn: Any = attn) -> Tensor:
            b = attn.b_Q.detach().reshape(q.shape[2], -1).to(q.dtype)
            q = q.clone()
            q[:, :, chosen] -= b[chosen]
            return q

        def edit(scores: Tensor, hook: Any, layer: int = layer, chosen: list[int] = chosen,
                 seen: dict[str, Tensor] = seen) -> Tensor:
            scores = scores.clone()
            scale = splits[layer].scale
            for h in chosen:
                part = parts[layer, h, removal].to(scores.device, torch.float32)  # [B dh]
                change = scale * torch.einsum("bqe,be->bq", seen["q"][:, :, h].float(), part)
                scores[:, h, 1:, 0] -= change[:, 1:].to(scores.dtype)
            return scores

        def mass(pattern: Tensor, hook: Any, layer: int = layer, chosen: list[int] = chosen) -> None:
            for h in chosen:
                masses[layer, h] = _mass(pattern.detach().float()[..., 0], valid, h).cpu()

        if removal == "b_Q":
            if any(parts[layer, h, "b_Q"] for h in chosen):
                hooks.append((view.hook_name(layer, "attn.hook_q"), zero_bq))
        elif removal != "none":
            hooks += [(view.hook_name(layer, "attn.hook_rot_q" if rot else "attn.hook_q"), keep_q),
                      (view.hook_name(layer, "attn.hook_attn_scores"), edit)]
        hooks.append((view.hook_name(layer, "attn.hook_pattern"), mass))
    return hooks


def causal_check(view: ModelView, heads: pd.DataFrame, corpus: Any, *, n_seqs: int, seq_len: int,
                 criterion: Criterion, threshold: float, token_seconds: float = 0.0,
                 max_seconds: float | None = None) -> pd.DataFrame:
    """Each removal alone on ``n_seqs`` sequences of ``corpus`` (see the module docstring); one row
    per (head, removal) with the columns :data:`CAUSAL_COLUMNS`. Before any pass the cost is
    estimated from ``token_seconds`` (the split's own pass, per token) and refused over ``max_seconds``."""
    tokens = sequences(view, corpus, seq_len, n_seqs)
    first = token_seconds * tokens.numel() * (1 + len(REMOVALS))
    log.info("sink_circuit causal check: %d sequences of %d tokens, %d passes over them, about %.0fs", len(tokens),
             tokens.shape[1], 1 + len(REMOVALS), first)
    if max_seconds is not None and first > max_seconds:
        raise MassiveLensError(f"{view.name}: the causal check would take about {first:.0f}s ({len(tokens)} sequences "
                               f"x {1 + len(REMOVALS)} passes), over max_seconds={max_seconds:g}; lower n_seqs or "
                               "seq_len, or raise max_seconds")
    loss = NextTokenLoss(view)
    layers = sorted(int(x) for x in set(heads["layer"]))
    has_bq = None
    base_loss, edited_loss = [], {r: [] for r in REMOVALS}
    before: dict[tuple[int, int], list[Tensor]] = {}
    after: dict[tuple[str, int, int], list[Tensor]] = {}
    est = float("nan")
    for n, x in enumerate(loss.batches(tokens)):
        batch = view.full_batch(x)
        valid = batch.mask.clone()
        valid[:, :1] = False
        cap = CircuitCapture(view, batch, layers, criterion)
        start = time.perf_counter()
        base_loss.append(loss(x, hooks=cap.hooks()).loss)
        if n == 0:
            per_pass = time.perf_counter() - start
            est = per_pass * (1 + len(REMOVALS)) * -(-len(tokens) // len(x))
            log.info("sink_circuit causal check, after its first pass: %d passes of %.2fs each, about %.0fs",
                     (1 + len(REMOVALS)) * -(-len(tokens) // len(x)), per_pass, est)
        for r in heads.itertuples():
            before.setdefault((r.layer, r.head), []).append(_mass(cap.keep[r.layer].pattern, valid, r.head).cpu())
        parts, splits = _key_parts(view, cap, heads)
        has_bq = any(parts[r.layer, r.head, "b_Q"] for r in heads.itertuples())
        for removal in REMOVALS:
            if removal == "b_Q" and not has_bq:
                continue
            masses: dict[tuple[int, int], Tensor] = {}
            edited_loss[removal].append(loss(x, hooks=_hooks(view, heads, removal, parts, splits, masses, valid)).loss)
            for (layer, head), m in masses.items():
                after.setdefault((removal, layer, head), []).append(m)
    base = torch.cat(base_loss)
    rows = []
    for removal in REMOVALS:
        if not edited_loss[removal]:
            continue
        ratio = torch.cat(edited_loss[removal]) / base
        lr, hr = interval(ratio)
        for r in heads.itertuples():
            b = torch.cat(before[r.layer, r.head])
            a = torch.cat(after[removal, r.layer, r.head])
            (bl, bh), (al, ah) = interval(b), interval(a)
            rows.append(dict(layer=r.layer, head=r.head, removal=removal, mass_before=float(b.mean()),
                             mass_before_low=bl, mass_before_high=bh, mass_after=float(a.mean()), mass_after_low=al,
                             mass_after_high=ah, loss_ratio=float(ratio.mean()), loss_ratio_low=lr,
                             loss_ratio_high=hr, kills=bool(b.mean() > threshold >= a.mean()), n_seqs=len(base),
                             est_seconds=est))
    return pd.DataFrame(rows, columns=CAUSAL_COLUMNS)


def removal_line(causal: pd.DataFrame, removal: str, threshold: float) -> str:
    """One sentence on one removal over the heads: how many it kills, and the attention before and after."""
    rows = causal[causal["removal"] == removal]
    killed = rows[rows["kills"]]
    r0 = rows.iloc[0]
    loss = f"loss x{r0.loss_ratio:.3g} [{r0.loss_ratio_low:.3g}, {r0.loss_ratio_high:.3g}]"
    if len(killed):
        return (f"removing {removal} drops its attention from {killed['mass_before'].median():.2f} to "
                f"{killed['mass_after'].median():.2f} in {len(killed)} of {len(rows)} heads ({loss})")
    return (f"removing {removal} kills the sink in none of the {len(rows)} heads (attention "
            f"{rows['mass_before'].median():.2f} -> {rows['mass_after'].median():.2f}, threshold {threshold:g}; "
            f"{loss})")
