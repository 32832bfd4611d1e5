"""The paper's Figure 1 drawn from values: a 3D landscape of |activation| over tokens x dims
(:func:`landscape_axes`), and readable token tick labels (:func:`tick_label`,
:func:`token_ticks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib
import numpy as np

from massive_lens.core.render import new_figure
from massive_lens.errors import MassiveLensError


def tick_label(token: str, width: int = 12) -> str:
    """A token string as a readable tick label (newlines and spaces made visible)."""
    shown = token.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423") or "\u2205"
    return shown if len(shown) <= width else shown[: width - 1] + "\u2026"


def token_ticks(n_tokens: int, keep: Sequence[int] = (), most: int = 12) -> list[int]:
    """The positions to label on a token axis: every position in ``keep`` (the tokens the
    figure is about) and evenly spaced others, at most ``most`` in all where ``keep`` allows,
    none of them crowding a kept one.

    >>> token_ticks(40, keep=[0, 7])
    [0, 7, 12, 16, 20, 24, 28, 32, 36]
    """
    keep = sorted({int(p) for p in keep if 0 <= p < n_tokens})
    step = max(1, -(-n_tokens // max(1, most - len(keep))))
    grid = [i for i in range(0, n_tokens, step) if all(abs(i - k) >= step for k in keep)]
    return sorted(set(keep) | set(grid))


def landscape_axes(
    values: Any,
    tokens: Sequence[str],
    *,
    label_dims: Sequence[int] = (),
    label_tokens: Sequence[int] = (),
    ax: Any = None,
    title: str = "",
    outlier_dims: Sequence[int] = (),
) -> Any:
    """3D landscape of ``|values|`` (``[pos, d_model]``) over tokens x dims, the paper's Figure 1:
    one ridge per token with its spikes, the ``label_dims`` annotated at their peak token and
    the ``label_tokens`` tick labels in red.

    Args:
        values: activations ``[pos, d_model]`` (a tensor, array or nested list); their
            magnitudes are drawn.
        tokens: one string per position.
        label_dims: dimensions to annotate.
        label_tokens: positions whose tick labels and ridges are red.
        ax: a 3D matplotlib Axes (``projection="3d"``) to draw on (None: a new figure).
        title: the Axes title (default none).
        outlier_dims: outlier dimensions (massive at most tokens) to annotate apart, in grey,
            below the labels of ``label_dims``.

    Returns:
        The 3D matplotlib Axes.

    Raises:
        MassiveLensError: if ``values`` is not ``[pos, d_model]`` with one row per token.

    >>> import numpy as np
    >>> vals = np.ones((3, 16)); vals[0, 5] = 900.0
    >>> ax = landscape_axes(vals, ["<s>", "Hi", "."], label_dims=[5], label_tokens=[0])
    >>> ax.get_zlabel(), [t.get_text() for t in ax.texts]
    ('|activation| (residual units)', ['dim 5'])
    """
    mag = np.abs(np.asarray(values, dtype=float))
    if mag.ndim != 2 or mag.shape[0] != len(tokens):
        raise MassiveLensError(f"values must be [pos, d_model] with pos = {len(tokens)} tokens, got {mag.shape}")
    if ax is None:
        fig = new_figure(0, 0, size=(8.0, 5.5))[0]
        ax = fig.add_subplot(projection="3d")
    dims = np.arange(mag.shape[1])
    cmap = matplotlib.colormaps["viridis"]
    for pos in range(mag.shape[0]):
        color = "tab:red" if pos in label_tokens else cmap(pos / max(1, mag.shape[0] - 1))
        ax.plot(dims, np.full_like(dims, pos), mag[pos], color=color, lw=0.8)
    placed: list[tuple[int, int]] = []  # labels near each other (same token, close dims) stack upwards
    for dim in sorted(label_dims, key=lambda d: -mag[:, d].max()):
        pos = int(mag[:, dim].argmax())
        near = sum(p == pos and abs(d - dim) < 0.08 * len(dims) for d, p in placed)
        ax.text(dim, pos, mag[pos, dim] + near * 0.08 * mag.max(), f"dim {dim}", color="tab:red", fontsize=8)
        placed.append((dim, pos))
    for dim in outlier_dims:  # a property of the dim: labelled at the floor, not at a token's spike
        ax.text(dim, mag.shape[0] - 1, 0.0, f"dim {dim} (outlier dim)", color="0.45", fontsize=7)
    ticks = token_ticks(len(tokens), label_tokens)
    ax.set_yticks(ticks, [tick_label(tokens[i], width=10) for i in ticks], fontsize=7)
    for label, i in zip(ax.get_yticklabels(), ticks, strict=True):
        if i in label_tokens:
            label.set_color("tab:red")
    ax.set_xlabel("hidden dimension")
    ax.set_ylabel("token")
    ax.set_zlabel("|activation| (residual units)")
    ax.view_init(elev=25, azim=-60)
    ax.set_title(title)
    return ax
