"""Figures: the one module that makes, closes and saves them (the one user of
``matplotlib.pyplot``, ``tests/test_layout.py``). Every result's ``.plot()`` draws on Axes from
:func:`ensure_axes` or :func:`new_figure`; the shared drawing of tables is
:mod:`massive_lens.core.charts`, and nothing here runs a model (that is :mod:`massive_lens.viz.figures`).

Figures use a non-interactive backend when no display is present and are returned (or their
``Axes``) so a caller can save or restyle them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt


def new_figure(rows: int = 1, cols: int = 1, *, size: tuple[float | int, float | int] = (7, 4),
               layout: str | None = "constrained", **options: Any) -> tuple[Any, Any]:
    """``(figure, axes)``: a new figure of ``rows x cols`` Axes (``options`` go to
    ``plt.subplots``; ``rows = cols = 0``: a figure with no Axes, ``(figure, None)``). The one
    place a figure is made, so every ``.plot()`` shares the style.

    >>> fig, axes = new_figure(2, 1, size=(4, 4), sharex=True)
    >>> len(axes), new_figure(0, 0)[1] is None
    (2, True)
    """
    if rows == cols == 0:
        return plt.figure(figsize=size, layout=layout), None
    return plt.subplots(rows, cols, figsize=size, layout=layout, **options)


def ensure_axes(ax: Any = None, size: tuple[float | int, float | int] = (7, 4), *,
                layout: str | None = "constrained") -> Any:
    """``ax``, or the Axes of a new figure of ``size`` (:func:`new_figure`)."""
    return ax if ax is not None else new_figure(size=size, layout=layout)[1]


def close_figure(fig: Any = None) -> None:
    """Close ``fig`` (a Figure or the Figure of an Axes; None: every open figure) to free its memory."""
    plt.close("all" if fig is None else figure_of(fig))


def save_figure(fig_or_ax: Any, path: Any, formats: Sequence[str] = ("png", "svg"), dpi: int = 150) -> list[Any]:
    """Save a Figure (or the Figure of an Axes) as ``path`` with each suffix in ``formats``;
    returns the written paths.

    Args:
        fig_or_ax: a Figure, an Axes or an array of Axes (their Figure is saved).
        path: the file path; its suffix is replaced by each format's. Missing folders are
            created.
        formats: file formats (default ``("png", "svg")``).
        dpi: resolution of raster formats (default 150).

    Returns:
        The written paths (``pathlib.Path``), one per format.

    >>> import tempfile, pathlib
    >>> ax = ensure_axes()
    >>> _ = ax.plot([0, 1], [1.0, 9.0])
    >>> paths = save_figure(ax, pathlib.Path(tempfile.mkdtemp()) / "profile")
    >>> [p.suffix for p in paths], all(p.stat().st_size > 0 for p in paths)
    (['.png', '.svg'], True)
    """
    fig = figure_of(fig_or_ax)
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        target = base.with_suffix("." + fmt.lstrip("."))
        fig.savefig(target, dpi=dpi, bbox_inches="tight")
        out.append(target)
    return out


def figure_of(fig_or_ax: Any) -> Any:
    """The Figure behind a Figure, an Axes, or an array of Axes."""
    if hasattr(fig_or_ax, "savefig"):
        return fig_or_ax
    if hasattr(fig_or_ax, "figure"):
        return fig_or_ax.figure
    return next(iter(getattr(fig_or_ax, "flat", fig_or_ax))).figure
