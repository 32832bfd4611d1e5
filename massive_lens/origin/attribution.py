"""Which writes account for a traced value: the peak, and what happened after it.

The ledger of an entry is exact: its contributions sum to the residual. An event rule
("one component changes the value by >= 30%") sees abrupt births and erasures, but a value
that grows over many layers (+10-15% per MLP) or is worn down over several has no single
event. So the peak is *attributed*: writes are grouped into runs of consecutive layers of
one component kind with one sign ("MLPs 6-11, +61,851 together"), the runs with the peak's
sign are named largest first until the named runs (and any large opposite runs) explain at
least 90% of it, and the rest is counted ("the rest: 23 small writes, 7%"). The change from
the peak to the final value is attributed the same way, so a cumulative cut is named even
when no single step is large.

>>> rows = [dict(component="embed", layer=0, contribution=1.0)] + [
...     dict(component=c, layer=l, contribution=v) for l, (a, m) in enumerate([(0.5, 100.0), (1.0, 15.0),
...     (-0.2, 17.0), (0.1, 20.0)]) for c, v in (("attn", a), ("mlp", m))]
>>> [(g["label"], round(g["contribution"], 1)) for g in attribute(rows, target=154.4)]
[('MLP 0', 100.0), ('MLPs 1-3', 52.0), ('the rest', 2.4)]
"""

from __future__ import annotations

from typing import Any

from massive_lens.origin.ledger import EVENT_MIN_SHARE

ATTRIBUTION_COLUMNS = ["pos", "dim", "target", "value", "label", "component", "first_layer", "last_layer",
                       "n_writes", "contribution", "share"]
EXPLAIN = 0.9  # named runs explain at least 90% of the target ...
RUN_MIN = 0.02  # ... a write joins a run when it is at least 2% of the target
CUT_MIN = 0.1  # opposite-sign runs of at least 10% of the target are named too
CHANGE_MIN = 0.1  # the change from peak to final is attributed when it is at least 10% of the peak
_PLURAL = {"mlp": "MLPs", "attn": "attn", "embed": "embed", "pos_embed": "pos_embed"}


def label(component: str, first: int, last: int) -> str:
    """A component over layers ``first``-``last`` for people: ``MLP 3``, ``attn 2-4``, ``embed``."""
    if component in ("embed", "pos_embed"):
        return component
    if first == last:
        return f"{'MLP' if component == 'mlp' else 'attn'} {first}"
    return f"{_PLURAL[component]} {first}-{last}"


def runs(rows: list[dict[str, Any]], scale: float, start: float = 0.0) -> tuple[list[dict[str, Any]], list]:
    """Group writes of at least ``RUN_MIN * scale`` into runs (same component kind, same sign,
    consecutive layers); an abrupt step (an event: a change of at least ``EVENT_MIN_SHARE`` of
    the value) is never merged with gradual writes. Returns the runs and the small writes."""
    out: list[dict[str, Any]] = []
    small = []
    last: dict[str, dict[str, Any]] = {}  # component kind -> its open run
    value = start
    for r in rows:
        c = float(r["contribution"])
        before, value = value, value + c
        if abs(c) < RUN_MIN * scale:
            small.append(r)
            continue
        abrupt = abs(c) >= EVENT_MIN_SHARE * max(abs(before), abs(value))
        run = last.get(r["component"])
        if abrupt:
            last.pop(r["component"], None)
        if not abrupt and run is not None and not run["abrupt"] and run["last_layer"] == r["layer"] - 1 \
                and (run["contribution"] > 0) == (c > 0):
            run["last_layer"], run["n_writes"] = r["layer"], run["n_writes"] + 1
            run["contribution"] += c
        else:
            run = dict(component=r["component"], first_layer=r["layer"], last_layer=r["layer"], n_writes=1,
                       contribution=c, abrupt=abrupt)
            out.append(run)
            if not abrupt:
                last[r["component"]] = run
    return out, small


def attribute(rows: list[dict[str, Any]], target: float, start: float = 0.0) -> list[dict[str, Any]]:
    """Name the runs of ``rows`` (ledger rows in forward order, starting from the value
    ``start``) that account for ``target`` (their sum), and one ``the rest`` row when anything
    is left (see the module docstring)."""
    scale = abs(target)
    if scale == 0:
        return []
    found, small = runs(rows, scale, start)
    sign = 1.0 if target > 0 else -1.0
    cuts = [g for g in found if g["contribution"] * sign < 0 and abs(g["contribution"]) >= CUT_MIN * scale]
    named, explained = list(cuts), sum(g["contribution"] for g in cuts)
    for g in sorted((g for g in found if g["contribution"] * sign > 0), key=lambda g: -abs(g["contribution"])):
        if explained * sign >= EXPLAIN * scale:
            break
        named.append(g)
        explained += g["contribution"]
    named.sort(key=lambda g: (g["first_layer"], g["component"] == "mlp"))
    for g in named:
        g["label"] = label(g["component"], g["first_layer"], g["last_layer"])
    rest = target - explained
    n_rest = len(small) + len([g for g in found if g not in named])
    if n_rest and abs(rest) > 1e-9 * scale:
        named.append(dict(label="the rest", component="rest", first_layer=-1, last_layer=-1, n_writes=n_rest,
                          contribution=rest))
    for g in named:
        g["share"] = g["contribution"] / target
    return named


def attribution_rows(rows: list[dict[str, Any]], pos: int, dim: int, peak_layer: int) -> list[dict[str, Any]]:
    """Attribution of one entry's peak (its residual after block ``peak_layer``) and of its
    change from the peak to the final value, from its ledger ``rows`` (forward order)."""
    at = max(i for i, r in enumerate(rows) if r["layer"] == peak_layer)  # the block's last write
    peak, final = rows[at]["resid"], rows[-1]["resid"]
    out = [dict(target="peak", value=peak, **g) for g in attribute(rows[: at + 1], peak)]
    change = final - peak
    if abs(change) >= CHANGE_MIN * abs(peak):
        out += [dict(target="change", value=change, **g) for g in attribute(rows[at + 1:], change, peak)]
    return [dict(pos=pos, dim=dim, **{k: r[k] for k in ATTRIBUTION_COLUMNS[2:]}) for r in out]
