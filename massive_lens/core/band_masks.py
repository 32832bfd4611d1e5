"""The sink rule's band as masks: which queries (real, within ``span`` after a key) count towards each
key's attention, blocked as :func:`~massive_lens.core.criterion.key_attention` reads an eager pattern
(:func:`key_blocks`) and as :meth:`~massive_lens.core.layer_attention.LayerAttention.band` reads the
kernel's scores (:func:`band_blocks`). They are the same at every layer of a pass, so the last few
asked are kept (:func:`kept`); what is kept is never written to.

>>> blocks, count = key_blocks(1, 4, torch.device("cpu"), None, span=2, block=4)
>>> count.tolist()
[[2.0, 2.0, 1.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

__all__ = ["band_blocks", "key_blocks", "kept"]

KEPT_PASSES = 4  # masks kept (two of each kind)
_KEPT: dict[Hashable, Any] = {}


def kept(key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``, kept under ``key`` with the last few others (cleared and set, each one step: safe beside
    another thread's call)."""
    got = _KEPT.get(key)
    if got is None:
        got = make()
        if len(_KEPT) >= KEPT_PASSES:
            _KEPT.clear()
        _KEPT[key] = got
    return got


def _valid_key(valid: Tensor | None) -> Hashable:
    return None if valid is None else (tuple(valid.shape), valid.cpu().numpy().tobytes())


def key_blocks(batch: int, n: int, device: torch.device, valid: Tensor | None, *, span: int, block: int
               ) -> tuple[list[tuple[int, int, int, Tensor]], Tensor]:
    """Blocks ``(k0, k1, q1, band [batch q k])`` of ``block`` keys (``band``: query ``q`` is real and within
    ``span`` after key ``k``) and each key's count of such queries ``[batch pos]``."""

    def make() -> tuple[list[tuple[int, int, int, Tensor]], Tensor]:
        queries = torch.ones(batch, n, device=device) if valid is None else valid.to(device, torch.float32)
        count = torch.empty(batch, n, device=device)
        blocks = []
        for k0 in range(0, n, block):
            k1 = min(k0 + block, n)
            q1 = min(k1 + span, n)
            q, k = torch.arange(k0, q1, device=device)[:, None], torch.arange(k0, k1, device=device)[None]
            band = ((q > k) & (q <= k + span)).to(torch.float32)[None] * queries[:, k0:q1, None]  # [batch q k]
            count[:, k0:k1] = band.sum(1)
            blocks.append((k0, k1, q1, band))
        return blocks, count

    return kept(("key", batch, n, str(device), _valid_key(valid), span, block), make)


def band_blocks(valid: Tensor, n: int, device: torch.device, *, span: int, block: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The band over blocks of ``block`` keys and the ``block + span`` queries after each block's first, as a
    float mask ``[batch 1 1 block query key]`` (real, within ``span`` after the key, in the text), each key's
    count of such queries ``[batch pos]``, and the mask's complement (bool)."""

    def make() -> tuple[Tensor, Tensor, Tensor]:
        b, nb = valid.shape[0], -(-n // block)
        qi = (torch.arange(nb, device=device)[:, None] * block + torch.arange(block + span, device=device))[:, :, None]
        ki = (torch.arange(nb, device=device)[:, None] * block + torch.arange(block, device=device))[:, None, :]
        real = torch.nn.functional.pad(valid.to(device, torch.float32), (0, nb * block + span - n))
        band = ((qi > ki) & (qi <= ki + span) & (qi < n)).float()[None] * real[:, qi[..., 0]][..., None]  # [b nb s k]
        count = band.sum(2).reshape(b, nb * block)[:, :n]
        band = band[:, None, None]
        return band, count, band == 0

    return kept(("band", n, str(device), _valid_key(valid), span, block), make)
