"""The checks of scalar options that every entry point shares, so that one rule holds everywhere.

* an integer option (a count, a layer, a head, a seed) is an ``int`` or a numpy integer, never a
  ``bool`` (``True`` is not layer 1) and never a float (``0.7`` is not layer 0, ``2.5`` heads is
  no count);
* a number option is an ``int``, a ``float`` or a numpy number of any width (``np.float32`` as
  well as ``np.float64``), never a ``bool`` or a string, and never NaN (``max_seconds=nan`` is no
  bound);
* each names the option, what it got and what it takes, as a :class:`~massive_lens.errors.MassiveLensError`.

>>> as_int(3, "n_heads", low=1), as_number(np.float32(0.5), "gamma", above=0)
(3, 0.5)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from massive_lens.errors import MassiveLensError

__all__ = ["as_int", "as_number", "as_pair", "as_seconds", "full_precision"]


def _range(low: float | int | None, high: float | int | None, above: float | int | None,
           below: float | int | None = None) -> str:
    parts = ([f"> {above:g}"] if above is not None else []) + ([f">= {low:g}"] if low is not None else []) \
        + ([f"<= {high:g}"] if high is not None else []) + ([f"< {below:g}"] if below is not None else [])
    return " and ".join(parts)


def as_int(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` within ``[low, high]``; a bool, a float, a string or an integer out
    of range is a :class:`MassiveLensError` naming ``name``.

    >>> as_int(np.int64(2), "layer", low=0)
    2
    >>> as_int(True, "layer")
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: layer must be an integer, got True (a bool)
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        kind = "a bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
        raise MassiveLensError(f"{name} must be an integer, got {value!r} ({kind})")
    out = int(value)
    if (low is not None and out < low) or (high is not None and out > high):
        raise MassiveLensError(f"{name} must be an integer {_range(low, high, None)}, got {out}")
    return out


def as_number(value: Any, name: str, *, low: float | int | None = None, high: float | int | None = None,
              above: float | int | None = None, below: float | int | None = None, finite: bool = True) -> float:
    """``value`` as a ``float``: an int, a float or a numpy number of any width; never a bool, a
    string or NaN (nor inf with ``finite``), within ``low <= value <= high`` and ``above < value < below``.

    >>> as_number(np.float16(0.25), "share", low=0, high=1)
    0.25
    >>> as_number(1.0, "threshold", above=0, below=1)
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: threshold must be a number > 0 and < 1, got 1.0
    >>> as_number(float("nan"), "max_seconds")
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: max_seconds must be a finite number, got nan
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise MassiveLensError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if math.isnan(out) or (finite and math.isinf(out)):
        raise MassiveLensError(f"{name} must be a finite number, got {out!r}")
    if (low is not None and out < low) or (high is not None and out > high) or (above is not None and out <= above) \
            or (below is not None and out >= below):
        raise MassiveLensError(f"{name} must be a number {_range(low, high, above, below)}, got {out!r}")
    return out


def as_seconds(value: Any, name: str = "max_seconds") -> float | None:
    """A time bound: None (no bound) or a finite number of seconds > 0.

    >>> as_seconds(None), as_seconds(30)
    (None, 30.0)
    """
    return None if value is None else as_number(value, name, above=0)


def as_pair(item: Any, name: str, what: str = "(layer, head)") -> tuple[int, int]:
    """A pair of integers, e.g. a ``(layer, head)``; a bool, a float or another length is an error.

    >>> as_pair([1, 0], "heads")
    (1, 0)
    """
    if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
        raise MassiveLensError(f"{name} must be {what} pairs of integers, got {item!r}")
    first, second = (as_int(i, f"{name}: each {what} entry") for i in item)
    return first, second


def full_precision(dtype: torch.dtype, name: str, what: str, tolerance: float | int) -> None:
    """An error saying it is the precision, and what to do, when ``dtype`` cannot hold an analysis
    whose every step is checked to ``tolerance`` (relative): float16 and bfloat16 round each value
    by more than that.

    >>> full_precision(torch.float32, "tiny-llama", "sink_circuit", 1e-4)
    >>> full_precision(torch.float16, "tiny-llama", "sink_circuit", 1e-4)
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: tiny-llama is in float16, whose rounding (about 1e-03 relative) ...
    """
    if dtype in (torch.float32, torch.float64):
        return
    kind = str(dtype).removeprefix("torch.")
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1.0
    raise MassiveLensError(
        f"{name} is in {kind}, whose rounding (about {eps:.0e} relative) is coarser than the {tolerance:g} that "
        f"{what} checks each step of its split to; it is the precision, not the model: load the model in float32 "
        "(massive_lens.load_model(..., dtype='float32'), or model.float() on a copy) and run it again")
