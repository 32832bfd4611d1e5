"""What an analysis derives from a weight matrix and needs again on every call (``W_O``'s per-head Gram
matrix, ``W_out``'s row norms, a matrix's entry statistics), kept with the module that owns the weight
while the weight stays what it was (:func:`derived`). Checking costs one read of the weight (a
matrix-vector product); what it saves is the derivation's.

>>> w = torch.randn(4, 3)
>>> owner = torch.nn.Linear(3, 4)
>>> first = derived(w, owner, "norms", lambda m: m.norm(dim=1))
>>> derived(w, owner, "norms", lambda m: m.norm(dim=1)) is first
True
>>> with torch.no_grad():
...     _ = w.mul_(2)  # edited in place: derived again
>>> torch.equal(derived(w, owner, "norms", lambda m: m.norm(dim=1)), 2 * first)
True
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["derived"]

# per owner of the weights (a layer's module), per key: (the weight's stamp, what was derived); an entry goes with
# its owner
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PROBES: dict[tuple, tuple[Tensor, Tensor]] = {}  # the fingerprint's random vectors, per shape, dtype and device


def derived(weight: Tensor, owner: Any, key: Hashable, derive: Callable[[Tensor], Any]) -> Any:
    """``derive(weight)``, kept with ``owner`` (an object that lives as long as the weight: its module; None:
    the parameter the weight is a view of, else the weight itself) under ``key`` while the weight is unchanged:
    the same memory, offset, strides, dtype and device, not edited in place (the version counter a view shares
    with its parameter: ``copy_``, ``mul_`` under ``no_grad``), and with the same fingerprint, a random bilinear
    form of the weight, which sees an edit made through ``weight.data`` (no version counted) unless it moves the
    form by less than its float32 rounding. The kept value is shared between calls: never write to it."""
    stamp = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype, weight.device, weight._version,
             _fingerprint(weight))
    if owner is None:
        owner = weight if weight._base is None else weight._base
    try:
        kept = _KEPT.setdefault(owner, {})
    except TypeError:  # an owner that cannot be referred to weakly: nothing kept
        kept = {}
    got = kept.get(key)
    if got is not None and got[0] == stamp:
        return got[1]
    value = derive(weight)
    kept[key] = (stamp, value)
    return value


def _fingerprint(weight: Tensor) -> float:
    """``s . (W r)`` for ``W`` = the weight as ``[rows, last dim]`` (float32 at least) and fixed random ``r``,
    ``s``: one read of the weight, no copy; NaN weights give NaN (never equal: no reuse)."""
    W = weight.detach().reshape(-1, weight.shape[-1]) if weight.ndim != 2 else weight.detach()
    if W.dtype in (torch.float16, torch.bfloat16):
        W = W.float()
    key = (tuple(W.shape), W.dtype, W.device)
    if key not in _PROBES:
        gen = torch.Generator().manual_seed(0)
        _PROBES[key] = tuple(torch.randn(n, generator=gen, dtype=torch.float64).to(W.device, W.dtype)
                             for n in (W.shape[1], W.shape[0]))
    r, s = _PROBES[key]
    return float(s @ (W @ r))
