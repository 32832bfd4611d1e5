"""What massive activations cost in low bits: W4A4, KV-cache quantization, rotations, kept sinks.

:func:`quantize` evaluates one round-to-nearest setting, :func:`quantize_grid` several, on the
same sequences, against the same full-precision pass:

* **bits**: weights, activations (every linear layer's input) and the KV cache (the key and
  value projections' outputs), 8 or 4 (any width 2-16; 16 is full precision);
* **granularity** (``granularity=``, or ``@...`` in a setting's name):

  ============  ======================  ==========================================
  granularity   weights                 activations and KV cache
  ============  ======================  ==========================================
  ``tensor``    one scale per tensor    static per tensor, calibrated on held-out text
  ``channel``   per output channel      static per input channel, calibrated
  ``token``     per output channel      dynamic per token
  ``group``     groups of 128 inputs    dynamic per token, groups of 128
  ============  ======================  ==========================================

  symmetric (default) or asymmetric (``symmetric=False``); no GPTQ, no smoothing, no clipping search;
* **rotation** of the residual stream, QuaRot's fusion simulated layer by layer
  (:mod:`massive_lens.quant.simulate`): ``"orthogonal"`` or ``"hadamard"`` (randomized), with an
  online Hadamard before the down-projection; checked to reproduce the model before quantization;
* **keep_sinks**: ``"kvsink"`` keeps the sinks (:func:`~massive_lens.attention.find_sinks`, the
  package's one sink rule) in full precision: their activations, outputs, keys and values, and
  leaves them out of the calibrated ranges (KVSink); ``"prefix"`` prepends the calibration
  text's sink tokens to every sequence as a full-precision prefix (PrefixQuant).

The readings (:class:`~massive_lens.quant.result.Quantization`): the loss gap with a bootstrap
interval over sequences, the per-token activation error at sink, massive and other tokens
(DFRot's comparison), and the largest activation, kurtosis and top-1/median the quantizer sees.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.sinks import sinks_of
from massive_lens.core.budget import trim_allocator
from massive_lens.core.corpora import Corpus
from massive_lens.core.criterion import Criterion, as_criterion, massive_mask
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView, model_lock
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.quant.outliers import eval_and_calibration
from massive_lens.quant.plan import NO_ROTATION, none_runs, runnable, sites_for, without_rotation
from massive_lens.quant.result import GROUPS, Quantization
from massive_lens.quant.rotation import Rotation
from massive_lens.quant.settings import GRANULARITIES, GRID, Setting, parse_settings
from massive_lens.quant.simulate import STATIC, Bits, Simulator
from massive_lens.quant.sites import Site

log = logging.getLogger(__name__)
EXACT = {torch.float32: 1e-5, torch.float64: 1e-9}  # relative logit error a rotation may add; else 2e-3


class _Run:
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

    def evaluate(self, setting: Setting, bits: Bits) -> tuple[dict[str, Any], pd.DataFrame]:
        sites = self.sites(setting.rotation is not None, bits.kv is not None)
        residual, online = self.rotations(setting.rotation, sites) if setting.rotation else (None, None)
        sim = Simulator(sites, bits, residual, online)
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
        return self._row(setting, bits, per_seq, sim), self._token_rows(setting, sim, starts)

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
        return dict(setting=setting.name, weights=bits.weights or full, activations=bits.activations or full,
                    kv=bits.kv or full, granularity=bits.granularity, symmetric=bits.symmetric,
                    rotation=setting.rotation or "none", keep_sinks=setting.keep_sinks or "none",
                    loss=float(per_seq.mean()), gap=gap, gap_low=low, gap_high=high,
                    perplexity=math.exp(min(float(per_seq.mean()), 700.0)), ppl_ratio=math.exp(min(gap, 700.0)),
                    max_abs=seen.max_abs if measured else math.nan,
                    kurtosis=seen.kurtosis_sum / seen.rows if measured else math.nan,
                    top1_median=seen.top1_median if measured else math.nan,
                    rotation_error=self.exactness[setting.rotation] if setting.rotation else 0.0,  # none: the model
                    n_seqs=len(per_seq))


def _bits(setting: Setting, granularity: str, symmetric: bool, group_size: int) -> Bits:
    def width(b: int) -> int | None:
        return None if b >= 16 else b

    return Bits(width(setting.weights), width(setting.activations), width(setting.kv),
                setting.granularity or granularity, symmetric, group_size)


def quantize_grid(
    model: Any,
    corpus: Corpus = None,
    *,
    settings: Sequence[str | Setting] = GRID,
    granularity: str = "token",
    symmetric: bool = True,
    group_size: int = 128,
    seq_len: int = 128,
    n_seqs: int = 8,
    calibration: Any = None,
    include_head: bool = False,
    seed: int = 0,
    criterion: Criterion | None = None,
) -> Quantization:
    """Several low-bit settings on the same sequences (see the module docstring for what they mean).

    Args:
        model: a TransformerBridge (any setting) or another TransformerLens-style model (no
            rotation, no KV cache: every ``nn.Linear`` is quantized).
        corpus: evaluation text, split as in :func:`~massive_lens.quant.measure_outliers`: the first
            ``n_seqs`` sequences evaluated, the next ``n_seqs`` calibrate static ranges and the prefix.
        settings: names (:class:`~massive_lens.quant.settings.Setting`, e.g. ``"W4A4KV4@tensor+hadamard+kvsink"``)
            or ``Setting`` objects; default :data:`~massive_lens.quant.settings.GRID`.
        granularity: ``"tensor"``, ``"channel"``, ``"token"`` (default) or ``"group"``, for the
            settings that name none.
        symmetric: symmetric grids (default) or asymmetric with a zero point.
        group_size: the group width of ``granularity="group"`` (default 128).
        seq_len: tokens per sequence (default 128).
        n_seqs: evaluation sequences (default 8; as many calibrate).
        calibration: other text for the static ranges and the prefix (default: the corpus's next sequences).
        include_head: also quantize the unembedding (default False).
        seed: the seed of the random rotations.
        criterion: when an activation is massive (the token groups; default ``Criterion()``).

    Every setting is checked before the first pass (the model's structure), and each rotation
    kind once more before any setting runs (the rotated model must reproduce the model); a setting
    that cannot run on this model (a rotation on a LayerNorm or post-norm model, a KV cache
    without key and value projections) is left out, named with the reason in the result's
    ``skipped`` and summary, and the others run.

    Returns:
        A :class:`~massive_lens.quant.result.Quantization`.

    Raises:
        MassiveLensError: for a bad setting or option, when no setting can run on this model (the
            message names each and why), for an nnsight model (load it with ``backend="bridge"``),
            or as ``measure_outliers``.

    >>> from massive_lens import tiny_model
    >>> grid = quantize_grid(tiny_model("llama"), "One. Two. Three. " * 40, settings=["W8A8", "W4A4+hadamard"],
    ...                      seq_len=32, n_seqs=2)
    >>> list(grid.to_frame().setting), bool(grid.to_frame().rotation_error.max() < 1e-5)
    (['W8A8', 'W4A4+hadamard'], True)
    """
    specs = parse_settings(settings)  # one name alone is one setting
    if not specs:
        raise MassiveLensError("settings is empty; name at least one, e.g. settings=['W4A4']")
    if granularity not in GRANULARITIES:
        raise MassiveLensError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if not isinstance(symmetric, bool):
        raise MassiveLensError(f"symmetric must be True or False, got {symmetric!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise MassiveLensError(f"group_size must be a positive integer, got {group_size!r}")
    view = ModelView(model)
    if view.pattern_refusal():  # nnsight: its hooks run inside a trace; the readers' inputs cannot be seen
        raise view.unsupported("quantize and quantize_grid (the quantizer's hooks on each linear layer, and what "
                               "it sees at the layers that read the residual stream)")
    planned = [(s, _bits(s, granularity, symmetric, group_size)) for s in specs]
    planned, skipped = runnable(view, None, planned, include_head)  # the structure: before any pass
    none_runs(view, planned, skipped)
    tokens, calib = eval_and_calibration(view, corpus, calibration, seq_len, n_seqs)
    run = _Run(view, tokens, calib, as_criterion(criterion), include_head, seed)
    planned, late = runnable(view, run, planned, include_head)  # the rotations' exactness: before any setting
    skipped += late
    none_runs(view, planned, skipped)
    for name, why in skipped:
        log.warning("quantize_grid: %s left out: %s", name, why)
    rows, token_frames = [], []
    for setting, bits in planned:
        row, per_token = run.evaluate(setting, bits)
        means = per_token.groupby("group")["error"].mean() if len(per_token) else pd.Series(dtype=float)
        row.update({f"err_{g}": float(means.get(g, math.nan)) for g in GROUPS})
        rows.append(row)
        token_frames.append(per_token)
    tokens_frame = pd.concat(token_frames, ignore_index=True) if any(len(f) for f in token_frames) else token_frames[0]
    return Quantization(model_name=view.name, frame=pd.DataFrame(rows), fp_loss=float(run.fp.mean()),
                        tokens=tokens_frame, skipped=tuple(skipped))


def quantize(
    model: Any,
    corpus: Corpus = None,
    *,
    weights: int = 4,
    activations: int = 4,
    kv: int = 16,
    granularity: str = "token",
    symmetric: bool = True,
    rotation: str | None = None,
    keep_sinks: str | None = None,
    **options: Any,
) -> Quantization:
    """One low-bit setting: :func:`quantize_grid` with ``settings=[Setting(weights, activations, kv, ...)]``.

    Args:
        model: as in :func:`quantize_grid`.
        corpus: as in :func:`quantize_grid`.
        weights: weight bits (default 4; 16: full precision).
        activations: activation bits (default 4; 16: full precision).
        kv: key-value cache bits (default 16: not quantized).
        granularity: as in :func:`quantize_grid`.
        symmetric: as in :func:`quantize_grid`.
        rotation: None, ``"orthogonal"`` or ``"hadamard"``.
        keep_sinks: None, ``"kvsink"`` or ``"prefix"``.
        **options: ``group_size``, ``seq_len``, ``n_seqs``, ``calibration``, ``include_head``,
            ``seed``, ``criterion`` of :func:`quantize_grid`.

    Returns:
        A :class:`~massive_lens.quant.result.Quantization` with one row.

    Raises:
        MassiveLensError: for bad bits, rotation, kept-sink mode or option, or as :func:`quantize_grid`.

    >>> from massive_lens import tiny_model
    >>> r = quantize(tiny_model("llama"), "One. Two. Three. " * 40, kv=4, seq_len=32, n_seqs=2)
    >>> r.to_frame().setting.tolist()
    ['W4A4KV4']
    """
    unknown = set(options) - {"group_size", "seq_len", "n_seqs", "calibration", "include_head", "seed", "criterion"}
    if unknown:
        raise MassiveLensError(f"quantize got unknown options {sorted(unknown)}")
    setting = Setting(weights, activations, kv, None, rotation, keep_sinks)
    try:
        return quantize_grid(model, corpus, settings=[setting], granularity=granularity, symmetric=symmetric,
                             **options)
    except MassiveLensError as exc:  # the grid names a setting without its rotation; here it is an argument
        raise MassiveLensError(str(exc).replace(without_rotation(setting), NO_ROTATION)) from None
