"""The massive mask without the median it is compared with: for the lower median ``m`` of a hidden
state's ``|x|`` and a value ``c``, ``fl(ratio * m) < c`` exactly when enough entries scale below
``c`` (:func:`few_massive`). The rule itself is :class:`~massive_lens.core.criterion.Criterion`'s;
:func:`~massive_lens.core.criterion.massive_mask` calls this first.

>>> from massive_lens.core.criterion import Criterion
>>> x = torch.ones(1, 4, 8); x[0, 0, 3] = 5000.0
>>> few_massive(x, Criterion()).nonzero().tolist()
[[0, 0, 3]]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["MAX_CANDIDATES", "few_massive"]


MAX_CANDIDATES = 4096  # values above abs_threshold a row may have for few_massive to rank them (more: the median)


def few_massive(mag: Float[Tensor, "batch pos d_model"], criterion: Any) -> Tensor | None:
    """``criterion.passes(mag, median)`` (``criterion`` a :class:`~massive_lens.core.criterion.Criterion`)
    over whole hidden states without pads, without the median (None: take it). ``fl(ratio * m) < c``
    for the lower median ``m`` (the ``k``-th smallest of ``n``, ``k = (n - 1) // 2``) exactly when at
    least ``k + 1`` entries ``x`` have ``fl(ratio * x) < c`` (rounding is monotone), so of the distinct
    values above ``abs_threshold`` the massive ones are the largest few: the first that fails, found by
    a galloping search from the largest down (a count each, in NumPy: torch's comparison of a
    73,728-value row costs ten times as much on one thread), bounds the mask (``mag > it``)."""
    if criterion.median_over != "hidden_state" or mag.device.type != "cpu" or not mag.numel() or \
            mag.dtype not in (torch.float32, torch.float64):
        return None
    rows = mag.detach().flatten(1).numpy()
    k = (rows.shape[1] - 1) // 2
    ratio, floor = np.asarray(criterion.ratio_threshold, dtype=rows.dtype), np.float64(criterion.abs_threshold)
    bounds = []
    for row in rows:  # per sequence (its own median)
        top = row.max()
        if top != top:  # NaN (ranked above every number): the median's path
            return None
        values = row[row > floor] if top > floor else row[:0]  # compared in float64, as the threshold is given
        if len(values) > MAX_CANDIDATES:
            return None
        values = np.unique(values)[::-1]  # distinct, largest first
        failing = _first_failing(values, ratio * row, k) if len(values) else 0
        bounds.append(values[failing] if failing < len(values) else criterion.abs_threshold)
    return torch.from_numpy(rows > np.array(bounds, dtype=rows.dtype)[:, None]).view(mag.shape)


def _first_failing(values: Any, scaled: Any, k: int) -> int:
    """The index of the first of ``values`` (distinct, largest first) that fewer than ``k + 1`` entries of
    ``scaled`` fall below (``len(values)``: none), by galloping from the largest, then halving the bracket."""
    lo, hi, step = 0, len(values), 1  # values[:lo] pass
    while lo < hi:
        probe = min(lo + step - 1, hi - 1)
        if np.count_nonzero(scaled < values[probe]) < k + 1:
            hi = probe
            break
        lo, step = probe + 1, step * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if np.count_nonzero(scaled < values[mid]) < k + 1 else (mid + 1, hi)
    return lo
