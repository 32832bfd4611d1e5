"""The one lock per model: held while hooks are attached to a model and it runs, and while
anything changes its weights, dtype or modules (``tests/test_model_lock_rule.py`` reads the
rule from the source)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["model_lock"]

_MODEL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> RLock
_MODEL_LOCKS_BY_ID: dict[int, Any] = {}  # models that take no weak reference
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> Any:
    """The one re-entrant lock of ``model``: held while hooks are attached to it and it runs,
    so analyses on one model from several threads run one forward pass at a time and never
    see each other's hooks (the same thread may nest).

    >>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
    >>> m = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))
    >>> model_lock(m) is model_lock(m)
    True
    """
    with _MODEL_LOCKS_GUARD:
        try:
            lock = _MODEL_LOCKS.get(model)
            if lock is None:
                lock = _MODEL_LOCKS[model] = threading.RLock()
        except TypeError:  # not weak-referenceable (or unhashable)
            lock = _MODEL_LOCKS_BY_ID.setdefault(id(model), threading.RLock())
        return lock
