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


def waterfall_axes(ledger: pd.DataFrame, *, ax: Any = None, title: str = "") -> Any:
    """Waterfall of one (pos, dim) ledger: a bar per component from the residual before it to
    the residual after it (blue writes up, red writes down), and the measured residual.

    >>> frame = pd.DataFrame({"layer": [0, 0, 0], "component": ["embed", "attn", "mlp"],
    ...                       "contribution": [1.0, -0.5, 800.0], "resid": [1.0, 0.5, 800.5]})
    >>> waterfall_axes(frame).get_xlabel()
    'layer (each layer: attention bar, then MLP bar)'
    """
    ax = _axes(ax, size=(9, 4))
    after = ledger["resid"].to_numpy()
    contrib = ledger["contribution"].to_numpy()
    x = list(range(len(ledger)))
    colors = ["tab:blue" if c >= 0 else "tab:red" for c in contrib]
    ax.bar(x, contrib, bottom=after - contrib, color=colors, width=0.8)
    ax.step(x, after, where="mid", color="black", lw=0.8, label="residual after component")
    ticks = [i for i, (c, layer) in enumerate(zip(ledger["component"], ledger["layer"])) if c == "attn" and layer % 2 == 0]
    ax.set_xticks(ticks, [str(ledger["layer"].iloc[i]) for i in ticks])
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("layer (each layer: attention bar, then MLP bar)")
    ax.set_ylabel("value in the traced dim (residual units)")
    ax.set_title(title)
    ax.legend(frameon=False)
    return ax
