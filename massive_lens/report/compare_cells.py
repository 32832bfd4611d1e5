"""The cells of the comparison page (:func:`~massive_lens.report.compare_models`): each turns
one model's results into the short text of one table cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from massive_lens.core.fmt import num, pct, ratio, short
from massive_lens.origin import OriginTrace

MISSING = "-"  # a cell whose analysis did not run (or a setting that was not needed)
REBUILT_MARK = "(rebuilt)"  # after a ratio whose removal the model undid downstream


def _listed(items: list[Any], limit: int = 6) -> str:
    head = ", ".join(str(i) for i in items[:limit])
    return head + (f" (+{len(items) - limit} more)" if len(items) > limit else "") if items else "none"


def _counts(column: pd.Series) -> str:
    counts = column.value_counts()
    return ", ".join(f"{kind} {n}" for kind, n in counts.items()) or "none"


def _layers(layers: Sequence[int], n_layers: int) -> str:
    return f"{min(layers)}-{max(layers)} of 0-{n_layers - 1}" if layers else "none"


def _token(r: Any) -> pd.DataFrame:
    rows = r.found.by_dim()
    return rows[rows.scope == "token"]


def _largest(rows: pd.DataFrame) -> str | None:
    if rows.empty:
        return "none"
    top = rows.loc[rows.value.abs().idxmax()]
    return f"{num(top.value)} ({num(top.ratio)}x), dim {top.dim} at {short(top.token, 20)!r}, layer {top.peak_layer}"


def _entry(t: Any) -> str:
    kind = f"{t.token_kind}, " if "token_kind" in t else ""
    return f"dim {t.dim} at {short(t.token, 20)!r} ({kind}pos {t.pos})" + ("" if t.massive else ", not massive")


def _peak(t: Any) -> str:
    return f"{num(t.peak)} (layer {t.peak_layer}), {num(t.final)}"


def _of_target(frame: pd.DataFrame, t: Any) -> pd.DataFrame:
    return frame[(frame.pos == t.pos) & (frame.dim == t.dim)]


def _births(trace: OriginTrace) -> str:
    births = _of_target(trace.births, trace.targets.iloc[0])
    return "; ".join(f"{b.component} {b.layer}: {'+' if b.contribution >= 0 else ''}{num(b.contribution)}"
                     for b in births.itertuples()) or "none"


def _neurons(trace: OriginTrace) -> str:
    t = trace.targets.iloc[0]
    neurons = _of_target(trace.neurons, t)
    neurons = neurons[neurons.kind == "birth"] if "kind" in neurons else neurons
    parts = [f"MLP {layer}: " + ", ".join(f"{n.neuron} ({pct(n.share)})" for n in group.head(3).itertuples())
             for layer, group in neurons.groupby("layer", sort=True)]
    return "; ".join(parts) or "none"


def _super_weights(trace: OriginTrace) -> str:
    weights = _of_target(trace.super_weights, trace.targets.iloc[0])
    weights = weights.reindex(weights.zscore.abs().sort_values(ascending=False).index).head(2)
    return "; ".join(f"{w.hf_param}[{w.hf_row}, {w.hf_col}] = {num(w.value)} (z = {num(w.zscore)})"
                     for w in weights.itertuples()) or "none"


def _attribution(trace: OriginTrace) -> str:
    frame = _of_target(trace.attribution, trace.targets.iloc[0])
    frame = frame[frame.target == "peak"] if "target" in frame else frame
    frame = frame.reindex(frame.share.abs().sort_values(ascending=False).index)
    return ", ".join(f"{a.label} {pct(a.share)}" for a in frame.head(5).itertuples()) or "none"


def _original(frame: pd.DataFrame) -> str:
    rows = frame[frame.setting == "original"]
    return num(float(rows.perplexity.iloc[0])) if not rows.empty else MISSING


def _ratio(frame: pd.DataFrame, setting: str) -> str:
    rows = frame[frame.setting == setting]
    if rows.empty:
        return MISSING
    r = rows.iloc[0]
    mark = f" {REBUILT_MARK}" if bool(getattr(r, "rebuilt", False)) else ""
    return f"x{ratio(r.ratio)} [{ratio(r.ratio_low)}, {ratio(r.ratio_high)}]{mark}"


def _unique_names(results: list[Any]) -> None:
    seen: dict[str, int] = {}
    for r in results:
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name} ({seen[r.name]})"
