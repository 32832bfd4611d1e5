"""Hooks that gather one layer's activations from several hook points, in whatever order the
model fires them, and hand them over together as soon as the last one arrives (so nothing of
a layer is kept beyond it).

>>> import torch
>>> seen = []
>>> gather = LayerGather(("pattern", "v"), lambda layer, pattern, v: seen.append((layer, pattern + v)))
>>> gather.hook("v", 3)(torch.tensor(1.0), None)
>>> gather.hook("pattern", 3)(torch.tensor(2.0), None)
>>> seen, gather.done, gather.pending
([(3, tensor(3.))], [3], [])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


class LayerGather:
    """Hook functions (``.hook(key, layer)``) that keep each of ``keys`` for a layer until all
    have arrived, then call ``ready(layer, *activations)`` in the order of ``keys``.

    ``done`` lists the layers handed over; ``pending`` the layers with some but not all of
    their activations (a hook that never fired), for the caller's error."""

    def __init__(self, keys: Sequence[str], ready: Callable[..., None]):
        self.keys, self.ready = tuple(keys), ready
        self.held: dict[tuple[str, int], Tensor] = {}
        self.done: list[int] = []

    def hook(self, key: str, layer: int) -> Callable[[Tensor, Any], None]:
        if key not in self.keys:
            raise ValueError(f"{key!r} is not one of {self.keys}")

        def keep(act: Tensor, hook: Any) -> None:
            self.held[key, layer] = act
            if all((k, layer) in self.held for k in self.keys):
                self.ready(layer, *(self.held.pop((k, layer)) for k in self.keys))
                self.done.append(layer)

        return keep

    @property
    def pending(self) -> list[int]:
        return sorted({layer for _, layer in self.held})

