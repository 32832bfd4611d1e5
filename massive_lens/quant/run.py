"""One low-bit grid's evaluation: the model, its evaluation and calibration sequences, the
full-precision pass, and each setting's quantized passes (the engine of
:func:`~massive_lens.quant.quantize_grid` and of the analyses built on it).

:meth:`Run.evaluate` runs one setting; ``exempt`` leaves some of its sites in full precision (the
fewest-modules search), ``site_errors`` measures each site's own relative output error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.sinks import sinks_of
from massive_lens.core.budget import trim_allocator
from massive_lens.core.criterion import Criterion, massive_mask
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.quant.plan import NO_ROTATION, sites_for
from massive_lens.quant.result import DESTROYED, GROUPS
from massive_lens.quant.rotation import Rotation
from massive_lens.quant.settings import Setting
from massive_lens.quant.simulate import STATIC, Bits, Simulator
from massive_lens.quant.sites import Site

EXACT = {torch.float32: 1e-5, torch.float64: 1e-9}  # relative logit error a rotation may add; else 2e-3


class Run:
    """One model, its evaluation and calibration sequences, and the full-precision pass."""

    def __init__(self, view: ModelView, tokens: Tensor, calib: Tensor, criterion: Criterion,
                 include_head: bool, seed: int) -> None:
        self.view, self.model, self.tokens, self.calib = view, view.model, tokens, calib
        self.include_head, self.seed = include_head, seed
        self.loss = NextTokenLoss(self.model, self.forward)
        self.loss.check(tokens)
        losses, flags, sinks = [], [], []
        for chunk in self.batches(tokens):
            hit = torch.zeros(chunk.shape, dtype=torch.bool)

            def resid(x: Tensor, hook: Any, hit: Tensor = hit) -> None:
                hit.logical_or_(massive_mask(x, criterion).any(-1).cpu())

            hooks = [(view.hook_name(layer, "resid_post"), resid) for layer in range(view.n_layers)]
            losses.append(self.loss(chunk, hooks=hooks).loss)
            flags.append(hit)
            sinks.append(sinks_of(view, view.tokenize(chunk)).mask.cpu())
        self.fp = torch.cat(losses)
        self.massive, self.sinks = torch.cat(flags), torch.cat(sinks)
        self._calib_sinks: Tensor | None = None
        self._sites: dict[bool, list[Site]] = {}
        self.exactness: dict[str, float] = {}

    def batches(self, tokens: Tensor) -> list[Tensor]:
        """``tokens`` in the loss's passes (:meth:`~massive_lens.core.loss.NextTokenLoss.batches`):
        every pass rotates and quantizes every weight again, so fewer, larger passes are faster."""
        return self.loss.batches(tokens)

    def calib_sinks(self) -> Tensor:
        if self._calib_sinks is None:
            self._calib_sinks = torch.cat([sinks_of(self.view, self.view.tokenize(c)).mask.cpu()
                                           for c in self.batches(self.calib)])
        return self._calib_sinks

    def prefix(self) -> Tensor:
        """The first calibration sequence's sink tokens, in order (the first token always among them)."""
        mask = self.calib_sinks()[0].clone()
        mask[0] = True
        return self.calib[0][mask]

    def sites(self, rotation: bool, kv: bool) -> list[Site]:
        return sites_for(self.view, self.include_head, rotation, kv, self._sites)

    def inputs(self, tokens: Tensor, sinks: Tensor | None, keep: str | None
               ) -> Iterator[tuple[Tensor, Tensor | None, int, Tensor, int]]:
        """(model input, full-precision positions, where the sequence's logits start, the sequence,
        the prefix length)."""
        offset = 0
        prefix = self.prefix() if keep == "prefix" else None
        # the prefix's first token replaces the sequence's when every sequence starts with it (BOS)
        drop = int(prefix is not None and bool((tokens[:, 0] == prefix[0]).all()))
        for chunk in self.batches(tokens):
            rows = slice(offset, offset + len(chunk))
            offset += len(chunk)
            if prefix is None:
                yield chunk, (sinks[rows] if keep == "kvsink" else None), 0, chunk, 0
                continue
            x = torch.cat([prefix.expand(len(chunk), -1), chunk[:, drop:]], 1)
            mask = torch.zeros(x.shape, dtype=torch.bool)
            mask[:, : len(prefix)] = True
            yield x, mask, len(prefix) - drop, chunk, len(prefix)

    def forward(self, x: Tensor, hooks: Sequence[tuple[str, Any]] = ()) -> Any:
        """The model on tokens ``x`` (with ``hooks``: the full-precision pass, checked for overflow)."""
        trim_allocator()
        return self.view.forward(self.view.tokenize(x), list(hooks), check_finite=bool(hooks))

    def rotations(self, kind: str, sites: list[Site]) -> tuple[Rotation, dict[int, Rotation]]:
        residual = Rotation(kind, int(self.view.cfg.d_model), seed=self.seed)
        widths = {s.module.in_features for s in sites if s.role == "down"}
        online = {w: Rotation("hadamard", w, seed=self.seed + 1) for w in sorted(widths)}
        if kind not in self.exactness:  # the rotated model, unquantized, must be the model
            sim = Simulator(sites, Bits(None, None, None), residual, online)
            err = self._rotation_error(sim)
            dtype = next(self.model.parameters()).dtype
            if not err <= 10 * EXACT.get(dtype, 2e-3):
                raise MassiveLensError(
                    f"{self.view.name}: the {kind}-rotated model differs from the model by {err:.1e} (relative, in "
                    "the logits) before any quantization; its blocks are not pre-norm residual blocks that a "
                    f"rotation can be fused into; {NO_ROTATION}")
            self.exactness[kind] = err
        return residual, online

    def _rotation_error(self, sim: Simulator) -> float:
        """The largest logit difference of the rotated, unquantized model from the model on the
        first sequence, relative to the largest logit; slice by slice at the head when the loss is
        (the rotated head on the rotated stream, the head on the stream), else on the full logits."""
        x = self.tokens[:1]
        with model_lock(self.model):
            if not self.loss.exact:
                first = self.forward(x).float()
                with sim.attached():
                    return float((self.forward(x).float() - first).abs().max() / first.abs().max().clamp(min=1e-12))
            plain = self.loss.hidden(x)[0]
            with sim.attached():
                rotated = self.loss.hidden(x)[0]
            diff, top = 0.0, 0.0
            for a in range(0, len(plain), self.loss.step):
                b = min(a + self.loss.step, len(plain))
                with sim.attached():
                    mine = self.loss.logits(rotated, a, b).float()
                want = self.loss.logits(plain, a, b).float()
                diff, top = max(diff, float((mine - want).abs().max())), max(top, float(want.abs().max()))
        return diff / max(top, 1e-12)

    def evaluate(self, setting: Setting, bits: Bits, *, exempt: frozenset[int] = frozenset(),
                 site_errors: bool = False) -> tuple[dict[str, Any], pd.DataFrame, Tensor, Simulator]:
        """One setting: its row, its per-token error table, its per-sequence losses and the
        simulator (its ``site_errors`` by site index when asked). ``exempt``: indices into
        :meth:`sites` left in full precision (not with a rotation, whose fusion needs every site)."""
        sites = self.sites(setting.rotation is not None, bits.kv is not None)
        if exempt and setting.rotation:
            raise MassiveLensError(f"{setting.name}: modules cannot be exempted from a rotated setting (the rotation "
                                   "is fused into every layer); exempt modules of a setting without a rotation")
        residual, online = self.rotations(setting.rotation, sites) if setting.rotation else (None, None)
        sim = Simulator(sites, bits, residual, online)
        sim.exempt = frozenset(exempt)
        sim.site_errors = {} if site_errors else None
        keep = setting.keep_sinks
        losses, starts = [], []
        with model_lock(self.model), sim.attached():
            if bits.granularity in STATIC and (bits.activations or bits.kv):
                sim.mode = "calibrate"
                for x, mask, *_ in self.inputs(self.calib, self.calib_sinks() if keep else None, keep):
                    sim.keep = mask
                    if self.loss.exact and not self.include_head:  # the head is not quantized: stop before it
                        self.loss.hidden(x)
                    else:
                        self.forward(x)
            sim.mode = "run"
            for x, mask, start, chunk, skip in self.inputs(self.tokens, self.sinks, keep):
                sim.keep = mask
                losses.append(self.loss(x, chunk, start).loss)
                starts.append(skip)
                sim.end_pass()
        per_seq = torch.cat(losses).double()
        per_seq = per_seq.nan_to_num(nan=math.inf)
        return self._row(setting, bits, per_seq, sim), self._token_rows(setting, sim, starts), per_seq, sim

    def _token_rows(self, setting: Setting, sim: Simulator, starts: list[int]) -> pd.DataFrame:
        if not sim.seen.errors:
            return pd.DataFrame(columns=["setting", "seq", "pos", "group", "error"])
        err = torch.cat([e[:, s:] for e, s in zip(sim.seen.errors, starts, strict=True)])
        pos = torch.arange(self.tokens.shape[1])[-err.shape[1]:]  # a prefix's first token may replace BOS
        group = torch.full(self.tokens.shape, 2)
        group[self.massive] = 1
        group[self.sinks] = 0
        group = group[:, pos]
        seq = torch.arange(len(err))[:, None].expand_as(err)
        return pd.DataFrame({"setting": setting.name, "seq": seq.flatten().numpy(),
                             "pos": pos.expand_as(err).flatten().numpy(),
                             "group": [GROUPS[g] for g in group.flatten().tolist()],
                             "error": err.flatten().double().numpy()})

    def _row(self, setting: Setting, bits: Bits, per_seq: Tensor, sim: Simulator) -> dict[str, Any]:
        diff = per_seq - self.fp.double()
        gap = float(diff.mean())
        low, high = bootstrap_mean(diff) if math.isfinite(gap) else (gap, gap)
        seen = sim.seen
        # no residual reader seen (a model without structured sites): the quantizer's view was not
        # measured, so NaN ("not measured"), never the accumulators' starting values
        measured = seen.rows > 0
        full = 16
        ratio = math.exp(min(gap, 700.0))
        return dict(setting=setting.name, weights=bits.weights or full, activations=bits.activations or full,
                    kv=bits.kv or full, granularity=bits.granularity, symmetric=bits.symmetric,
                    weight_granularity=bits.weight_granularity if bits.weights else "none",
                    activation_granularity=bits.granularity if bits.activations else "none",
                    rotation=setting.rotation or "none", keep_sinks=setting.keep_sinks or "none",
                    loss=float(per_seq.mean()), gap=gap, gap_low=low, gap_high=high,
                    perplexity=math.exp(min(float(per_seq.mean()), 700.0)), ppl_ratio=ratio,
                    destroyed=not ratio <= DESTROYED,
                    max_abs=seen.max_abs if measured else math.nan,
                    kurtosis=seen.kurtosis_sum / seen.rows if measured else math.nan,
                    top1_median=seen.top1_median if measured else math.nan,
                    rotation_error=self.exactness[setting.rotation] if setting.rotation else 0.0,  # none: the model
                    n_seqs=len(per_seq))


