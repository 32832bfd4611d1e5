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

import functools
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
    ratio, floor = np.asarray(criterion.ratio_threshold, dtype=rows.dtype), _below(criterion.abs_threshold, rows.dtype)
    out = np.zeros(rows.shape, dtype=bool)
    for row, hit in zip(rows, out, strict=True):  # per sequence (its own median)
        top = row.max()
        if top != top:  # NaN (ranked above every number): the median's path
            return None
        over = np.flatnonzero(row > floor) if top > floor else np.zeros(0, dtype=np.intp)  # > abs_threshold
        if len(over) > MAX_CANDIDATES:
            return None
        found = row[over]
        values = np.unique(found)[::-1]  # distinct, largest first
        failing = _first_failing(values, ratio * row, k) if len(values) else 0
        bound = values[failing] if failing < len(values) else np.asarray(criterion.abs_threshold, dtype=rows.dtype)
        hit[over[found > bound]] = True  # every entry above the bound is above the floor
    return torch.from_numpy(out).view(mag.shape)


@functools.lru_cache(maxsize=64)
def _below(threshold: float | int, dtype: Any) -> Any:
    """The largest ``dtype`` value at or under ``threshold``: ``x > it`` exactly when ``x > threshold`` (a
    float64 comparison, which costs NumPy a copy of the row), for every ``x`` of ``dtype``."""
    with np.errstate(over="ignore"):
        value = np.asarray(threshold, dtype=dtype)
    return np.nextafter(value, dtype.type(-np.inf)) if float(value) > threshold else value


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
