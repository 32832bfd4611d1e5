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
    ax = _axes(ax, size=(9.0, 4.0))
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


def sink_mass_axes(frame: pd.DataFrame, *, threshold: float = 0.3, ax: Any = None, title: str = "") -> Any:
    """Attention mass on the sinks per layer: mean over heads with the heads' min-max range,
    and the first-token mass compared with the sink-metric ``threshold``.

    >>> frame = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1],
    ...                       "sink_mass": [0.1, 0.3, 0.8, 0.9], "first_token_mass": [0.1, 0.3, 0.8, 0.9]})
    >>> sink_mass_axes(frame).get_ylim()[1] >= 1
    True
    """
    ax = _axes(ax)
    by = frame.groupby("layer")
    mean = by["sink_mass"].mean()
    line = ax.plot(mean.index, mean.values, marker="o", markersize=3, label="sink mass (mean over heads)")[0]
    ax.fill_between(mean.index, by["sink_mass"].min().values, by["sink_mass"].max().values,
                    color=line.get_color(), alpha=0.2, lw=0, label="range over heads")
    first = by["first_token_mass"].mean()
    ax.plot(first.index, first.values, ls="--", color="tab:gray", label="attention to first token")
    ax.axhline(threshold, color="tab:red", lw=0.8, ls=":", label=f"sink-metric threshold {threshold:g}")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention share")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return ax


def sink_content_axes(frame: pd.DataFrame, *, ax: Any = None, title: str = "") -> Any:
    """Mean norm of the sink and content terms per layer (log scale, left) and the sink
    term's mean pairwise cosine across query positions and texts (right).

    >>> frame = pd.DataFrame({"layer": [0, 0], "head": [0, 0], "term": ["sink", "content"],
    ...                       "norm": [2.0, 1.0], "cos_pos": [0.99, 0.2], "cos_text": [0.98, 0.1]})
    >>> sink_content_axes(frame).get_yscale()
    'log'
    """
    ax = _axes(ax)
    norms = frame.groupby(["term", "layer"])["norm"].mean()
    for term in ("sink", "content"):
        if term in norms.index.get_level_values(0):
            ax.plot(norms[term].index, norms[term].values, marker="o", markersize=3, label=f"{term} term norm")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean norm per head (residual units)")
    twin = ax.twinx()
    sink = frame[frame["term"] == "sink"].groupby("layer")[["cos_pos", "cos_text"]].mean()
    twin.plot(sink.index, sink["cos_pos"], ls="--", color="tab:green", label="sink cos across positions")
    twin.plot(sink.index, sink["cos_text"], ls=":", color="tab:olive", label="sink cos across texts")
    twin.set_ylim(-0.05, 1.05)
    twin.set_ylabel("mean pairwise cosine")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], frameon=False, fontsize=8)
    ax.set_title(title)
    return ax


def intervention_bars(frame: pd.DataFrame, *, ax: Any = None, title: str = "") -> Any:
    """Perplexity ratio to the original per setting (log scale) with 95% interval whiskers.

    >>> frame = pd.DataFrame({"setting": ["original", "zero"], "ratio": [1.0, 50.0],
    ...                       "ratio_low": [1.0, 30.0], "ratio_high": [1.0, 80.0]})
    >>> intervention_bars(frame).get_yscale()
    'log'
    """
    ax = _axes(ax)
    ratio = frame["ratio"].clip(upper=1e6)
    low = (ratio - frame["ratio_low"].clip(upper=1e6)).clip(lower=0)
    high = (frame["ratio_high"].clip(upper=1e6) - ratio).clip(lower=0)
    colors = ["tab:red" if r > 1.1 else "tab:blue" for r in ratio]
    ax.bar(frame["setting"], ratio, yerr=[low, high], capsize=3, color=colors, alpha=0.8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity / original (95% interval)")
    ax.tick_params(axis="x", rotation=30)
    ax.set_title(title)
    return ax
