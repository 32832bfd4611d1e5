"""The massive mask where few entries pass, without the median it is compared with: for the lower
median ``m`` of a hidden state's ``|x|`` and a value ``c``, ``fl(ratio * m) < c`` exactly when
enough entries scale below ``c`` (:func:`few_massive`). The rule itself is
:class:`~massive_lens.core.criterion.Criterion`'s; :func:`~massive_lens.core.criterion.massive_mask`
calls this first.

>>> from massive_lens.core.criterion import Criterion
>>> x = torch.ones(1, 4, 8); x[0, 0, 3] = 5000.0
>>> few_massive(x, Criterion()).nonzero().tolist()
[[0, 0, 3]]
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["FEW_MASSIVE", "few_massive"]


FEW_MASSIVE = 4  # values above abs_threshold tested by few_massive before it takes the median


def few_massive(mag: Float[Tensor, "batch pos d_model"], criterion: Any) -> Tensor | None:
    """``criterion.passes(mag, median)`` (``criterion`` a :class:`~massive_lens.core.criterion.Criterion`)
    over whole hidden states without pads, without the median where few entries pass (None: take
    it). ``fl(ratio * m) < c`` for the lower median ``m`` (the ``k``-th smallest of ``n``, ``k = (n -
    1) // 2``) exactly when at least ``k + 1`` entries ``x`` have ``fl(ratio * x) < c`` (rounding is
    monotone), so the values above ``abs_threshold`` are tested from the largest down: the first that
    fails bounds the mask (``mag > it``)."""
    if criterion.median_over != "hidden_state" or mag.device.type != "cpu" or not mag.numel():
        return None
    flat = mag.flatten(1)
    k = (flat.shape[1] - 1) // 2
    bounds = []
    for row in flat:  # per sequence (its own median)
        scaled, left, bound = criterion.ratio_threshold * row, row, None
        for _ in range(FEW_MASSIVE + 1):  # the values, largest first
            c = float(left.max())
            if c != c:  # NaN (ranked above every number): the slow path
                return None
            if not c > criterion.abs_threshold:  # every value above abs_threshold passed
                bound = criterion.abs_threshold
                break
            if int((scaled < c).sum()) < k + 1:  # fails, and so does every smaller value
                bound = c
                break
            left = torch.where(left < c, left, -1.0)  # the values below c
        if bound is None:
            return None  # more pass than were tested: take the median
        bounds.append(bound)
    return mag > torch.tensor(bounds, dtype=mag.dtype)[:, None, None]
