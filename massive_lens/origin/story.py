"""The few-line story that :meth:`OriginTrace.summary` tells for each traced entry.

The attribution lines lead (which runs of writes make the peak, and what changes it after);
the events follow, each told with the verb of its ``kind`` (:data:`~massive_lens.origin.ledger.VERBS`):
the kinds, and so what a birth is (the first write that brings the value to ``BIRTH_SHARE``,
10%, of its peak), are decided once in :mod:`massive_lens.origin.ledger`, so the events table
and the story agree. The first query of a text can attend only to itself, so no story says
where it looks.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from massive_lens.core.fmt import num as fmt
from massive_lens.core.fmt import pct as _pct
from massive_lens.origin.attribution import label as _label
from massive_lens.origin.ledger import BIRTH_SHARE, VERBS  # noqa: F401  (BIRTH_SHARE: importable from the story too)

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
    rest = 1.0 - float(rows.share.sum())  # what the MLP's other neurons add, together
    others = f"; all other neurons {_pct(rest)}" if abs(rest) >= 0.05 else ""
    units = zip(shown.expert, shown.neuron, strict=True)
    names = ", ".join(str(n) if e < 0 else f"{n} of expert {e}" for e, n in units)
    return f" ({label} {names}{more}: {_pct(shown.share.sum())}{others})"


def _heads(heads: pd.DataFrame, layer: int, total: float, first_query: bool = False) -> str:
    """`` (heads 3, 7: 91%; 3 attends 95% to the first token)``: the heads that write most of an
    attention term (same sign, largest first, until 80% of it), and where the first one looks
    (not for the first query, which can attend only to itself)."""
    rows = heads[(heads.layer == layer) & (heads["head"] >= 0)]
    if rows.empty or not total:
        return ""
    rows = rows[rows.contribution * total > 0].sort_values("contribution", key=abs, ascending=False)
    shown = rows[(rows.contribution.cumsum() / total).shift(fill_value=0) < 0.8].head(3)
    if shown.empty:
        return ""
    label = "head" if len(shown) == 1 else "heads"
    top = shown.iloc[0]
    looks = ""
    if not first_query and not math.isnan(top.first_token_attention):
        looks = (f"; {int(top['head'])} attends {_pct(top.first_token_attention)} to the first token"
                 if top.first_token_attention >= 0.5 else
                 f"; {int(top['head'])} puts at most {_pct(top.max_attention)} on one token")
    names = ", ".join(str(int(h)) for h in shown["head"])
    return f" ({label} {names}: {_pct(shown.contribution.sum() / total)}{looks})"


def _event(e: Any, neurons: pd.DataFrame, verb: str, heads: pd.DataFrame, peak: float) -> str:
    where = _label(e.component, e.layer, e.layer)  # "MLP 3", "attn 3", "embed"
    who = (_who(neurons, e) if e.component == "mlp" else
           _heads(heads, e.layer, e.contribution, e.pos == 0) if e.component == "attn" else "")  # no heads in embed
    if e.before and e.after and (e.before > 0) != (e.after > 0) \
            and min(abs(e.before), abs(e.after)) >= 0.05 * max(abs(e.before), abs(e.after)):
        return f"flipped from {fmt(e.before)} to {fmt(e.after)} by {where}{who}"
    if e.kind == "erasure":
        ratio = e.after / e.before if e.before else math.nan
        return f"cut to {_pct(ratio)} by {where}{who}"
    share = f" ({_pct(e.after / peak)} of the peak)" if verb == "born in" and peak else ""
    return f"{verb} {where}{who} to {fmt(e.after)}{share}"


def _verbs(events: pd.DataFrame) -> list[str]:
    """Each event's verb, read from its ``kind`` (decided in :func:`~massive_lens.origin.ledger.event_kinds`)."""
    return [VERBS[k] for k in events.kind]


def birth_key(trace: Any, t: Any) -> tuple:
    """What an entry's story starts with: its position, and the components (and named neurons)
    of its births. Entries with the same key were born together."""
    births = _of(trace.births, t)
    neurons = _of(trace.neurons, t)
    key = []
    for e in births.itertuples():
        named = neurons[(neurons.layer == e.layer) & neurons.named & (neurons.kind == e.kind)]
        key.append((e.component, int(e.layer), tuple(named.neuron.head(3))))
    return (int(t.pos), tuple(key))


def together(trace: Any, group: list[Any]) -> str:
    """One line for entries born together: ``dims 408, 520, 940 and 10 more at '<s>' (pos 0): born
    together in MLPs 1-2 by neurons 4492, 8300; peaks 2,510 to 310``."""
    t = group[0]
    dims = ", ".join(str(int(g.dim)) for g in group[:3]) + (f" and {len(group) - 3} more" if len(group) > 3 else "")
    where = birth_key(trace, t)[1]
    layers = sorted({layer for _, layer, _ in where})
    kinds = sorted({c for c, _, _ in where})
    place = " and ".join("MLP" if k == "mlp" else k for k in kinds)
    span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
    neurons = list(dict.fromkeys(n for _, _, ns in where for n in ns))
    by = f" by neurons {', '.join(map(str, neurons[:6]))}" if neurons else ""
    peaks = sorted((float(g.peak) for g in group), key=abs)
    return (f"dims {dims} at {t.token!r} (pos {t.pos}): born together in {place} {span}{by}; peaks "
            f"{fmt(peaks[-1])} to {fmt(peaks[0])} (see .targets, .attribution)")


def story(trace: Any, t: Any) -> str:
    events = _of(trace.events, t)
    neurons = _of(trace.neurons, t)
    verbs = _verbs(events)
    parts = [_event(e, neurons[neurons.kind == e.kind], verb, _of(trace.heads, t), t.peak)
             for e, verb in zip(events.head(_MAX_EVENTS).itertuples(), verbs, strict=False)]
    if len(events) > _MAX_EVENTS:
        parts.append(f"... {len(events) - _MAX_EVENTS} more events (see .events)")
    last = int(trace.ledger.layer.max())
    flag = "" if t.massive else " [below the criterion]"
    scope = " [an outlier dimension's entry]" if getattr(t, "scope", "token") == "outlier_dim" else ""
    lines = [f"dim {t.dim} at {t.token!r} ({t.token_kind}, pos {t.pos}){flag}{scope}: peak {fmt(t.peak)} at "
             f"layer {t.peak_layer}, {fmt(t.final)} at layer {last}"]
    lines += _attribution(_of(trace.attribution, t), t, last)
    lines.append("  events: " + ("; ".join(parts) or "no single component writes a large share"))
    lines += _verification(_of(trace.verification, t))
    lines += _why(_of(trace.why, t), _of(trace.births, t))
    supers = _of(trace.super_weights, t)
    if not supers.empty:
        s = supers.loc[supers.zscore.abs().idxmax()]
        lines.append(f"  largest candidate weight: {s.hf_param}[{s.hf_row}, {s.hf_col}] = {s.value:.3g} "
                     f"(z = {s.zscore:,.1f}, rank {s['rank']:,} of {s.n_entries:,}; "
                     f"layer {s.layer}, neuron {s.neuron}; what removing it costs: verify_super_weights)")
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
        lines.append(f"  zeroing {what} ({r.neurons}) leaves {_left(r.value, r.ablated, r.value)} at layer "
                     f"{r.layer} and {_left(r.value_last, r.ablated_last, r.value)} at layer {r.last_layer}{ppl}")
    return lines


def _left(value: float, ablated: float, scale: float) -> str:
    """What an ablation leaves of ``value``: a share when that reads true, else both values (a
    value that is small next to ``scale`` or changes sign makes a share such as 754% meaningless)."""
    if value and (value > 0) == (ablated > 0) and abs(value) >= 0.1 * abs(scale):
        return _pct(ablated / value)
    return f"{fmt(ablated)} (was {fmt(value)})"


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
