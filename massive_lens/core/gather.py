"""Hooks that gather one layer's activations from several hook points, in whatever order the
model fires them, and hand them over together as soon as the last one arrives (so nothing of
a layer is kept beyond it).

With :class:`~massive_lens.core.reduce.ResidualReducer` this is how an analysis keeps hook
state (``docs/architecture.md``): never a dict captured by a closure, always an accumulator
whose hooks reduce what they see (``reduce``) and hand it over (``ready``) or keep it
(``kept``, when there is no ``ready``).

>>> import torch
>>> seen = []
>>> gather = LayerGather(("pattern", "v"), lambda layer, pattern, v: seen.append((layer, pattern + v)))
>>> gather.hook("v", 3)(torch.tensor(1.0), None)
>>> gather.hook("pattern", 3)(torch.tensor(2.0), None)
>>> seen, gather.done, gather.pending
([(3, tensor(3.))], [3], [])
>>> for key in ("v", "pattern"):  # the next forward: handed over again, listed once
...     gather.hook(key, 3)(torch.tensor(1.0), None)
>>> len(seen), gather.done
(2, [3])
>>> norms = LayerGather(("resid",), reduce=lambda x: x.norm(dim=-1))  # no ready: kept by layer and key
>>> norms.hook("resid", 0)(torch.tensor([[3.0, 4.0]]), None)
>>> norms.kept[0]["resid"]
tensor([5.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


class LayerGather:
    """Hook functions (``.hook(key, layer)``) that keep each of ``keys`` for a layer until all
    have arrived, then call ``ready(layer, *activations)`` in the order of ``keys``; without
    ``ready`` the layer's activations stay in ``kept[layer]`` (a dict by key, replaced by the
    next pass). ``reduce`` (default: none) is applied to each activation as it arrives.

    ``done`` lists the layers handed over (each once, however many forwards: an intervention's
    reading is reused); ``pending`` the layers with some but not all of their activations (a
    hook that never fired), for the caller's error."""

    def __init__(self, keys: Sequence[str], ready: Callable[..., None] | None = None,
                 reduce: Callable[[Tensor], Any] | None = None):
        self.keys, self.ready, self.reduce = tuple(keys), ready, reduce
        self.held: dict[tuple[str, int], Any] = {}
        self.done: list[int] = []
        self.kept: dict[int, dict[str, Any]] = {}

    def hook(self, key: str, layer: int) -> Callable[[Tensor, Any], None]:
        if key not in self.keys:
            raise ValueError(f"{key!r} is not one of {self.keys}")

        def keep(act: Tensor, hook: Any) -> None:
            self.held[key, layer] = act if self.reduce is None else self.reduce(act)
            if all((k, layer) in self.held for k in self.keys):
                acts = [self.held.pop((k, layer)) for k in self.keys]
                if self.ready is None:
                    self.kept[layer] = dict(zip(self.keys, acts, strict=True))
                else:
                    self.ready(layer, *acts)
                if layer not in self.done:  # a gather reused over many forwards stays bounded
                    self.done.append(layer)

        return keep

    @property
    def pending(self) -> list[int]:
        return sorted({layer for _, layer in self.held})
