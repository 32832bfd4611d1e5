"""The ledger of a traced entry and its events (births, erasures, rebirths).

The residual stream is a sum: at position ``pos`` and dimension ``dim`` the value after
layer ``L`` is ``embed (+ pos_embed) + sum_{l <= L} (attn_l + mlp_l)``. The ledger lists those
terms in forward order with the measured residual after each, so it reconstructs the
residual exactly (:func:`reconstruction_error` checks it); events are the components that
change the value by a large share of its size.
"""

from __future__ import annotations

from typing import Any

from massive_lens.origin.capture import Capture

LEDGER_COLUMNS = ["pos", "dim", "token", "layer", "component", "contribution", "resid"]
EVENT_COLUMNS = ["pos", "dim", "layer", "component", "kind", "contribution", "before", "after"]
EVENT_MIN_SHARE = 0.3  # an event changes the value by >= 30% of |before| or |after| ...
EVENT_MIN_PEAK = 0.02  # ... and by >= 2% of the peak |value| (or the criterion's abs_threshold)


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
    found, before, erased = [], 0.0, False
    for r in rows:
        after, c = float(r["resid"]), float(r["contribution"])
        big = abs(c) >= floor and abs(c) >= EVENT_MIN_SHARE * max(abs(before), abs(after))
        if big and peak > 0:
            kind = "erasure" if abs(after) < abs(before) else ("rebirth" if erased else "birth")
            erased |= kind == "erasure"
            found.append(dict(pos=r["pos"], dim=r["dim"], layer=r["layer"], component=r["component"], kind=kind,
                              contribution=c, before=before, after=after))
        before = after
    return found
