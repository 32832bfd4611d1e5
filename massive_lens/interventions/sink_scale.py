"""Scaling the attention each head gives the first token (ZeroTuning, Han et al. 2026).

ZeroTuning multiplies a head's attention to the first token by ``γ`` and renormalises the row:
for a query whose attention to the first token is ``p0``, the first token gets
``γ p0 / ((1 - p0) + γ p0)`` and every other key ``p_j / ((1 - p0) + γ p0)``, so the row still sums
to one and ``γ = 1`` is the untouched model (written so, not ``1 + (γ - 1) p0``, which rounds to 0
in float32 for a tiny ``γ`` where ``p0`` is 1; computed in float32 at least).
It needs no training: ``γ > 1`` gives the sink more,
``γ < 1`` hands its attention to the other keys in proportion to what they already had (removing
it outright is :func:`~massive_lens.interventions.remove_sink_attention`). The edit is made on
each chosen layer's pattern (``blocks.{l}.attn.hook_pattern``), so the model runs its eager
attention while it is active; the first token's own row (``p0 = 1``) is left as it is by the
formula itself.

>>> from massive_lens import tiny_model
>>> iv = scale_sink_attention(tiny_model("llama"), 0.5)
>>> iv.name, len(iv) == tiny_model("llama").cfg.n_layers
('sink_attention_scaled', True)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.checks import as_pair
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.assemble import acts_on
from massive_lens.interventions.intervention import Intervention

FLOAT32 = torch.finfo(torch.float32)
Gamma = Any  # a float, or {(layer, head): float}; checked by gamma_per_head with a clear error


def _scaled(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *,
            gamma: Float[Tensor, " head_index"]) -> Tensor:
    work = torch.promote_types(pattern.dtype, torch.float32)
    g = gamma.to(pattern.device, work)[None, :, None]  # [1 head 1]
    p = pattern.to(work)
    p0 = p[..., 0]
    denom = (1 - p0) + g * p0  # > 0 for γ > 0 and p0 in [0, 1]; exactly γ on the first token's own row
    out = p / denom[..., None]
    out[..., 0] = g * p0 / denom
    return out.to(pattern.dtype)


def gamma_per_head(view: ModelView, gamma: Gamma) -> dict[int, Tensor]:
    """``γ`` as a per-layer vector over the heads (1 where a head is not scaled); a float scales
    every head of every layer, a mapping only the ``(layer, head)`` pairs it names."""
    items = {(layer, head): gamma for layer in range(view.n_layers) for head in range(view.cfg.n_heads)} \
        if not isinstance(gamma, Mapping) else dict(gamma)
    if not items:
        raise MassiveLensError("scale_sink_attention: gamma names no head; give a float or {(layer, head): γ, ...}")
    out: dict[int, Tensor] = {}
    for key, g in items.items():
        layer, head = as_pair(key, "scale_sink_attention: gamma's keys", "(layer, head)")  # no bool, no float
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, numbers.Real) or not math.isfinite(g) or g <= 0:
            raise MassiveLensError(f"scale_sink_attention: γ must be a finite number > 0 (γ = 0 would leave a head "
                                   f"with no sink attention at all: use remove_sink_attention), got {g!r} for "
                                   f"layer {layer}, head {head}")
        if not FLOAT32.tiny <= g <= FLOAT32.max:  # the pattern is rescaled in float32 (at least)
            raise MassiveLensError(f"scale_sink_attention: γ = {g!r} for layer {layer}, head {head} is outside "
                                   f"float32's range [{FLOAT32.tiny:.3g}, {FLOAT32.max:.3g}], where the rescaled "
                                   "pattern is computed; for no sink attention at all use remove_sink_attention")
        if not 0 <= int(head) < view.cfg.n_heads:
            raise MassiveLensError(f"head {head} out of range: {view.name} has {view.cfg.n_heads} heads per layer")
        layer = view.chosen_layers(int(layer))[0]
        out.setdefault(layer, torch.ones(view.cfg.n_heads))[head] = float(g)  # a numpy float of any width too
    return out


def scale_sink_attention(model: Any, gamma: Gamma = 0.5, *, calibration: Any = None) -> Intervention:
    """Multiply each head's attention to the first token by ``gamma`` and renormalise the row.

    Args:
        model: a TransformerLens-style model.
        gamma: ``γ > 0`` for every head, or ``{(layer, head): γ}`` for the heads it names (the others
            keep ``γ = 1``).
        calibration: not used (the edit needs no calibration); accepted so that the registry
            builds it like the other settings.

    Returns:
        An :class:`Intervention` named ``"sink_attention_scaled"``; ``.gamma`` holds the per-layer
        vectors over the heads.

    Raises:
        MassiveLensError: for ``γ <= 0``, a non-finite or non-numeric ``γ``, a ``γ`` outside float32's
            range, an empty mapping, or a layer or head out of range.

    >>> from massive_lens import tiny_model
    >>> iv = scale_sink_attention(tiny_model("llama"), {(1, 0): 2.0})
    >>> sorted(iv.gamma), iv.gamma[1].tolist()[:2]
    ([1], [2.0, 1.0])
    """
    view = ModelView(model)
    per_layer = gamma_per_head(view, gamma)
    hooks = [(view.hook_name(layer, "attn.hook_pattern"), partial(_scaled, gamma=g))
             for layer, g in sorted(per_layer.items())]
    scaled = sum(int((g != 1).sum()) for g in per_layer.values())
    iv = Intervention(model, "sink_attention_scaled", hooks,
                      acts_on=acts_on(model, attn=sorted(per_layer),
                                      inside=f"{scaled} heads' attention to the first token (pattern, renormalised)"))
    iv.gamma = per_layer
    return iv
