"""Reducers that run inside forward hooks, so no analysis keeps a full activation cache.

A hook on ``blocks.{l}.hook_resid_post`` sees ``[batch, pos, d_model]``; :class:`ResidualReducer`
keeps only what the analyses need from it (the top-k magnitudes, the median, the massive
entries, per-kind hit flags) the moment it fires. :class:`ProfileSums` accumulates per-layer
statistics over batches, so a corpus scan's memory does not grow with the corpus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core import sparse_bool
from massive_lens.core.criterion import Criterion, median_scale
from massive_lens.core.outliers import SCOPES, OutlierTally
from massive_lens.core.tokens import TOKEN_KINDS, Batch


class ResidualReducer:
    """Hook functions that reduce each residual activation as soon as it is computed."""

    def __init__(self, batch: Batch, criterion: Criterion, k: int = 1, entries: bool = False,
                 kinds: Tensor | None = None, on_layer: Callable[[int, Tensor, Tensor], None] | None = None):
        self.batch, self.criterion, self.k = batch, criterion, k
        self.on_layer = on_layer  # called with (layer, |resid|, its median scale) once the layer is reduced
        self.want_entries = entries
        self.kinds = kinds  # [batch pos] token kind ids, for per-kind counts
        self.top: dict[int, Tensor] = {}  # layer -> [batch k]
        self.median: dict[int, Tensor] = {}  # layer -> [batch]
        self.entries: list[tuple[int, Tensor, Tensor, Tensor]] = []  # layer, [n 3] idx, values, ratios
        self.kind_hits: dict[int, Tensor] = {}  # layer -> [batch kinds+1 d_model] bool, every massive entry
        self.outlier: dict[int, Tensor] = {}  # layer -> [batch d_model] bool: an outlier dimension there
        self.tally = OutlierTally()  # the pass is one run: which entries are outlier-dimension entries
        self.share: dict[int, Tensor] = {}  # layer -> [batch d_model]: share of real tokens where the dim is massive
        self.peak = 0.0
        self.all_real = bool(batch.mask.all())  # no pads: no masking needed

    def hook(self, layer: int):
        def reduce(resid: Float[Tensor, "batch pos d_model"], hook: Any) -> None:
            self._reduce(layer, resid.detach())

        return reduce

    def _reduce(self, layer: int, resid: Float[Tensor, "batch pos d_model"]) -> None:
        valid = self.batch.mask.to(resid.device)
        padded = not self.all_real
        mag = resid.abs().float()
        if padded:
            mag = mag.masked_fill(~valid[..., None], 0.0)
        scale, median = median_scale(mag, self.criterion, valid if padded else None)
        flat = mag.flatten(1)
        top = flat.amax(1, keepdim=True) if self.k == 1 else flat.topk(min(self.k, flat.shape[1]), dim=1).values
        self.top[layer] = top.cpu()
        self.median[layer] = median.cpu()
        self.peak = max(self.peak, float(self.top[layer][:, 0].max()))
        massive = self.criterion.passes(mag, scale)
        if padded:
            massive &= valid[..., None]
        count, n_tokens = sparse_bool.count(massive, 1), valid.sum(1)
        self.outlier[layer] = self.tally.add(layer, massive, valid if padded else None, mag,  # mag: channels too
                                             count).cpu()
        self.share[layer] = (count / n_tokens.clamp(min=1)[:, None]).float().cpu()
        if self.want_entries:
            idx = sparse_bool.nonzero(massive)
            if len(idx):
                b, p, d = idx.unbind(1)
                ratio = mag[b, p, d] / scale.expand_as(mag)[b, p, d]
                self.entries.append((layer, idx.cpu(), resid[b, p, d].float().cpu(), ratio.cpu()))
        if self.kinds is not None:  # outlier dimensions are left out once the run is over (token_kind_hits)
            self.kind_hits[layer] = kind_hits(massive, self.kinds.to(resid.device)).cpu()
        if self.on_layer is not None:
            self.on_layer(layer, mag, scale)

    def first_nonfinite(self) -> int | None:
        """The first layer whose residual holds NaN or inf at a real position (the largest
        ``|x|`` of a layer is NaN or inf exactly then), or None: a free overflow check for a
        pass run without :meth:`ModelView.forward`'s per-hook one."""
        bad = [layer for layer, top in sorted(self.top.items()) if not bool(torch.isfinite(top).all())]
        return bad[0] if bad else None

    def scoped_entries(self) -> list[tuple[int, Tensor, Tensor, Tensor, list[str]]]:
        """The massive entries per layer, each with its scope (:class:`OutlierTally`, the pass
        being the run): ``(layer, idx [n 3], values, ratios, scopes)``; without the
        outlier-dimension entries when the criterion excludes them."""
        out = []
        for layer, idx, values, ratios in self.entries:
            flags = self.tally.at(layer)[idx[:, 2]]
            if self.criterion.outliers == "exclude":
                idx, values, ratios, flags = idx[~flags], values[~flags], ratios[~flags], flags[~flags]
            out.append((layer, idx, values, ratios, [SCOPES[int(f)] for f in flags.tolist()]))
        return out

    def token_kind_hits(self, layer: int) -> Tensor:
        """``kind_hits[layer]`` with the outlier-dimension entries of the run left out."""
        return self.kind_hits[layer] & ~self.tally.at(layer)[None, None, :]

    def found(self, scope: str | None = None) -> set[tuple[int, int, int]]:
        """Every massive (seq, pos, dim), over all layers; with ``scope="token"`` only those
        massive at some layer where their entry is token-specific, with ``"outlier_dim"`` only
        those that are never token-specific."""
        out: set[tuple[int, int, int]] = set()
        token: set[tuple[int, int, int]] = set()
        for _, idx, _, _, scopes in self.scoped_entries():
            rows = list(map(tuple, idx.tolist()))
            out.update(rows)
            token.update(r for r, s in zip(rows, scopes, strict=True) if s == "token")
        return {"token": token, "outlier_dim": out - token}.get(scope, out) if scope else out


def kind_hits(massive: Bool[Tensor, "batch pos d_model"], kinds: Int[Tensor, "batch pos"]) -> Tensor:
    """[batch, kinds + first delimiter, d_model]: is the dim massive at a token of that kind?"""
    hits = [(massive & (kinds == c)[..., None]).any(1) for c in range(len(TOKEN_KINDS))]
    is_delim = kinds == TOKEN_KINDS.index("delimiter")
    first = is_delim.float().argmax(1)  # first delimiter position (0 when there is none)
    at_first = massive[torch.arange(len(kinds), device=kinds.device), first] & is_delim.any(1)[:, None]
    return torch.stack(hits + [at_first], 1)


class ProfileSums:
    """Per-layer sums of top-1..k, the median and top-1/median over sequences (float64)."""

    def __init__(self, layers: list[int], k: int):
        self.layers, self.k = layers, k
        self.sum = torch.zeros(len(layers), k + 2, dtype=torch.float64)
        self.sq = torch.zeros(len(layers), k + 2, dtype=torch.float64)
        self.n = 0

    def add(self, reducer: ResidualReducer) -> None:
        for i, layer in enumerate(self.layers):
            top, med = reducer.top[layer].double(), reducer.median[layer].double()
            stats = torch.cat([top, med[:, None], (top[:, 0] / med)[:, None]], 1)
            self.sum[i] += stats.sum(0)
            self.sq[i] += (stats**2).sum(0)
        self.n += len(reducer.batch.tokens)

    def frame(self) -> pd.DataFrame:
        """``layer``, then ``<stat>_mean`` and ``<stat>_std`` for top1..topk, median, ratio."""
        mean = self.sum / self.n
        std = (self.sq / self.n - mean**2).clamp_min(0).sqrt()
        names = [f"top{i + 1}" for i in range(self.k)] + ["median", "ratio"]
        data: dict[str, Any] = {"layer": self.layers}
        for j, name in enumerate(names):
            data[f"{name}_mean"] = mean[:, j].numpy()
            data[f"{name}_std"] = std[:, j].numpy()
        return pd.DataFrame(data)
