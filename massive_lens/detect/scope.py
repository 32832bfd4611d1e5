"""Two scopes of massive activation: token-specific entries and outlier dimensions.

A token-specific massive activation sits on a few tokens (the first token, a delimiter); an
*outlier dimension* passes the massive criterion at most tokens of a layer (usually because
that layer's median is tiny). The rule is :func:`~massive_lens.core.criterion.outlier_dims`;
this module turns labelled entries into tables and summary lines, shared by
:func:`~massive_lens.find_massive` and :func:`~massive_lens.scan_corpus`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from massive_lens.core.fmt import num, pct
from massive_lens.core.outliers import OUTLIER_DIM_SHARE


def layer_span(layers: Iterable[Any]) -> str:
    """Layers for people: ``layer 3``, ``layers 0-3``, ``layers 0-2, 5``.

    >>> layer_span([0, 1, 2, 3]), layer_span([4]), layer_span([0, 1, 2, 5])
    ('layers 0-3', 'layer 4', 'layers 0-2, 5')
    """
    items = sorted(set(int(x) for x in layers))
    runs: list[list[int]] = []
    for x in items:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return f"layer {text}" if len(items) == 1 else f"layers {text}"


def outlier_lines(rows: pd.DataFrame, limit: int = 6) -> list[str]:
    """Summary lines for outlier dimensions (``dim``, ``share``, ``layers``, ``value``): ``dim 400
    at 95% of tokens in layers 0-3: an outlier dimension (largest |value| 2,863)``."""
    if rows.empty:
        return []
    lines = [f"outlier dimensions ({len(rows)}; massive at >= {OUTLIER_DIM_SHARE:.0%} of a layer's tokens, "
             "a property of the dim, not of a token; listed apart):"]
    for r in rows.head(limit).itertuples():
        value = getattr(r, "value", float("nan"))
        size = "" if value != value else f" (largest |value| {num(abs(value))})"
        layers = getattr(r, "layers", range(r.first_layer, r.last_layer + 1))
        lines.append(f"  dim {r.dim} at {pct(r.share)} of tokens in {layer_span(layers)}: an outlier "
                     f"dimension{size}")
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more outlier dimensions")
    return lines


def scoped(entries: pd.DataFrame) -> pd.DataFrame:
    """The entries with a ``scope`` column (results saved before scopes existed are token-specific)."""
    return entries.copy() if "scope" in entries else entries.assign(scope="token")


def outlier_table(outliers: pd.DataFrame, entries: pd.DataFrame) -> pd.DataFrame:
    """Per outlier dim (see :meth:`MassiveActivations.outlier_dims`), from per-(seq, layer, dim)
    shares and the scoped entries."""
    columns = ["dim", "layers", "first_layer", "last_layer", "share", "seqs", "value"]
    if outliers.empty:
        return pd.DataFrame(columns=columns)
    mine = entries[entries.scope == "outlier_dim"]
    rows = []
    for d, g in outliers.groupby("dim"):
        values = mine[mine.dim == d].value
        value = float(values.loc[values.abs().idxmax()]) if len(values) else float("nan")
        layers = tuple(sorted(int(x) for x in g.layer.unique()))
        rows.append((int(d), layers, layers[0], layers[-1], float(g.share.mean()), int(g.seq.nunique()), value))
    frame = pd.DataFrame(rows, columns=columns)
    return frame.sort_values(["share", "dim"], ascending=[False, True]).reset_index(drop=True)
