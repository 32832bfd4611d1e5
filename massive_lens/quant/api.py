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
from collections.abc import Sequence
from typing import Any

import pandas as pd

from massive_lens.core.corpora import Corpus
from massive_lens.core.criterion import Criterion, as_criterion
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.quant.outlier_stats import eval_and_calibration
from massive_lens.quant.plan import NO_ROTATION, none_runs, runnable, without_rotation
from massive_lens.quant.result import GROUPS, Quantization
from massive_lens.quant.run import Run
from massive_lens.quant.settings import GRANULARITIES, GRID, Setting, parse_settings
from massive_lens.quant.simulate import Bits

log = logging.getLogger(__name__)


def _bits(setting: Setting, granularity: str, symmetric: bool, group_size: int) -> Bits:
    def width(b: int) -> int | None:
        return None if b >= 16 else b

    return Bits(width(setting.weights), width(setting.activations), width(setting.kv),
                setting.granularity or granularity, symmetric if setting.symmetric is None else setting.symmetric,
                group_size)


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
    run, planned, skipped = prepare_grid(model, corpus, settings=settings, granularity=granularity,
                                         symmetric=symmetric, group_size=group_size, seq_len=seq_len, n_seqs=n_seqs,
                                         calibration=calibration, include_head=include_head, seed=seed,
                                         criterion=criterion)
    return evaluate_grid(run, planned, skipped)


def prepare_grid(model: Any, corpus: Corpus, *, settings: Sequence[str | Setting], granularity: str,
                 symmetric: bool, group_size: int, seq_len: int, n_seqs: int, calibration: Any,
                 include_head: bool, seed: int, criterion: Any) -> tuple[Run, list[tuple[Setting, Bits]], list]:
    """The checked options, the :class:`~massive_lens.quant.run.Run` (full-precision pass done) and
    ``(planned settings, skipped (name, why))``: everything of :func:`quantize_grid` before its
    settings run (its arguments, its errors)."""
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
    if not view.serves_patterns:  # nnsight: its hooks run inside a trace; the readers' inputs cannot be seen
        raise view.unsupported("quantize and quantize_grid (the quantizer's hooks on each linear layer, and what "
                               "it sees at the layers that read the residual stream)")
    planned = [(s, _bits(s, granularity, symmetric, group_size)) for s in specs]
    planned, skipped = runnable(view, None, planned, include_head)  # the structure: before any pass
    none_runs(view, planned, skipped)
    tokens, calib = eval_and_calibration(view, corpus, calibration, seq_len, n_seqs)
    run = Run(view, tokens, calib, as_criterion(criterion), include_head, seed)
    planned, late = runnable(view, run, planned, include_head)  # the rotations' exactness: before any setting
    skipped += late
    none_runs(view, planned, skipped)
    for name, why in skipped:
        log.warning("quantize_grid: %s left out: %s", name, why)
    return run, planned, skipped


def evaluate_grid(run: Run, planned: list[tuple[Setting, Bits]], skipped: list) -> Quantization:
    """Each planned setting on ``run``, as one :class:`~massive_lens.quant.result.Quantization`
    (its per-sequence losses in ``sequences``, paired with the full-precision ones)."""
    rows, token_frames, seq_frames = [], [], []
    for setting, bits in planned:
        row, per_token, per_seq, _ = run.evaluate(setting, bits)
        means = per_token.groupby("group")["error"].mean() if len(per_token) else pd.Series(dtype=float)
        row.update({f"err_{g}": float(means.get(g, math.nan)) for g in GROUPS})
        rows.append(row)
        token_frames.append(per_token)
        seq_frames.append(pd.DataFrame({"setting": setting.name, "seq": range(len(per_seq)),
                                        "loss": per_seq.numpy(), "fp_loss": run.fp.double().numpy()}))
    tokens_frame = pd.concat(token_frames, ignore_index=True) if any(len(f) for f in token_frames) else token_frames[0]
    return Quantization(model_name=run.view.name, frame=pd.DataFrame(rows), fp_loss=float(run.fp.mean()),
                        tokens=tokens_frame, skipped=tuple(skipped),
                        sequences=pd.concat(seq_frames, ignore_index=True))


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
