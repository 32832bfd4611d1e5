"""The cells of the comparison page (:func:`~massive_lens.report.compare_models`): each turns
one model's results into the short text of one table cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from massive_lens.core.fmt import num, pct, ratio, short
from massive_lens.origin import OriginTrace

MISSING = "-"  # a cell whose analysis did not run (or a setting that was not needed)
RAN_BY = {"found": "find_massive", "scan": "scan_corpus", "trace": "trace_origin", "table": "interventions"}
# a row reads one of these results of a model's column; the analysis named is what made it


def cell(fn: Any, r: Any, needs: str | None = None) -> str:
    """``fn(r)`` as the text of one table cell. Where the result it ``needs`` (a key of
    :data:`RAN_BY`) is missing, because that analysis did not run on this model, the cell is
    :data:`MISSING` and says so (the section's notes say why); any error of ``fn`` itself is a
    bug and raises.

    >>> from types import SimpleNamespace
    >>> r = SimpleNamespace(found=None, notes=[("find_massive", "m: find_massive did not run: ...")])
    >>> cell(lambda r: len(r.found.dims), r, "found")
    '- (find_massive did not run; see the note below)'
    >>> cell(lambda r: "x2.0", r)
    'x2.0'
    """
    if needs is not None and getattr(r, needs) is None:
        what = RAN_BY[needs]
        noted = any(w == what for w, _ in getattr(r, "notes", ()))
        return f"{MISSING} ({what} did not run{'; see the note below' if noted else ''})"
    value = fn(r)
    return MISSING if value is None or value == "" else str(value)


def side_by_side(results: Sequence[Any], rows: Sequence[tuple[str, str | None, Any]]) -> pd.DataFrame:
    """One row per ``(label, needs, cell function)`` (see :func:`cell`), one column per model.

    >>> from types import SimpleNamespace
    >>> side_by_side([SimpleNamespace(name="m", n_layers=2)], [("layers", None, lambda r: r.n_layers)]).values.tolist()
    [['layers', '2']]
    """
    data = {"": [label for label, _, _ in rows]}
    for r in results:
        data[r.name] = [cell(fn, r, needs) for _, needs, fn in rows]
    return pd.DataFrame(data)
REBUILT_MARK = "(rebuilt)"  # after a ratio whose removal the model undid downstream


def listed(items: list[Any], limit: int = 6) -> str:
    """The first ``limit`` items, comma-separated, and how many more."""
    head = ", ".join(str(i) for i in items[:limit])
    return head + (f" (+{len(items) - limit} more)" if len(items) > limit else "") if items else "none"


def counts(column: pd.Series) -> str:
    """Each value of ``column`` with how often it occurs."""
    return ", ".join(f"{kind} {n}" for kind, n in column.value_counts().items()) or "none"


def layer_range(layers: Sequence[int], n_layers: int) -> str:
    """The first and last of ``layers`` out of the model's ``n_layers``."""
    return f"{min(layers)}-{max(layers)} of 0-{n_layers - 1}" if layers else "none"


def token_pairs(r: Any) -> pd.DataFrame:
    """The token-specific massive (position, dim) rows of one model's results."""
    rows = r.found.by_dim()
    return rows[rows.scope == "token"]


def largest(rows: pd.DataFrame) -> str | None:
    """The largest |value| of ``rows``: its ratio, dim, token and peak layer."""
    if rows.empty:
        return "none"
    top = rows.loc[rows.value.abs().idxmax()]
    return f"{num(top.value)} ({num(top.ratio)}x), dim {top.dim} at {short(top.token, 20)!r}, layer {top.peak_layer}"


def entry(t: Any) -> str:
    """The traced target ``t``: its dim, token, kind and position."""
    kind = f"{t.token_kind}, " if "token_kind" in t else ""
    return f"dim {t.dim} at {short(t.token, 20)!r} ({kind}pos {t.pos})" + ("" if t.massive else ", not massive")


def peak(t: Any) -> str:
    """The traced target's peak, its layer, and its final value."""
    return f"{num(t.peak)} (layer {t.peak_layer}), {num(t.final)}"


def _of_target(frame: pd.DataFrame, t: Any) -> pd.DataFrame:
    return frame[(frame.pos == t.pos) & (frame.dim == t.dim)]


def births(trace: OriginTrace) -> str:
    """Each birth event of the first traced target: component, layer, contribution."""
    births = _of_target(trace.births, trace.targets.iloc[0])
    return "; ".join(f"{b.component} {b.layer}: {'+' if b.contribution >= 0 else ''}{num(b.contribution)}"
                     for b in births.itertuples()) or "none"


def neurons(trace: OriginTrace) -> str:
    """The top birth neurons per MLP of the first traced target, with their shares."""
    t = trace.targets.iloc[0]
    neurons = _of_target(trace.neurons, t)
    neurons = neurons[neurons.kind == "birth"] if "kind" in neurons else neurons
    parts = [f"MLP {layer}: " + ", ".join(f"{n.neuron} ({pct(n.share)})" for n in group.head(3).itertuples())
             for layer, group in neurons.groupby("layer", sort=True)]
    return "; ".join(parts) or "none"


def super_weights(trace: OriginTrace) -> str:
    """The two candidate super weights of the first traced target with the largest |z|."""
    weights = _of_target(trace.super_weights, trace.targets.iloc[0])
    weights = weights.reindex(weights.zscore.abs().sort_values(ascending=False).index).head(2)
    return "; ".join(f"{w.hf_param}[{w.hf_row}, {w.hf_col}] = {num(w.value)} (z = {num(w.zscore)})"
                     for w in weights.itertuples()) or "none"


def attribution(trace: OriginTrace) -> str:
    """The five largest shares of the first traced target's peak."""
    frame = _of_target(trace.attribution, trace.targets.iloc[0])
    frame = frame[frame.target == "peak"] if "target" in frame else frame
    frame = frame.reindex(frame.share.abs().sort_values(ascending=False).index)
    return ", ".join(f"{a.label} {pct(a.share)}" for a in frame.head(5).itertuples()) or "none"


def original_perplexity(frame: pd.DataFrame) -> str:
    """The untouched model's perplexity in an intervention table's frame."""
    rows = frame[frame.setting == "original"]
    return num(float(rows.perplexity.iloc[0])) if not rows.empty else MISSING


def setting_ratio(frame: pd.DataFrame, setting: str) -> str:
    """A setting's perplexity ratio with its interval (and the rebuilt mark)."""
    rows = frame[frame.setting == setting]
    if rows.empty:
        return MISSING
    r = rows.iloc[0]
    mark = f" {REBUILT_MARK}" if bool(getattr(r, "rebuilt", False)) else ""
    return f"x{ratio(r.ratio)} [{ratio(r.ratio_low)}, {ratio(r.ratio_high)}]{mark}"


def unique_names(results: list[Any]) -> None:
    """Number repeated model names in place (``a``, ``a (2)``) so each column is named once."""
    seen: dict[str, int] = {}
    for r in results:
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name} ({seen[r.name]})"
