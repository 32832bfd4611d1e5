"""The fused, rotated, fake-quantized model, simulated one linear layer at a time.

No weight of the user's model is rewritten for longer than its own layer runs: hooks on each
linear layer rotate its input (``u Q``, or ``x H`` before the down-projection), quantize it,
swap in its rotated and quantized weight (``W diag(g) Q``, ``Q^T W`` or ``Q^T W H``) for the
length of its forward, rotate a writer's output back into the stream's own basis and quantize
the key and value projections' outputs (the KV cache). The residual stream itself stays in the
original basis, which changes nothing: an RMSNorm without its gain commutes with ``Q``, and a
sum of rotated writes is the rotated sum. Kept positions (the sinks, or a prefix) are computed
in full precision throughout: their inputs, their outputs and their keys and values.

Keys are quantized as ``k_proj`` writes them, before RoPE (as KVQuant does); values as
``v_proj`` writes them. Per-head Hadamard rotations of values and keys (QuaRot's online
attention rotations) are not applied.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.budget import trim_allocator
from massive_lens.core.stats import kurtosis, top1_median
from massive_lens.quant.fake import attached, fake_quant, rtn
from massive_lens.quant.rotation import Rotation
from massive_lens.quant.sites import Site

STATIC = ("tensor", "channel")  # activation granularities with calibrated ranges


# a weight above this many entries is rotated and quantized in row blocks of about this size
WEIGHT_BLOCK = 2**22


@dataclass
class Bits:
    """What one simulation quantizes: widths (None: full precision) and how."""

    weights: int | None
    activations: int | None
    kv: int | None
    granularity: str = "token"
    symmetric: bool = True
    group_size: int = 128

    @property
    def weight_granularity(self) -> str:
        """The weights' scales: one per tensor (``tensor``), per group (``group``), else per output channel."""
        return {"tensor": "tensor", "group": "group"}.get(self.granularity, "channel")


@dataclass
class Seen:
    """What the activation quantizer saw at the residual readers (kept positions left out): the
    largest ``|x|``, the kurtosis of each token's input summed over tokens, the largest
    top-1/median of one sequence's input (:mod:`massive_lens.core.stats`), and the per-token
    relative quantization error there, summed over readers."""

    max_abs: float = 0.0
    kurtosis_sum: float = 0.0
    rows: int = 0
    top1_median: float = 0.0
    errors: list[Tensor] = field(default_factory=list)  # one [batch, pos] per forward pass

    def add(self, x: Tensor, keep: Tensor | None) -> None:
        x = x.detach().float()
        x = x if x.ndim == 3 else x.reshape(1, -1, x.shape[-1])  # [batch, pos, d]; else one sequence of rows
        valid = None if keep is None else ~keep.to(x.device)
        rows = x.flatten(0, -2) if valid is None else x[valid]
        if not len(rows):
            return
        self.max_abs = max(self.max_abs, float(rows.abs().max()))
        self.kurtosis_sum += float(kurtosis(rows).sum())
        self.rows += len(rows)
        ratio = top1_median(x.abs(), valid)[2]
        ratio = ratio[~ratio.isnan()]
        if len(ratio):
            self.top1_median = max(self.top1_median, float(ratio.max()))


class Simulator:
    """Hooks that make ``sites`` compute as the rotated, quantized model (module docstring).

    ``mode`` is ``"calibrate"`` (record activation and KV ranges, compute in full precision) or
    ``"run"``; ``keep`` is the ``[batch, pos]`` mask of full-precision positions of the next pass;
    ``exempt`` the indices of sites left in full precision (no hooks); ``site_errors``, when a dict,
    collects each site's own output error in run mode: ``{index: [sum over tokens of
    |out - fp out| / |fp out|, tokens]}``, ``fp out`` the layer on the same input with its own weight
    and input unquantized (per token, so a massive token's large output does not hide the others').
    """

    def __init__(self, sites: list[Site], bits: Bits, residual: Rotation | None = None,
                 online: dict[int, Rotation] | None = None) -> None:
        self.sites, self.bits, self.residual, self.online = sites, bits, residual, online
        self.mode = "run"
        self.keep: Tensor | None = None
        self.ranges: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        self.seen = Seen()
        self._err: Tensor | None = None
        self._n_err = 0
        self.exempt: frozenset[int] = frozenset()
        self.site_errors: dict[int, list[float]] | None = None  # index: [sum of relative errors, tokens]

    # ------------------------------------------------------------------ transforms
    def _input(self, site: Site, x: Tensor) -> Tensor:
        if self.residual is not None and site.role in ("reader", "head"):
            return self.residual.apply(x / site.gain.to(x.device, x.dtype))
        if self.online and site.role == "down":
            return self.online[x.shape[-1]].apply(x)
        return x

    def _weight(self, site: Site, w: Tensor) -> Tensor:
        """The rotated and quantized weight; a large reader (the output head) row block by row
        block (its rows are rotated and quantized independently), so the temporaries stay small."""
        rows_independent = site.role in ("reader", "head") and self.bits.granularity != "tensor"
        if rows_independent and w.numel() > WEIGHT_BLOCK and w.shape[0] > 1:
            step = max(1, WEIGHT_BLOCK // w.shape[1])
            out = torch.empty_like(w)
            for start in range(0, w.shape[0], step):
                out[start:start + step] = self._weight_rows(site, w[start:start + step])
            return out
        return self._weight_rows(site, w)

    def _weight_rows(self, site: Site, w: Tensor) -> Tensor:
        if self.residual is not None:
            if site.role in ("reader", "head"):
                w = self.residual.apply(w * site.gain.to(w.device, w.dtype))
            elif site.role in ("writer", "down"):
                if site.role == "down" and self.online:
                    w = self.online[w.shape[-1]].apply(w)
                w = self.residual.apply(w.T).T
        if self.bits.weights is not None:
            b = self.bits
            w = fake_quant(w, b.weights, b.weight_granularity, symmetric=b.symmetric, group_size=b.group_size)
        return w

    def _quant(self, x: Tensor, bits: int, key: tuple[int, str]) -> Tensor:
        b = self.bits
        if b.granularity in STATIC:
            low, high = self.ranges[key]
            return rtn(x, bits, low.to(x.device, x.dtype), high.to(x.device, x.dtype), symmetric=b.symmetric)
        return fake_quant(x, bits, b.granularity, symmetric=b.symmetric, group_size=b.group_size)

    def _observe(self, x: Tensor, key: tuple[int, str]) -> None:
        rows = (x[~self._keep(x)] if self._keep(x) is not None else x.flatten(0, -2)).detach().float()
        if not len(rows):
            return
        low, high = (rows.amin(0), rows.amax(0)) if self.bits.granularity == "channel" else (rows.min(), rows.max())
        if key in self.ranges:
            low, high = torch.minimum(self.ranges[key][0], low), torch.maximum(self.ranges[key][1], high)
        self.ranges[key] = (low, high)

    def _keep(self, x: Tensor) -> Tensor | None:
        keep = self.keep
        if keep is None or x.ndim < 3 or tuple(x.shape[:2]) != tuple(keep.shape):
            return None
        return keep.to(x.device)

    # ------------------------------------------------------------------ hooks
    def _hooks(self, i: int, site: Site) -> tuple[Any, Any]:
        saved: list[Any] = []

        def pre(module: Any, args: tuple, kwargs: dict) -> Any:
            key = next(iter(kwargs)) if not args else None
            x = args[0] if args else kwargs[key]
            keep = self._keep(x)
            x_in = self._input(site, x)
            if self.mode == "calibrate":
                if self.bits.activations is not None:
                    self._observe(x_in, (i, "in"))
                return None
            if site.role in ("reader", "head"):
                self.seen.add(x_in, keep)
            xq = x_in
            if self.bits.activations is not None:
                xq = self._quant(x_in, self.bits.activations, (i, "in"))
                if keep is not None:
                    xq = torch.where(keep[..., None], x_in, xq)
                if site.role == "reader":
                    self._add_error((xq - x_in).float().norm(dim=-1) / x_in.float().norm(dim=-1).clamp(min=1e-12))
            saved.append((site.weight.data, x))
            site.weight.data = self._weight(site, site.weight.data)
            return ((xq, *args[1:]), kwargs) if args else (args, {**kwargs, key: xq})

        def post(module: Any, args: tuple, out: Tensor) -> Any:
            if site.role in ("down", "plain"):  # once a layer: freed temporaries leave the process
                trim_allocator()
            if self.mode == "calibrate":
                if site.kv is not None and self.bits.kv is not None:
                    self._observe(out, (i, "kv"))
                return None
            weight, x = saved.pop()
            site.weight.data = weight
            bias = getattr(module, "bias", None)
            if self.residual is not None and site.role in ("writer", "down"):
                out = out if bias is None else out - bias
                out = self.residual.apply_t(out)
                out = out if bias is None else out + bias
            keep = self._keep(out)
            if keep is not None:
                out = out.clone()
                out[keep] = torch.nn.functional.linear(x[keep], weight, bias)
            if site.kv is not None and self.bits.kv is not None:
                q = self._quant(out, self.bits.kv, (i, "kv"))
                out = q if keep is None else torch.where(keep[..., None], out, q)
            if self.site_errors is not None and isinstance(module, torch.nn.Linear):
                fp = torch.nn.functional.linear(x, weight, bias).float().flatten(0, -2)
                d, f = (out.float().flatten(0, -2) - fp).norm(dim=-1), fp.norm(dim=-1)
                rel = torch.where(f > 0, d / f.clamp(min=1e-30), torch.where(d > 0, torch.inf, 0.0))
                old = self.site_errors.get(i, [0.0, 0])
                self.site_errors[i] = [old[0] + float(rel.sum()), old[1] + len(rel)]
            return out

        return pre, post

    def _add_error(self, err: Tensor) -> None:
        err = err.detach().cpu()
        self._err = err if self._err is None else self._err + err
        self._n_err += 1

    def end_pass(self) -> None:
        """Close one forward pass: its per-token error (mean over the residual readers) is kept."""
        if self._err is not None:
            self.seen.errors.append(self._err / self._n_err)
        self._err, self._n_err = None, 0

    def attached(self) -> contextlib.AbstractContextManager[None]:
        """The hooks on every site for the block; hooks removed and weights put back on every exit
        (:func:`~massive_lens.quant.fake.attached`)."""
        return attached([(site.module, *self._hooks(i, site)) for i, site in enumerate(self.sites)
                         if i not in self.exempt], [site.weight for site in self.sites])
