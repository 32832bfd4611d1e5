"""The patch grid of a vision transformer: one value per image patch, drawn where the patch
lies in the image, with the ``[CLS]`` token and the registers drawn apart.

A massive activation in a ViT sits on a few positions (``[CLS]``, a register, or a handful
of background patches); drawn on the grid, the patches that carry it, and the positions
that draw the attention (the sinks), are seen at a glance.

- :func:`patch_grid_axes`: values in, Axes out (nothing runs a model);
- :func:`patch_map`: one image through a ViT, the magnitude of a massive dimension (or the
  attention each position receives) at one layer, on the grid.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.colors import LogNorm
from torch import Tensor

from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.detect import find_massive
from massive_lens.errors import MassiveLensError
from massive_lens.viz.figures import capture_one

WHAT = ("massive", "sink")


def patch_grid_axes(values: Any, specials: Sequence[str], grid: tuple[int, int], *, ax: Any = None,
                    title: str = "", label: str = "") -> Any:
    """``values`` (one per position: the ``specials`` first, then the ``rows x cols`` patches
    in row-major order) as a heat map of the patch grid, on a log colour scale shared with a
    strip of the special positions drawn at its left, each with its value written in.

    Args:
        values: one non-negative value per position (a tensor, array or list).
        specials: the names of the positions before the patches (``[CLS]``, registers).
        grid: ``(rows, cols)`` of patches.
        ax: the Axes for the grid (None: a new figure); the strip is an inset of it.
        title: the Axes title.
        label: the colour bar's label.

    Returns:
        The grid's Axes (the strip is ``ax.child_axes[0]``).

    Raises:
        MassiveLensError: if there is not one value per position.

    >>> ax = patch_grid_axes([50.0, 1, 2, 3, 4], ["[CLS]"], (2, 2), title="demo")
    >>> ax.get_title(), ax.get_images()[0].get_array().shape
    ('demo', (2, 2))
    """
    vals = np.abs(np.asarray(values, dtype=float)).reshape(-1)
    rows, cols = grid
    if len(vals) != len(specials) + rows * cols:
        raise MassiveLensError(f"need one value per position: {len(specials)} special + {rows}x{cols} patches = "
                               f"{len(specials) + rows * cols}, got {len(vals)}")
    ax = ensure_axes(ax, (5.5, 4.2))
    positive = vals[vals > 0]
    low = float(positive.min()) if len(positive) else 1e-12
    norm = LogNorm(vmin=low, vmax=max(float(vals.max()), low * 1.001))
    shown = np.clip(vals, low, None)
    image = ax.imshow(shown[len(specials):].reshape(rows, cols), cmap="magma", norm=norm)
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.set_xlabel("patch column")
    ax.set_ylabel("row", labelpad=1)
    ax.set_title(title)
    if specials:
        strip = ax.inset_axes([-0.5, 0.0, 0.2, min(1.0, 0.15 * len(specials))])
        strip.imshow(shown[: len(specials), None], cmap="magma", norm=norm, aspect="auto")
        strip.set_xticks([])
        strip.set_yticks(range(len(specials)), list(specials), fontsize=7)
        for i, v in enumerate(vals[: len(specials)]):
            strip.text(0, i, f"{v:.3g}", ha="center", va="center", fontsize=7,
                       color="black" if norm(max(v, low)) > 0.6 else "white")
    ax.figure.colorbar(image, ax=ax, shrink=0.8, label=label)
    return ax


def patch_map(model: Any, image: Tensor, *, layer: int | None = None, dim: int | None = None,
              what: str = "massive", ax: Any = None) -> Any:
    """One image's patch grid (:func:`patch_grid_axes`) at ``layer``: ``what="massive"``, the
    magnitude of ``dim`` in the residual stream (``resid_post``); ``what="sink"``, the
    attention each position receives (mean over heads and queries).

    Args:
        model: a vision transformer (ViT, DeiT) loaded with :func:`massive_lens.load_model`.
        image: the ``pixel_values`` of one image (``[channels, height, width]`` or ``[1, ...]``).
        layer: the block to read (None: where top-1 / median is largest, from
            :func:`~massive_lens.find_massive`).
        dim: the hidden dimension for ``"massive"`` (None: the largest massive one, else the
            largest at ``layer``); ignored for ``"sink"``.
        what: ``"massive"`` (default) or ``"sink"``.
        ax: the Axes to draw on (None: a new figure).

    Returns:
        The grid's matplotlib Axes.

    Raises:
        MassiveLensError: if ``model`` is not a vision model, ``image`` is not one image of
            the model's size, ``what`` is unknown, or ``layer`` or ``dim`` is out of range.
    >>> from massive_lens import tiny_model
    >>> ax = patch_map(tiny_model("vit"), torch.rand(3, 32, 32), layer=0, dim=3)
    >>> ax.get_title(), [t.get_text() for t in ax.child_axes[0].get_yticklabels()]
    ('tiny-vit: |dim 3| at layer 0', ['[CLS]'])
    """
    view = ModelView(model)
    layout = view.image_layout
    if layout is None:
        raise MassiveLensError(f"patch_map draws an image's patch grid; {view.name} is a text model (use "
                               "massive_lens.viz.activation_landscape for text)")
    if what not in WHAT:
        raise MassiveLensError(f"{view.name}: what must be one of {WHAT}, got {what!r}")
    found = find_massive(model, image) if layer is None or (dim is None and what == "massive") else None
    layer = found.peak_layer if layer is None else layer
    if what == "sink":
        pattern, _ = capture_one(model, image, layer, "attn.hook_pattern")
        values, label = pattern.mean((0, 1)), "mean attention received"
        title = f"attention to each position, layer {layer}"
    else:
        resid, _ = capture_one(model, image, layer, "resid_post")
        at = found.entries[found.entries.layer == layer] if found is not None else None
        if dim is None:
            dim = int(at.loc[at.value.abs().idxmax(), "dim"]) if at is not None and len(at) else int(
                resid.abs().amax(0).argmax())
        if not 0 <= dim < view.d_model:
            raise MassiveLensError(f"dim={dim} is out of range: {view.name} has d_model={view.d_model}")
        values, label, title = resid[:, dim], f"|resid_post[{dim}]|", f"|dim {dim}| at layer {layer}"
    return patch_grid_axes(torch.as_tensor(values).abs().numpy(), layout.specials, layout.grid, ax=ax,
                           title=f"{view.name}: {title}", label=label)
