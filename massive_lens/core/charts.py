"""Pure drawing: tables (DataFrames) in, matplotlib ``Axes`` out. The results' ``.plot()``
share these charts, so the style is shared; each draws on the Axes it is given or on a new figure
from :func:`~massive_lens.core.render.ensure_axes`, label axes with units, and returns the
``Axes``. Nothing here runs a model (that is :mod:`massive_lens.viz.figures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.patches import Patch

from massive_lens.core.criterion import SINK_THRESHOLD
from massive_lens.core.render import ensure_axes
from massive_lens.errors import MassiveLensError


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

    Args:
        frame: one row per layer, with a ``layer`` column.
        columns: the statistics to draw, one line each (e.g. ``["top1", "median"]``).
        ax: the matplotlib Axes to draw on (None: a new figure).
        suffix: appended to each column name to find its values (e.g. ``"_mean"``); the
            std band always reads ``column + "_std"``.
        shade: layers to highlight.
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes.

    >>> frame = pd.DataFrame({"layer": [0, 1], "top1": [2.0, 900.0], "median": [0.5, 0.6]})
    >>> profile_axes(frame, ["top1", "median"]).get_yscale()
    'log'
    """
    ax = ensure_axes(ax)
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

    Args:
        ledger: rows of one (pos, dim) ledger in forward order, with ``layer``,
            ``component``, ``contribution`` and ``resid`` columns (``OriginTrace.ledger``).
        ax: the matplotlib Axes to draw on (None: a new figure).
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes.

    >>> frame = pd.DataFrame({"layer": [0, 0, 0], "component": ["embed", "attn", "mlp"],
    ...                       "contribution": [1.0, -0.5, 800.0], "resid": [1.0, 0.5, 800.5]})
    >>> waterfall_axes(frame).get_xlabel()
    'layer (each layer: attention bar, then MLP bar)'
    """
    ax = ensure_axes(ax, size=(9.0, 4.0))
    after = ledger["resid"].to_numpy()
    contrib = ledger["contribution"].to_numpy()
    x = list(range(len(ledger)))
    colors = ["tab:blue" if c >= 0 else "tab:red" for c in contrib]
    ax.bar(x, contrib, bottom=after - contrib, color=colors, width=0.8)
    ax.step(x, after, where="mid", color="black", lw=0.8, label="residual after component")
    pairs = zip(ledger["component"], ledger["layer"], strict=True)
    ticks = [i for i, (c, layer) in enumerate(pairs) if c == "attn" and layer % 2 == 0]
    ax.set_xticks(ticks, [str(ledger["layer"].iloc[i]) for i in ticks])
    ax.axhline(0, color="grey", lw=0.5)
    peak = float(abs(after).max()) if len(after) else 0.0
    if peak > 0:  # symlog: an early birth to ~1e2 stays visible next to a rewrite to ~1e4
        ax.set_yscale("symlog", linthresh=peak / 100)
        low, high = min(float(after.min()), float((after - contrib).min()), 0.0), max(float(after.max()), 0.0)
        ax.set_ylim(low * 2, high * 2)
    ax.set_xlabel("layer (each layer: attention bar, then MLP bar)")
    ax.set_ylabel("value in the traced dim (symlog)")
    ax.set_title(title)
    ax.legend(frameon=False)
    return ax


def sink_mass_axes(frame: pd.DataFrame, *, threshold: float = SINK_THRESHOLD, ax: Any = None, title: str = "") -> Any:
    """Attention mass on the sinks per layer: mean over heads with the heads' min-max range,
    and the first-token mass compared with the sink-metric ``threshold``.

    Args:
        frame: one row per (layer, head) with ``sink_mass`` and ``first_token_mass``
            columns (``SinkAttention.to_frame()``).
        threshold: where the sink-metric threshold line is drawn (default 0.3).
        ax: the matplotlib Axes to draw on (None: a new figure).
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes.

    >>> frame = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1],
    ...                       "sink_mass": [0.1, 0.3, 0.8, 0.9], "first_token_mass": [0.1, 0.3, 0.8, 0.9]})
    >>> bool(sink_mass_axes(frame).get_ylim()[1] >= 1)
    True
    """
    ax = ensure_axes(ax)
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

    Args:
        frame: one row per (layer, head, term) with ``norm``, ``cos_pos`` and ``cos_text``
            columns (``AttentionDecomposition.to_frame()``).
        ax: the matplotlib Axes for the norms (None: a new figure); the cosines go on a
            twin Axes.
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes of the norms.

    >>> frame = pd.DataFrame({"layer": [0, 0], "head": [0, 0], "term": ["sink", "content"],
    ...                       "norm": [2.0, 1.0], "cos_pos": [0.99, 0.2], "cos_text": [0.98, 0.1]})
    >>> sink_content_axes(frame).get_yscale()
    'log'
    """
    ax = ensure_axes(ax)
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

    Args:
        frame: one row per setting with ``setting``, ``ratio``, ``ratio_low`` and
            ``ratio_high`` columns (``InterventionTable.to_frame()``); ratios are clipped at 1e6.
        ax: the matplotlib Axes to draw on (None: a new figure).
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes.

    >>> frame = pd.DataFrame({"setting": ["original", "zero"], "ratio": [1.0, 50.0],
    ...                       "ratio_low": [1.0, 30.0], "ratio_high": [1.0, 80.0]})
    >>> intervention_bars(frame).get_yscale()
    'log'
    """
    ax = ensure_axes(ax)
    ratio = frame["ratio"].clip(upper=1e6)
    low = (ratio - frame["ratio_low"].clip(upper=1e6)).clip(lower=0)
    high = (frame["ratio_high"].clip(upper=1e6) - ratio).clip(lower=0)
    colors = ["tab:red" if r > 1.1 else "tab:blue" for r in ratio]
    rebuilt = frame["rebuilt"].fillna(False).astype(bool).tolist() if "rebuilt" in frame else [False] * len(frame)
    bars = ax.bar(frame["setting"], ratio, yerr=[low, high], capsize=3, color=colors, alpha=0.8)
    for bar, flag in zip(bars, rebuilt, strict=True):
        if flag:  # the model undid this removal downstream: its ratio does not measure a removal
            bar.set_hatch("//")
            bar.set_edgecolor("black")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    readable = ticker.FuncFormatter(lambda v, _: f"x{v:g}")  # x1, x2, x50: not 6x10^0
    ax.yaxis.set_major_formatter(readable)
    # minor labels only at 2 and 5 times a power of ten, so none sits beside a major one (x0.9 on x1)
    sparse = ticker.FuncFormatter(lambda v, _: f"x{v:g}" if f"{v:.0e}"[0] in "25" else "")
    ax.yaxis.set_minor_formatter(sparse if ratio.max() / max(ratio.min(), 1e-12) < 100
                                 else ticker.NullFormatter())
    ax.set_ylabel("perplexity / original (95% interval)")
    ax.tick_params(axis="x", rotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    keys = [Patch(color=c, alpha=0.8, label=f"ratio {op} 1.1") for c, op in (("tab:red", ">"), ("tab:blue", "<="))]
    keys += [Patch(facecolor="white", edgecolor="black", hatch="//", label="rebuilt downstream: not a removal")
             ] if any(rebuilt) else []
    ax.legend(handles=keys, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title)
    return ax


# --------------------------------------------------------------------------- overlays


def _profile_columns(frame: pd.DataFrame) -> tuple[str, str]:
    """The top-1 and median columns: a result's ``.profile`` or ``.frame`` (``top1_mean``,
    ``median_mean``), or a DataFrame given as it is (``top1`` or ``max_inf_norm``, ``median``)."""
    for top, median in (("top1_mean", "median_mean"), ("top1", "median"), ("max_inf_norm", "median")):
        if top in frame and median in frame:
            return top, median
    raise MassiveLensError(f"a profile needs layer and top1/median columns; got {list(frame.columns)}")


def overlay_profiles(profiles: Any, *, relative_depth: bool = False, ax: Any = None, title: str = "") -> Any:
    """Several models' (or variants') layer profiles on one log-scale axis: top-1 solid, median
    dashed, one colour per name. ``profiles`` maps a name to a result with a per-layer
    ``.profile`` (``CorpusScan``, ``MassiveActivations``) or ``.frame`` (``LayerProfile``) or a DataFrame;
    a DataFrame with a ``variant`` column (``Comparison.profiles``) is split by it.
    ``relative_depth`` puts models of different depths on a 0-1 axis.

    Args:
        profiles: a mapping from name to result or DataFrame, or one DataFrame with a
            ``variant`` column (averaged over seeds per layer).
        relative_depth: put ``layer / last layer`` on the x axis (default False: layers).
        ax: the matplotlib Axes to draw on (None: a new figure).
        title: the Axes title (default: a description of the lines).

    Returns:
        The matplotlib Axes.

    Raises:
        MassiveLensError: if a profile lacks ``layer`` and top-1/median columns.

    >>> a = pd.DataFrame({"layer": [0, 1], "top1": [2.0, 900.0], "median": [0.5, 0.6]})
    >>> ax = overlay_profiles({"A": a, "B": a.assign(top1=[3.0, 4.0])})
    >>> ax.get_legend().get_texts()[1].get_text()
    'A median'
    """
    if isinstance(profiles, pd.DataFrame) and "variant" in profiles:
        profiles = {str(k): g.groupby("layer", as_index=False).mean(numeric_only=True)
                    for k, g in profiles.groupby("variant", sort=False)}
    ax = ensure_axes(ax)
    for name, item in dict(profiles).items():
        frame = getattr(item, "profile", item)
        frame = getattr(frame, "frame", frame)
        top, median = _profile_columns(frame)
        x = frame["layer"] / max(1, frame["layer"].max()) if relative_depth else frame["layer"]
        line = ax.plot(x, frame[top], marker="o", markersize=3, label=f"{name} top-1")[0]
        ax.plot(x, frame[median], ls="--", color=line.get_color(), label=f"{name} median")
    ax.set_yscale("log")
    ax.set_xlabel("relative depth (layer / last layer)" if relative_depth else "layer")
    ax.set_ylabel("|activation| (residual stream units)")
    ax.set_title(title or "layer profiles: top-1 (solid) and median (dashed)")
    ax.legend(frameon=False, fontsize=8)
    return ax


def loss_axes(frame: pd.DataFrame, mean: float, interval: tuple[float, float], *, ax: Any = None,
              title: str = "") -> Any:
    """Per-sequence loss (``frame.loss``), sorted, with the mean and its 95% interval.

    Args:
        frame: one row per sequence with a ``loss`` column (``Perplexity.to_frame()``).
        mean: the mean loss (a horizontal line).
        interval: ``(low, high)`` of its 95% interval (a band).
        ax: the matplotlib Axes to draw on (None: a new figure).
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes.

    >>> loss_axes(pd.DataFrame({"loss": [2.0, 3.0, 4.0]}), 3.0, (2.2, 3.8)).get_ylabel()
    'loss (nats per token)'
    """
    ax = ensure_axes(ax)
    values = np.sort(frame["loss"].to_numpy())
    ax.plot(range(len(values)), values, marker="o", markersize=3, lw=0.8, label="sequences, sorted")
    ax.axhline(mean, color="black", lw=0.8, label=f"mean {mean:.3f}")
    ax.axhspan(*interval, color="tab:blue", alpha=0.15, lw=0, label="95% bootstrap interval")
    ax.set_xlabel("sequence (sorted by loss)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return ax


def curve_axes(frame: pd.DataFrame, *, x: str = "step", y: Sequence[str] = ("loss", "val_loss"),
               by: str | None = None, ax: Any = None, title: str = "") -> Any:
    """Training curves: each ``y`` column over ``x`` (one line per ``by`` group if given).

    Args:
        frame: the logged rows (``TrainRun.to_frame()``, ``Comparison.curves``).
        x: the x column (default ``"step"``).
        y: the columns to draw, the first solid and the rest dashed; missing or all-NaN
            columns are skipped (default ``("loss", "val_loss")``).
        by: a column to group by, one set of lines per group, each the mean over its rows
            at each ``x`` (None: one group).
        ax: the matplotlib Axes to draw on (None: a new figure).
        title: the Axes title (default none).

    Returns:
        The matplotlib Axes.

    >>> frame = pd.DataFrame({"step": [1, 2], "loss": [5.0, 4.0], "val_loss": [5.1, 4.2]})
    >>> [t.get_text() for t in curve_axes(frame).get_legend().get_texts()]
    ['loss', 'val_loss']
    """
    ax = ensure_axes(ax)
    groups = frame.groupby(by, sort=False) if by else [("", frame)]
    for name, group in groups:
        for column in y:
            if column in group and group[column].notna().any():
                mean = group.groupby(x)[column].mean().dropna()
                label = f"{name} {column}".strip()
                ax.plot(mean.index, mean.values, ls="-" if column == y[0] else "--", label=label)
    ax.set_xlabel(x)
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return ax
