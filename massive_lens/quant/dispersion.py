"""Per-tensor dispersion and underflow: what makes one quantized tensor fragile.

For each quantized tensor, a weight (rows: output channels, columns: input channels) or a linear
layer's input (rows: tokens, columns: channels):

* **row dispersion**: the largest row absolute maximum over the median one;
* **column dispersion**: the same over columns (a column of outliers in a weight, an outlier
  channel in an activation);
* **underflow**: the share of the tensor's nonzero values that round to zero at the setting's
  scale (a weight on its own grid; an activation on the range calibrated on held-out text).

A large dispersion stretches a per-tensor range, and what it stretches it over underflows: a
tensor with both is where a per-tensor grid loses the model (an element-wise-gated checkpoint's
layer-0 MLP input had 28x row, 304x column dispersion and 99% underflow). Medians are the
midpoint median (numpy's), not torch's lower median.

>>> w = torch.tensor([[1.0, 0.01], [0.02, 0.03], [0.02, 0.01]])
>>> [round(v, 2) for v in dispersion(w)]  # rows: 1 over 0.03; columns: 1 over (1 + 0.03) / 2
[33.33, 1.94]
>>> round(underflow(w, fake_quant_weight(w, None, 4)), 3)  # 5 of 6 below half a step (1 / 14)
0.833
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from massive_lens.quant.fake import fake_quant_activation, fake_quant_weight

TINY = 1e-30  # a median of zero: the dispersion is infinite only if the maximum is not zero too


def _ratio(top: Tensor, median: Tensor) -> float:
    top, median = float(top), float(median)
    if median > TINY:
        return top / median
    return math.inf if top > TINY else math.nan


def dispersion(x: Tensor) -> tuple[float, float]:
    """``(row, column)`` dispersion of a 2-D tensor: max over median of the rows' (columns')
    absolute maxima (module docstring).

    Args:
        x: ``[rows, columns]``.

    Returns:
        ``(row dispersion, column dispersion)``.
    """
    a = x.detach().abs().float()
    rows, cols = a.amax(1), a.amax(0)
    return _ratio(rows.max(), rows.quantile(0.5)), _ratio(cols.max(), cols.quantile(0.5))


def underflow_counts(x: Tensor, q: Tensor) -> tuple[int, int]:
    """``(nonzero entries of x whose quantized value q is exactly zero, nonzero entries of x)``."""
    nonzero = x != 0
    return int((nonzero & (q == 0)).sum()), int(nonzero.sum())


def underflow(x: Tensor, q: Tensor) -> float:
    """The share of the nonzero entries of ``x`` whose quantized value ``q`` is exactly zero.

    Args:
        x: the tensor.
        q: ``x`` on the quantization grid (same shape).

    Returns:
        The share, in [0, 1] (NaN when ``x`` has no nonzero entry).
    """
    hit, n = underflow_counts(x, q)
    return hit / n if n else math.nan


def as_matrix(w: Tensor, in_dims: tuple[int, ...] | None) -> Tensor:
    """A weight as ``[outputs, inputs]``: its input axes last, flattened (a plain ``[out, in]``
    linear weight when ``in_dims`` is None)."""
    if in_dims is None:
        return w.reshape(w.shape[0], -1)
    out_dims = [d for d in range(w.ndim) if d not in in_dims]
    return w.permute(*out_dims, *in_dims).reshape(math.prod(w.shape[d] for d in out_dims), -1)


def tokens_by_channels(x: Tensor) -> Tensor:
    """An activation as ``[tokens, channels]`` (the first two axes are batch and position when
    there are three or more)."""
    return x.reshape(x.shape[0] * x.shape[1], -1) if x.ndim >= 3 else x.reshape(-1, x.shape[-1])


class Tally:
    """Dispersion and underflow of every site's weight and input, the inputs accumulated over
    the passes the hooks of :meth:`hooks` see.

    ``sites`` are ``(module, weight, input axes)`` (:func:`~massive_lens.quant.sites.linear_sites`),
    ``names`` and ``layers`` by ``id(weight)``, ``ranges`` the calibrated ``[low, high]`` of each
    site's input by index (:func:`~massive_lens.quant.fake.calibrated_ranges`; a site without one
    has no activation underflow), ``bits`` the width and ``per_channel`` the weight scales.
    """

    def __init__(self, sites: list[tuple[nn.Module, nn.Parameter, tuple[int, ...]]], names: dict[int, str],
                 layers: dict[int, int], ranges: dict[int, list[float]], *, bits: int = 8,
                 per_channel: bool = True) -> None:
        self.sites, self.names, self.layers, self.ranges = sites, names, layers, ranges
        self.bits, self.per_channel = bits, per_channel
        self._rows: dict[int, list[Tensor]] = {}
        self._cols: dict[int, Tensor] = {}
        self._under: dict[int, list[int]] = {}

    def hooks(self) -> list[tuple[nn.Module, Callable[..., None], Callable[..., None]]]:
        """``(module, pre, post)`` for :func:`~massive_lens.quant.fake.attached`: each reads its input."""
        return [(module, self._reader(i), lambda *a: None) for i, (module, _, _) in enumerate(self.sites)]

    def _reader(self, i: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = (args[0] if args else next(iter(kwargs.values()))).detach()
            m = tokens_by_channels(x).abs().float()
            self._rows.setdefault(i, []).append(m.amax(1).cpu())
            cols = m.amax(0).cpu()
            self._cols[i] = torch.maximum(self._cols[i], cols) if i in self._cols else cols
            if i in self.ranges:
                low, high = self.ranges[i]
                hit, n = underflow_counts(x, fake_quant_activation(x, low, high, self.bits))
                old = self._under.get(i, [0, 0])
                self._under[i] = [old[0] + hit, old[1] + n]

        return pre

    def frame(self) -> pd.DataFrame:
        """One row per (site, ``kind`` ``weight`` or ``activation``): ``tensor`` (the weight's
        name), ``layer`` (-1: outside the blocks), ``row_dispersion``, ``col_dispersion``,
        ``underflow``."""
        rows: list[dict[str, Any]] = []
        for i, (_, weight, in_dims) in enumerate(self.sites):
            key = id(weight)
            base = dict(tensor=self.names.get(key, f"site {i}"), layer=self.layers.get(key, -1))
            w = weight.detach()
            rd, cd = dispersion(as_matrix(w, in_dims))
            q = fake_quant_weight(w, in_dims if self.per_channel else None, self.bits)
            rows.append(dict(base, kind="weight", row_dispersion=rd, col_dispersion=cd, underflow=underflow(w, q)))
            if i in self._rows:
                maxima = torch.cat(self._rows[i])
                cols = self._cols[i]
                hit, n = self._under.get(i, [0, 0])
                rows.append(dict(base, kind="activation", row_dispersion=_ratio(maxima.max(), maxima.quantile(0.5)),
                                 col_dispersion=_ratio(cols.max(), cols.quantile(0.5)),
                                 underflow=hit / n if n else math.nan))
        return pd.DataFrame(rows, columns=["tensor", "layer", "kind", "row_dispersion", "col_dispersion",
                                           "underflow"])


def site_names(model: Any, blocks: Any) -> tuple[dict[int, str], dict[int, int]]:
    """The parameter names and block indices of ``model``'s parameters, by ``id``: the layer is
    the block the parameter belongs to (data, never parsed out of a name)."""
    hf = getattr(model, "original_model", model)
    found = list(hf.named_parameters()) if isinstance(hf, nn.Module) else []
    found += list(model.named_parameters()) if isinstance(model, nn.Module) else []
    names: dict[int, str] = {}
    for n, p in found:  # a bridge's wrappers add ``_original_component`` to the Hugging Face names
        names.setdefault(id(p), n.replace("._original_component", "").removesuffix(".weight"))
    layers = {id(p): i for i, block in enumerate(blocks or []) for p in block.parameters()}
    return names, layers
