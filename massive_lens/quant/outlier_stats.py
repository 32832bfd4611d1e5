"""What massive activations cost at 8 bits: outlier statistics, the W8A8 gap and the round-to-nearest grid.

A residual stream with a few activations thousands of times the median is hard to
quantize: an 8-bit grid stretched to cover the outlier leaves almost no levels for
everything else. :func:`measure_outliers` measures, on any TransformerLens-style model (a
:class:`~massive_lens.train.model.MassiveLM`, a ``TransformerBridge`` or a ``HookedTransformer``):

* per layer, the **max inf-norm** of the block output (``hook_resid_post``), the
  **top-1/median** magnitude ratio (per sequence, then averaged), and the **kurtosis** of
  each token's block output, averaged over tokens (both statistics: :mod:`massive_lens.core.stats`);
* the **sink metric** (Gu et al. 2024, :func:`~massive_lens.core.criterion.sink_metric`): the
  share of (layer, head) pairs whose mean attention to the first token, over the first 64
  queries, exceeds 0.3;
* the **first-token norm ratio**: ``||h_0|| / median_i ||h_i||`` (i > 0), largest over layers;
* **W8A8 simulated quantization** (:func:`~massive_lens.quant.fake.fake_quantized`): every linear
  layer's weight fake-quantized to int8 (symmetric, per output channel or per tensor), its input
  to int8 (asymmetric, per tensor, min-max calibrated on held-out text disjoint from the
  evaluation text). The unembedding is kept in full precision unless ``include_head=True``.

:func:`lowbit_grid` gives the loss at W8A8, W4A16, W4A4 (any ``W<w>A<a>``) with the same
engine, round-to-nearest with per-channel weights and per-token activations, and its gap to full
precision. Rotations, KV-cache bits and kept sinks: :func:`~massive_lens.quant.quantize_grid`.

The model is never left changed: hooks are removed and the original weight tensors put
back on every exit path, exceptions included. Each weight is quantized only while its own
layer runs, and the loss passes never hold a batch's logits (:mod:`massive_lens.core.loss`;
where that is not exact, passes small enough that one pass's logits stay small).

>>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
>>> report = measure_outliers(MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2)),
...                           "One. Two. Three. " * 40, seq_len=32, n_seqs=2)
>>> list(report.to_frame().columns)[:3], sorted(report.totals)[:3]
(['layer', 'max_inf_norm', 'top1'], ['first_token_norm_ratio', 'fp_loss', 'gap'])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from massive_lens.core.attention_pass import PassLayer, attention_reading, choose_path
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import first_norm_ratio, first_token_mass, sink_metric
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import kurtosis, top1_median
from massive_lens.errors import MassiveLensError
from massive_lens.quant.dispersion import Tally, site_names
from massive_lens.quant.fake import attached, calibrated_ranges, fake_quantized
from massive_lens.quant.result import LowBitGrid, OutlierReport
from massive_lens.quant.settings import ROUND_TO_NEAREST, parse_bits
from massive_lens.quant.sites import linear_sites


def measure_outliers(
    model: Any,
    corpus: Corpus = None,
    *,
    seq_len: int = 128,
    n_seqs: int = 8,
    per_channel: bool = True,
    include_head: bool = False,
    calibration: Any = None,
) -> OutlierReport:
    """Outlier statistics and the W8A8 loss gap (see the module docstring for the definitions).

    Args:
        model: a TransformerLens-style model (a bridge, a HookedTransformer or a MassiveLM).
        corpus: text to evaluate (a file, text, ``hf:`` name; None: offline prose). Its first
            ``n_seqs`` sequences are evaluated, the next ``n_seqs`` calibrate the activation
            ranges. A ``[batch, pos]`` token tensor: first half evaluated, second half calibrates.
        seq_len: tokens per sequence (default 128), for text input.
        n_seqs: evaluation sequences (default 8), for text input.
        per_channel: int8 weights per output channel (default), else per tensor.
        include_head: also quantize the unembedding (default False).
        calibration: other text (or tokens) for the activation ranges; then the first
            ``n_seqs`` sequences of ``corpus`` are evaluated and of ``calibration`` calibrate.

    Returns:
        An :class:`~massive_lens.quant.result.OutlierReport` (one row per layer; ``totals`` for the aggregates).

    Raises:
        MassiveLensError: if the corpus gives fewer than two sequences (and no
            ``calibration``), the model fires no ``hook_resid_post`` hooks or has no linear
            layers to quantize, or the model or a corpus is unusable.

    >>> from massive_lens import tiny_model
    >>> report = measure_outliers(tiny_model("llama"), "One. Two. Three. " * 40, seq_len=32, n_seqs=2)
    >>> len(report.to_frame()), report.gap == report.w8a8_loss - report.fp_loss
    (4, True)
    """
    view = ModelView(model)
    tokens, calib = eval_and_calibration(view, corpus, calibration, seq_len, n_seqs)
    scorer = _scorer(model)
    sites = linear_sites(model, include_head)
    with model_lock(model):
        ranges = calibrated_ranges(model, sites, calib)
    tally = Tally(sites, *site_names(model, view.blocks), ranges, bits=8, per_channel=per_channel)
    layers, sink, fp = _activation_stats(view, tokens, scorer, tally)  # one pass: statistics and FP loss
    with fake_quantized(model, calib, per_channel=per_channel, include_head=include_head, ranges=ranges):
        w8a8 = _loss(scorer, tokens)
    return OutlierReport(model_name=view.name, frame=layers, sink_metric=sink, fp_loss=fp, w8a8_loss=w8a8,
                         per_channel=per_channel, tensors=tally.frame())


def lowbit_grid(
    model: Any,
    corpus: Corpus = None,
    *,
    settings: Sequence[str] = ROUND_TO_NEAREST,
    seq_len: int = 128,
    n_seqs: int = 8,
    per_token: bool = True,
    calibration: Any = None,
) -> LowBitGrid:
    """Loss at each weight/activation bit width, and its gap to full precision.

    Round-to-nearest (:func:`~massive_lens.quant.fake.fake_quantized`): symmetric per-output-channel
    weights; activations (every linear layer's input) dynamic symmetric per token (default) or
    static per tensor calibrated on held-out text (``per_token=False``, as :func:`measure_outliers`'
    W8A8). No rotation, no smoothing, no GPTQ; the unembedding stays in full precision.

    Args:
        model: a TransformerLens-style model (a bridge, a HookedTransformer or a MassiveLM).
        corpus: evaluation text, split as in :func:`measure_outliers` (first ``n_seqs`` sequences
            evaluated, the next calibrate).
        settings: ``"W<w>A<a>"`` names (default :data:`~massive_lens.quant.settings.ROUND_TO_NEAREST`:
            W8A8, W4A16, W4A4).
        seq_len: as in :func:`measure_outliers`.
        n_seqs: as in :func:`measure_outliers`.
        per_token: per-token activations (default), else static per-tensor ranges.
        calibration: as in :func:`measure_outliers`.

    Returns:
        A :class:`~massive_lens.quant.result.LowBitGrid`.

    Raises:
        MassiveLensError: for a bad setting name, or as :func:`measure_outliers`.

    >>> from massive_lens import tiny_model
    >>> grid = lowbit_grid(tiny_model("llama"), "One. Two. Three. " * 40, settings=["W8A16", "W16A16"],
    ...                    seq_len=32, n_seqs=2)
    >>> grid.gaps()["W16A16"]
    0.0
    """
    bits = [parse_bits(s) for s in settings]
    view = ModelView(model)
    tokens, calib = eval_and_calibration(view, corpus, calibration, seq_len, n_seqs)
    scorer = _scorer(model)
    with model_lock(model):
        fp = _loss(scorer, tokens)
    rows = []
    for w, a in bits:
        with fake_quantized(model, calib, w_bits=w, a_bits=a, per_token=per_token):
            loss = _loss(scorer, tokens)
        rows.append(dict(setting=f"W{w}A{a}", w_bits=w, a_bits=a,
                         activations="per-token" if per_token else "per-tensor",
                         loss=loss, fp_loss=fp, gap=loss - fp))
    return LowBitGrid(model_name=view.name, frame=pd.DataFrame(rows), fp_loss=fp)


def eval_and_calibration(
    view: ModelView, corpus: Corpus, calibration: Any, seq_len: int, n_seqs: int
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "calib_batch calib_pos"]]:
    """The evaluation and calibration sequences: of ``corpus``, the first ``n_seqs`` and the next
    ``n_seqs`` (a token tensor: its two halves); or ``corpus``'s first and ``calibration``'s first.

    Args:
        view: the model.
        corpus: the evaluation text (or tokens).
        calibration: other text (or tokens) to calibrate on, or None.
        seq_len: tokens per sequence, for text.
        n_seqs: evaluation sequences, for text.

    Returns:
        ``(evaluation tokens, calibration tokens)``.

    Raises:
        MassiveLensError: when ``corpus`` gives fewer than two sequences and there is no ``calibration``.
    """
    tokens = sequences(view, corpus, seq_len, 2 * n_seqs)
    if calibration is None:
        if len(tokens) < 2:
            raise MassiveLensError(
                "need at least two sequences (evaluation and calibration); give more text, "
                "a smaller seq_len, or calibration="
            )
        half = min(n_seqs, len(tokens) // 2) if not isinstance(corpus, Tensor) else len(tokens) // 2
        return tokens[:half], tokens[half : 2 * half]
    calib = sequences(view, calibration, seq_len, n_seqs)
    return tokens[:n_seqs], calib


def _scorer(model: Any) -> NextTokenLoss:
    """The loss of ``model`` through ``run_with_hooks`` (hook filters allowed), slice by slice at
    the head where that is exact (checked on the model as given, before any quantization)."""
    device = next(model.parameters()).device
    return NextTokenLoss(model, lambda x, hooks: model.run_with_hooks(x.to(device), fwd_hooks=list(hooks)))


def _loss(scorer: NextTokenLoss, tokens: Int[Tensor, "batch pos"], fwd_hooks: list[tuple[Any, Any]] = ()) -> float:
    """Mean next-token loss over ``tokens`` (every sequence the same length), in the scorer's
    passes (:meth:`~massive_lens.core.loss.NextTokenLoss.batches`): no pass holds its logits, or,
    where that is not exact, passes whose logits stay small."""
    return float(torch.cat([scorer(chunk, hooks=fwd_hooks).loss for chunk in scorer.batches(tokens)]).mean())


def _activation_stats(view: ModelView, tokens: Int[Tensor, "batch pos"], scorer: NextTokenLoss, tally: Tally
                      ) -> tuple[pd.DataFrame, float, float]:
    """Per-layer outlier statistics, the sink metric and the loss, from one forward pass (in
    batches, see :func:`_loss`; every statistic is a mean over sequences, or a max); ``tally``
    reads every linear layer's input, and the attention pass's reading
    (:func:`~massive_lens.core.attention_pass.attention_reading`) the attention to the first token, in the
    same pass. Each hook knows its layer (a closure)."""
    model = view.model
    rows: dict[int, list[dict[str, Any]]] = {}
    sink_shares: dict[int, list[Tensor]] = {}
    sizes = [len(batch) for batch in scorer.batches(tokens)]  # the batches _loss runs
    scorer.check(tokens)  # its own pass on the first sequence, before the tally's hooks see any pass

    def resid(x: Float[Tensor, "batch pos d_model"], hook: Any, layer: int) -> None:
        if not bool(torch.isfinite(x).all()):
            raise view.overflow_error(hook.name)
        x = x.detach().float()
        top, med, ratio = top1_median(x.abs())
        first = first_norm_ratio(x.norm(dim=-1)).mean()
        rows.setdefault(layer, []).append(dict(
            layer=layer, max_inf_norm=float(top.max()), top1=float(top.mean()),
            median=float(med.clamp(min=1e-12).mean()), ratio=float(ratio.mean()),
            kurtosis=float(kurtosis(x).mean()), first_token_norm_ratio=float(first),
        ))

    def first(at: PassLayer) -> None:  # at.cols [batch head query 1]: the attention to the first token
        sink_shares.setdefault(at.layer, []).append(first_token_mass(at.cols))

    # the first token's column from the attention pass's reading of the loss forwards, on its path for their length
    reader = attention_reading(view, first, path=choose_path(view, "auto", view.full_batch(tokens[:1])),
                               columns=[0])
    hooks = [(view.block_hook(layer, "resid_post"), functools.partial(resid, layer=layer))
             for layer in range(view.n_layers) if view.has_hook(layer, "resid_post")]
    with model_lock(model), attached(tally.hooks(), []), reader:
        loss = _loss(scorer, tokens, [*hooks, *reader.hooks])
    if not rows:
        raise MassiveLensError(f"{type(model).__name__} fired no hook_resid_post hooks")
    weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)

    def mean(values: list[Any]) -> Any:
        return sum(w * v for w, v in zip(weights.tolist(), values, strict=True))

    def combine(key: str, parts: list[dict[str, Any]]) -> Any:
        values = [r[key] for r in parts]
        return values[0] if key == "layer" else max(values) if key == "max_inf_norm" else mean(values)

    frame = pd.DataFrame([{key: combine(key, rows[k]) for key in rows[k][0]} for k in sorted(rows)])
    shares = {k: mean(v) for k, v in sink_shares.items()}
    frame["sink_share"] = [sink_metric(shares[k]) if k in shares else float("nan") for k in frame["layer"]]
    frame["sink_mass"] = [float(shares[k].mean()) if k in shares else float("nan") for k in frame["layer"]]
    sink = sink_metric(torch.cat(list(shares.values())) if shares else torch.zeros(0))
    return frame, sink, loss
