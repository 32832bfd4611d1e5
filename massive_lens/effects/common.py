"""What the effect analyses share: per-sequence tables summarized with bootstrap intervals,
and the one way they draw a per-layer curve with its interval band.

>>> import pandas as pd
>>> per_seq = pd.DataFrame({"layer": [0, 0, 1, 1], "x": [1.0, 3.0, 2.0, 2.0]})
>>> with_intervals(per_seq, ["layer"], ["x"])[["layer", "x", "x_low", "x_high"]].values.tolist()
[[0.0, 2.0, 1.0, 3.0], [1.0, 2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch

from massive_lens.core.stats import bootstrap_mean


def with_intervals(per_seq: pd.DataFrame, keys: Sequence[str], metrics: Sequence[str]) -> pd.DataFrame:
    """One row per ``keys`` group: each metric's mean over sequences and its 95% bootstrap
    interval (``<metric>_low``, ``<metric>_high``), and ``n_seqs``."""
    rows = []
    for group, part in per_seq.groupby(list(keys), sort=False):
        row: dict[str, Any] = dict(zip(keys, group if isinstance(group, tuple) else (group,), strict=True))
        for metric in metrics:
            values = torch.tensor(part[metric].to_numpy(dtype=float))
            low, high = bootstrap_mean(values)
            row.update({metric: float(values.mean()), f"{metric}_low": low, f"{metric}_high": high})
        row["n_seqs"] = len(part)
        rows.append(row)
    return pd.DataFrame(rows)


def band(ax: Any, frame: pd.DataFrame, metric: str, *, x: str = "layer", **style: Any) -> Any:
    """Draw ``metric`` over ``x`` with its interval as a shaded band; returns the line."""
    (line,) = ax.plot(frame[x], frame[metric], marker="o", markersize=3, **style)
    if f"{metric}_low" in frame:
        ax.fill_between(frame[x], frame[f"{metric}_low"], frame[f"{metric}_high"], color=line.get_color(), alpha=0.2)
    return line
