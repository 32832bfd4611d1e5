"""The ledger of a traced entry and its events (births, erasures, rebirths).

The residual stream is a sum: at position ``pos`` and dimension ``dim`` the value after
layer ``L`` is ``embed (+ pos_embed) + sum_{l <= L} (attn_l + mlp_l)``. The ledger lists those
terms in forward order with the measured residual after each, so it reconstructs the
residual exactly (:func:`reconstruction_error` checks it); events are the components that
change the value by a large share of its size.

Each event has a ``kind``, decided here once, which the table (``OriginTrace.events``) shows
and the summary's verbs are read from (:data:`VERBS`). An entry is **born** where a component
first brings its value to at least ``BIRTH_SHARE`` (10%) of its peak: earlier events are
``write`` ("written by": a write of 113 into a dim that peaks at 100,000 is not its birth,
however it passes the criterion's absolute threshold), that one is the ``birth``, later
increases are ``raise`` ("raised by"), a write after an erasure is a ``rebirth``
("rewritten by"; a rewrite that first reaches the share is the birth), and a component that
shrinks the value is an ``erasure`` ("cut").
"""

from __future__ import annotations

from typing import Any

from massive_lens.origin.capture import Capture

LEDGER_COLUMNS = ["pos", "dim", "token", "layer", "component", "contribution", "resid"]
EVENT_COLUMNS = ["pos", "dim", "layer", "component", "kind", "contribution", "before", "after"]
EVENT_MIN_SHARE = 0.3  # an event changes the value by >= 30% of |before| or |after| ...
EVENT_MIN_PEAK = 0.02  # ... and by >= 2% of the peak |value| (or the criterion's abs_threshold)
BIRTH_SHARE = 0.1  # an entry is born where a component first brings it to >= 10% of its peak
BIRTH_KINDS = ("birth", "rebirth")  # the events OriginTrace.births lists (and verification ablates)
VERBS = {"write": "written by", "birth": "born in", "raise": "raised by", "rebirth": "rewritten by", "erasure": "cut"}


def ledger_rows(cap: Capture, pos: int, dim: int, tokens: list[str]) -> list[dict[str, Any]]:
    i = cap.index(pos)
    L = cap.layers
    rows = [("embed", 0, cap.embed[i, dim], cap.embed[i, dim] if cap.pos_embed is not None else cap.resid_pre0[i, dim])]
    if cap.pos_embed is not None:
        rows.append(("pos_embed", 0, cap.pos_embed[i, dim], cap.resid_pre0[i, dim]))
    attn, mid, mlp, post = (L[key][:, i, dim].tolist() for key in ("attn", "resid_mid", "mlp", "resid_post"))
    for layer in range(len(attn)):
        rows.append(("attn", layer, attn[layer], mid[layer]))
        rows.append(("mlp", layer, mlp[layer], post[layer]))
    return [dict(pos=pos, dim=dim, token=tokens[pos], layer=layer, component=c, contribution=float(v),
                 resid=float(r)) for c, layer, v, r in rows]


def reconstruction_error(ledgers: list[list[dict[str, Any]]]) -> float:
    """max |cumulative sum of contributions - measured residual| / max |residual|, over the
    targets' ledgers (each as :func:`ledger_rows` gives it)."""
    worst = 0.0
    for rows in ledgers:
        total, scale = 0.0, max(max((abs(r["resid"]) for r in rows), default=0.0), 1e-30)
        for r in rows:
            total += r["contribution"]  # float64, as the rows hold Python floats
            worst = max(worst, abs(total - r["resid"]) / scale)
    return worst


def events(rows: list[dict[str, Any]], abs_threshold: float) -> list[dict[str, Any]]:
    """Births, erasures and rebirths in one target's ledger (``rows``, as :func:`ledger_rows`
    gives it): components that change the value by a large fraction of its current size, and
    by enough in absolute terms (2% of the peak, or the criterion's absolute threshold if that
    is lower, so an early birth to ~800 still counts next to a later rewrite to ~25,000)."""
    peak = max((abs(r["resid"]) for r in rows), default=0.0)
    floor = min(EVENT_MIN_PEAK * peak, abs_threshold)
    found, before = [], 0.0
    for r in rows:
        after, c = float(r["resid"]), float(r["contribution"])
        big = abs(c) >= floor and abs(c) >= EVENT_MIN_SHARE * max(abs(before), abs(after))
        if big and peak > 0:
            found.append(dict(pos=r["pos"], dim=r["dim"], layer=r["layer"], component=r["component"], kind="",
                              contribution=c, before=before, after=after))
        before = after
    for e, kind in zip(found, event_kinds([(e["before"], e["after"]) for e in found], peak), strict=True):
        e["kind"] = kind
    return found


def event_kinds(changes: list[tuple[float, float]], peak: float) -> list[str]:
    """The ``kind`` of each event of one entry, from its value ``(before, after)`` in forward
    order and the entry's peak (see the module docstring): the one rule for what a birth is.

    >>> event_kinds([(0.0, 300.0), (300.0, 40.0), (40.0, 10_000.0), (10_000.0, 4_000.0)], 10_000.0)
    ['write', 'erasure', 'birth', 'erasure']
    >>> event_kinds([(0.0, 200.0), (200.0, 1_200.0), (1_200.0, 5_000.0)], 5_000.0)
    ['write', 'birth', 'raise']
    """
    kinds, born, erased = [], False, False
    for before, after in changes:
        if abs(after) < abs(before):
            kind = "erasure"
        elif not born and abs(after) >= BIRTH_SHARE * abs(peak):  # a rewrite after an erasure can be the birth
            kind, born = "birth", True
        elif not born:
            kind = "write"
        else:
            kind = "rebirth" if erased else "raise"
        erased |= kind == "erasure"
        kinds.append(kind)
    return kinds
