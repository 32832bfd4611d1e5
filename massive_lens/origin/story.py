"""The few-line story that :meth:`OriginTrace.summary` tells for each traced entry."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from massive_lens.core.fmt import num as fmt
from massive_lens.core.fmt import pct as _pct

_MAX_EVENTS = 6


def _of(frame: pd.DataFrame, t: Any) -> pd.DataFrame:
    return frame[(frame.pos == t.pos) & (frame.dim == t.dim)]


def _who(neurons: pd.DataFrame, e: Any) -> str:
    rows = neurons[(neurons.layer == e.layer) & neurons.named]
    if rows.empty:
        return ""
    shown = rows.head(3)
    more = f" +{len(rows) - 3} more" if len(rows) > 3 else ""
    label = "neuron" if len(shown) == 1 else "neurons"
    return f" ({label} {', '.join(map(str, shown.neuron))}{more}: {_pct(shown.share.sum())})"


def _event(e: Any, neurons: pd.DataFrame, seen_birth: bool) -> str:
    where = ("MLP " if e.component == "mlp" else f"{e.component} ") + str(e.layer)
    who = _who(neurons, e) if e.component == "mlp" else ""
    if e.kind == "erasure":
        ratio = e.after / e.before if e.before else math.nan
        return f"cut to {_pct(ratio)} by {where}{who}"
    verb = {"rebirth": "rewritten by", "birth": "raised by" if seen_birth else "born in"}[e.kind]
    return f"{verb} {where}{who} to {fmt(e.after)}"


def story(trace: Any, t: Any) -> str:
    events = _of(trace.events, t)
    neurons = _of(trace.neurons, t)
    parts, seen = [], False
    for e in events.head(_MAX_EVENTS).itertuples():
        parts.append(_event(e, neurons[neurons.kind == e.kind], seen))
        seen |= e.kind != "erasure"
    if len(events) > _MAX_EVENTS:
        parts.append(f"... {len(events) - _MAX_EVENTS} more events (see .events)")
    last = int(trace.ledger.layer.max())
    flag = "" if t.massive else " [below the criterion]"
    lines = [f"dim {t.dim} at {t.token!r} ({t.token_kind}, pos {t.pos}){flag}: "
             + ("; ".join(parts) or "no single component writes a large share")
             + f"; peak {fmt(t.peak)} at layer {t.peak_layer}, {fmt(t.final)} at layer {last}"]
    lines += _attribution(_of(trace.attribution, t), t, last)
    lines += _verification(_of(trace.verification, t))
    lines += _why(_of(trace.why, t), _of(trace.births, t))
    supers = _of(trace.super_weights, t)
    if not supers.empty:
        s = supers.loc[supers.zscore.abs().idxmax()]
        lines.append(f"  largest weight: {s.hf_param}[{s.hf_row}, {s.hf_col}] = {s.value:.3g} "
                     f"(z = {s.zscore:,.1f}, rank {s['rank']:,} of {s.n_entries:,}; "
                     f"layer {s.layer}, neuron {s.neuron})")
    return "\n".join(lines)


def _runs(rows: pd.DataFrame, peak: float) -> str:
    parts = []
    for r in rows.itertuples():
        share = _pct(r.contribution / peak) if peak else "nan"
        if r.component == "rest" and abs(r.contribution) < 1e-3 * abs(peak):
            continue  # nothing worth a word is left
        if r.component == "rest":
            parts.append(f"the rest: {r.n_writes} small write{'s' if r.n_writes != 1 else ''}, {share}")
        else:
            parts.append(f"{r.label} {r.contribution:+,.0f} ({share})" if abs(r.contribution) >= 100
                         else f"{r.label} {r.contribution:+.3g} ({share})")
    return ", ".join(parts)


def _attribution(rows: pd.DataFrame, t: Any, last: int) -> list[str]:
    """Which runs of writes make the peak, and which change it afterwards (shares of the peak)."""
    if rows.empty:
        return []
    lines = [f"  the peak {fmt(t.peak)} = " + _runs(rows[rows.target == "peak"], t.peak)]
    change = rows[rows.target == "change"]
    if not change.empty:
        verb = "cut" if abs(t.final) < abs(t.peak) else "raised"
        lines.append(f"  then {verb} to {fmt(t.final)} by layer {last}: " + _runs(change, t.peak)
                     + " (shares of the peak)")
    return lines


def _verification(rows: pd.DataFrame) -> list[str]:
    if rows.empty:
        return []
    scope = "all births" if (rows.scope == "all births").any() else rows.scope.iloc[0]
    chosen = rows[rows.scope == scope].set_index("intervention")
    lines = []
    kinds = (("zero_neurons", "the named birth neurons"), ("zero_super_weights", "only their W_out[:, dim] weights"))
    for kind, what in kinds:
        if kind not in chosen.index:
            continue
        r = chosen.loc[kind]
        ppl = "" if math.isnan(r.ppl) else f"; perplexity {r.ppl:.3g} -> {r.ppl_ablated:.3g}"
        lines.append(f"  zeroing {what} ({r.neurons}) leaves {_pct(r.remaining)} at layer {r.layer} "
                     f"and {_pct(r.remaining_last)} at layer {r.last_layer}{ppl}")
    return lines


def _why(rows: pd.DataFrame, births: pd.DataFrame) -> list[str]:
    """The first neuron of the three largest births: what drives its gate (or pre-activation)."""
    lines = []
    for layer in births.reindex(births.contribution.abs().sort_values(ascending=False).index).layer.head(3):
        mine = rows[(rows.layer == layer) & rows.input.isin(["gate", "pre"])]
        if mine.empty:
            continue
        group = mine[mine.neuron == mine.neuron.iloc[0]]
        top = group.reindex(group.contribution.abs().sort_values(ascending=False).index).head(3)
        names = ", ".join(f"{_src(r)} ({_pct(r.share)})" for r in top.itertuples())
        r = group.iloc[0]
        lines.append(f"  why: neuron {r.neuron} of MLP {layer} fires here ({r.input} = {fmt(r.value)}) "
                     f"because of {names}")
    return lines


def _src(r: Any) -> str:
    return r.source if r.source in ("embed", "pos_embed", "bias") else f"{r.source} {r.source_layer}"
