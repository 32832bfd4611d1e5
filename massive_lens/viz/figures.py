"""Figures that run a model: the activation landscape and per-head attention maps.

They take a model and one text, run one forward pass that stops at the hook they need, and
draw through the pure functions of :mod:`massive_lens.core.render`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.patches import Rectangle
from torch import Tensor

from massive_lens.core.checks import as_int
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import new_figure
from massive_lens.detect import find_massive
from massive_lens.errors import MassiveLensError
from massive_lens.viz.landscape import landscape_axes, tick_label


def capture_one(model: Any, text: str | Any, layer: int, hook: str) -> tuple[Tensor, list[str]]:
    """One text's activation at ``blocks.{layer}.{hook}`` (batch dim dropped, float32, CPU)
    and its token strings; the forward pass stops right after that hook.

    Args:
        model: a TransformerLens-style model.
        text: one string, or the token ids of one text.
        layer: the block to read.
        hook: the hook inside the block, e.g. ``"resid_post"``, ``"attn.hook_pattern"`` or
            ``"mlp.hook_post"``.

    Returns:
        ``(activation, tokens)``: the activation without its batch dimension and the
        token strings.

    Raises:
        MassiveLensError: if ``text`` is a batch of several texts, empty or too long, or
            the model has no such layer or hook.

    >>> from massive_lens import tiny_model
    >>> resid, tokens = capture_one(tiny_model("llama"), "Hi.", 0, "resid_post")
    >>> tuple(resid.shape), tokens
    ((4, 64), ['<|bos|>', 'H', 'i', '.'])
    """
    view = ModelView(model)
    batch = view.tokenize(text)
    if batch.tokens.shape[0] != 1:
        raise MassiveLensError(f"this figure shows one text; got a batch of {batch.tokens.shape[0]}")
    layer = as_int(layer, "layer", low=0, high=view.n_layers - 1)  # True is no layer 1, 0.7 no layer 0
    return view.activation(batch, view.hook_name(layer, hook))[0], view.str_tokens(batch)[0]


def activation_landscape(model: Any, text: str, layer: int | None = None, *, ax: Any = None,
                         criterion: Any = None, found: Any = None) -> Any:
    """The activation landscape of ``text`` at ``layer`` (default: the layer of the headline
    activation, the largest token-specific massive value), token-specific massive dims and
    their tokens labelled in red, outlier dimensions in grey (:func:`landscape_axes`).
    ``found``: the text's ``find_massive`` result, if already computed.

    Args:
        model: a TransformerLens-style model.
        text: one string.
        layer: the layer whose ``resid_post`` is drawn (None: ``found.headline_layer``).
        ax: a 3D matplotlib Axes (``projection="3d"``) to draw on (None: a new figure).
        criterion: the :class:`~massive_lens.Criterion` for the labels (None:
            ``Criterion()``); ignored when ``found`` is given.
        found: the :func:`~massive_lens.find_massive` result of ``text`` (None: computed).

    Returns:
        The 3D matplotlib Axes.

    Raises:
        MassiveLensError: if ``text`` is empty or too long or ``layer`` is out of range.

    >>> from massive_lens import tiny_model
    >>> activation_landscape(tiny_model("llama"), "Hello. World", layer=1).get_xlabel()
    'hidden dimension'
    """
    found = found if found is not None else find_massive(model, text, criterion=criterion)
    layer = found.headline_layer if layer is None else layer
    values, tokens = capture_one(model, text, layer, "resid_post")
    entries = found.to_frame()
    at = entries[entries["layer"] == layer]
    token, outlier = at[at["scope"] == "token"], at[at["scope"] == "outlier_dim"]
    return landscape_axes(values.numpy(), tokens, label_dims=sorted(token["dim"].unique().tolist()),
                          label_tokens=sorted(token["pos"].unique().tolist()), ax=ax,
                          outlier_dims=sorted(set(outlier["dim"].unique().tolist()) - set(token["dim"].tolist())),
                          title=f"{found.model_name}: layer {layer} ({found.hook})")


def attention_maps(model: Any, text: str, layer: int, *, heads: Sequence[int] | None = None,
                   sinks: Sequence[int] | None = None, max_heads: int = 12) -> Any:
    """Per-head attention maps of one layer (query x key, token strings as ticks) with the sink
    key columns outlined in red and one colorbar for all panels. ``sinks`` default to the
    positions with token-specific massive activations (first token if none).

    Args:
        model: a TransformerLens-style model.
        text: one string.
        layer: the layer whose ``attn.hook_pattern`` is drawn.
        heads: the heads to draw (None: the first ``max_heads``).
        sinks: key positions to outline (None: the positions with token-specific massive
            activations, else ``[0]``).
        max_heads: how many heads to draw when ``heads`` is None (default 12).

    Returns:
        The first panel's matplotlib Axes, as every plot function returns; the Figure
        (``ax.figure``) holds one panel per head, up to four per row, and the colorbar.

    Raises:
        MassiveLensError: if ``text`` is empty or too long or ``layer`` is out of range.

    >>> from massive_lens import tiny_model
    >>> ax = attention_maps(tiny_model("gpt2"), "Hi there.", layer=0, heads=[0, 1])
    >>> ax.get_title(), ax.figure.axes[1].get_title()
    ('L0H0', 'L0H1')
    """
    pattern, tokens = capture_one(model, text, layer, "attn.hook_pattern")
    max_heads = as_int(max_heads, "max_heads", low=1)
    chosen = list(range(min(pattern.shape[0], max_heads))) if heads is None else \
        [as_int(h, "heads", low=0, high=pattern.shape[0] - 1) for h in heads]
    if sinks is None:
        rows = find_massive(model, text).by_dim()
        sinks = sorted(rows[rows.scope == "token"].pos.unique().tolist()) or [0]
    cols = min(4, len(chosen))
    rows = -(-len(chosen) // cols)
    fig, axes = new_figure(rows, cols, size=(3.0 * cols, 3.0 * rows), squeeze=False)
    labels = [tick_label(t, 8) for t in tokens]
    image = None
    for ax, head in zip(axes.flat, chosen, strict=False):
        image = ax.imshow(pattern[head].numpy(), cmap="Blues", vmin=0, vmax=1)
        for s in sinks:
            ax.add_patch(Rectangle((s - 0.5, -0.5), 1, len(tokens), fill=False, ec="tab:red", lw=1.5))
        ax.set_title(f"L{layer}H{head}")
        if len(tokens) <= 24:
            ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(len(tokens)), labels, fontsize=6)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.supxlabel("key token (attended to); red: sink columns")
    fig.supylabel("query token")
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    return axes.flat[0]
