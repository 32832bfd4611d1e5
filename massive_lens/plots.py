"""Figures (matplotlib). Every result's ``.plot()`` lands here, so the style is shared.

Figures use a non-interactive backend when no display is present, label axes with units,
and return the ``Axes`` so a caller can save or restyle them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd


def _axes(ax: Any = None, size: tuple[float, float] = (7, 4)) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def profile_axes(
    frame: pd.DataFrame,
    columns: Sequence[str],
    *,
    ax: Any = None,
    suffix: str = "",
    shade: Sequence[int] = (),
    title: str = "",
) -> Any:
    """Lines of ``frame[column + suffix]`` over ``frame.layer`` on a log scale, with a ±1 std
    band where a ``column + '_std'`` exists and the ``shade`` layers highlighted.

    >>> frame = pd.DataFrame({"layer": [0, 1], "top1": [2.0, 900.0], "median": [0.5, 0.6]})
    >>> profile_axes(frame, ["top1", "median"]).get_yscale()
    'log'
    """
    ax = _axes(ax)
    for column in columns:
        values = frame[column + suffix]
        line = ax.plot(frame["layer"], values, marker="o", markersize=3, label=column)[0]
        std = frame.get(column + "_std")
        if std is not None:
            low = (values - std).clip(lower=values.min() * 1e-3 if values.min() > 0 else 1e-12)
            ax.fill_between(frame["layer"], low, values + std, color=line.get_color(), alpha=0.2)
    for layer in shade:
        ax.axvspan(layer - 0.5, layer + 0.5, color="tab:red", alpha=0.08, lw=0)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("|activation| (residual stream units)")
    ax.set_title(title)
    ax.legend(frameon=False)
    return ax
