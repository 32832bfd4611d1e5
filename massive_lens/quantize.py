"""What massive activations cost: outlier statistics and simulated W8A8 quantization.

A residual stream with a few activations thousands of times the median is hard to
quantize: an 8-bit grid stretched to cover the outlier leaves almost no levels for
everything else. This module measures, on any TransformerLens-style model (a
:class:`~massive_lens.train.model.MassiveLM` or a ``TransformerBridge``):

* per layer, the **max inf-norm** of the block output (``hook_resid_post``), the
  **top-1/median** magnitude ratio (per sequence, then averaged), and the **kurtosis**:
  non-excess (a Gaussian gives 3), over the ``d_model`` entries of each token's block
  output, averaged over tokens (Bondarenko et al. 2023 report it this way);
* the **sink metric** (Gu et al. 2024, :func:`~massive_lens.core.criterion.sink_metric`): the
  share of (layer, head) pairs whose mean attention to the first token, over the first 64
  queries, exceeds 0.3;
* the **first-token norm ratio**: ``||h_0|| / median_i ||h_i||`` (i > 0), largest over layers;
* **W8A8 simulated quantization**: every linear layer's weight is fake-quantized to int8
  (symmetric, per output channel or per tensor), and its input to int8 (asymmetric,
  per tensor, min-max calibrated on held-out text that is disjoint from the evaluation
  text). The unembedding is kept in full precision unless ``include_head=True``.
* **the low-bit grid** (:func:`lowbit_grid`): the loss at W8A8, W4A16, W4A4 (any
  ``W<w>A<a>``), round-to-nearest with per-channel weights and per-token activations, and its
  gap to full precision. The rounding itself lives in :mod:`massive_lens.lowbit`.

The model is never left changed: hooks are removed and the original weight tensors put
back on every exit path, exceptions included. Each weight is quantized only while its own
layer runs (a copy of one layer at a time, never of the whole model), and the loss passes
never hold a batch's logits (:mod:`massive_lens.core.loss`; where that is not exact, passes
small enough that one pass's logits stay small next to the weights).

>>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
>>> report = measure_outliers(MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2)),
...                           "One. Two. Three. " * 40, seq_len=32, n_seqs=2)
>>> list(report.to_frame().columns)[:3], sorted(report.totals)[:3]
(['layer', 'max_inf_norm', 'top1'], ['first_token_norm_ratio', 'fp_loss', 'gap'])
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, first_token_mass, median_scale, sink_metric
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView, model_lock
from massive_lens.core.render import profile_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.lowbit import fake_quant_activation, fake_quant_weight, fake_quantized

__all__ = ["GRID", "LowBitGrid", "OutlierReport", "fake_quant_activation", "fake_quant_weight", "fake_quantized",
           "lowbit_grid", "measure_outliers", "parse_bits"]


@dataclass(frozen=True)
class OutlierReport(Result):
    """Outlier and quantization statistics of one model on one corpus.

    ``to_frame()`` has one row per layer: ``layer``, ``max_inf_norm``, ``top1``, ``median``,
    ``ratio`` (top-1/median), ``kurtosis``, ``first_token_norm_ratio``, ``sink_share``;
    :attr:`totals` aggregates them with the losses into one dict.
    """

    model_name: str
    frame: pd.DataFrame
    sink_metric: float
    fp_loss: float
    w8a8_loss: float
    per_channel: bool

    @property
    def gap(self) -> float:
        """W8A8 loss minus full-precision loss."""
        return self.w8a8_loss - self.fp_loss

    @property
    def totals(self) -> dict[str, float]:
        """max_inf_norm, max_ratio, mean_kurtosis, sink_metric, first_token_norm_ratio,
        fp_loss, w8a8_loss, gap."""
        return dict(
            max_inf_norm=float(self.frame["max_inf_norm"].max()),
            max_ratio=float(self.frame["ratio"].max()),
            mean_kurtosis=float(self.frame["kurtosis"].mean()),
            sink_metric=self.sink_metric,
            first_token_norm_ratio=float(self.frame["first_token_norm_ratio"].max()),
            fp_loss=self.fp_loss, w8a8_loss=self.w8a8_loss, gap=self.gap,
        )

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        row = pd.Series(self.totals)
        kind = "per-channel" if self.per_channel else "per-tensor"
        return (
            f"{self.model_name}: max |act| {row.max_inf_norm:.1f}, top-1/median up to "
            f"{row.max_ratio:.0f}x, mean kurtosis {row.mean_kurtosis:.1f}, sink metric "
            f"{row.sink_metric:.0%}; loss {self.fp_loss:.3f} -> W8A8 ({kind} weights, per-tensor static activations) "
            f"{self.w8a8_loss:.3f} (gap {self.gap:+.3f})"
        )

    def plot(self, ax: Any = None) -> Any:
        """Max inf-norm and median magnitude per layer (log scale)."""
        return profile_axes(self.frame, ["max_inf_norm", "median"], ax=ax,
                            title=f"{self.model_name}: block outputs")


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
        An :class:`OutlierReport` (one row per layer; ``totals`` for the aggregates).

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
    tokens, calib = _eval_and_calibration(view, corpus, calibration, seq_len, n_seqs)
    scorer = _scorer(model)
    layers, sink, fp = _activation_stats(view, tokens, scorer)  # one pass: statistics and FP loss
    with fake_quantized(model, calib, per_channel=per_channel, include_head=include_head):
        w8a8 = _loss(scorer, tokens)
    return OutlierReport(view.name, layers, sink, fp, w8a8, per_channel)


GRID = ("W8A8", "W4A16", "W4A4")


@dataclass(frozen=True)
class LowBitGrid(Result):
    """Loss of one model under round-to-nearest fake quantization at several bit widths.

    ``to_frame()``: one row per setting: ``setting`` (``"W<w>A<a>"``, 16 = not quantized),
    ``w_bits``, ``a_bits``, ``activations`` (``"per-token"`` or ``"per-tensor"``), ``loss``,
    ``fp_loss`` and ``gap`` (loss minus full precision, nats per token).
    """

    model_name: str
    frame: pd.DataFrame
    fp_loss: float

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def gaps(self) -> dict[str, float]:
        """``{setting: gap}``."""
        return dict(zip(self.frame.setting, self.frame.gap, strict=True))

    def summary(self) -> str:
        kind = self.frame.activations.iloc[0] if len(self.frame) else "-"
        parts = ", ".join(f"{r.setting} {r.loss:.3f} ({r.gap:+.3f})" for r in self.frame.itertuples())
        return (f"{self.model_name}: loss {self.fp_loss:.3f} in full precision; round-to-nearest, per-channel "
                f"weights, {kind} activations: {parts}")

    def plot(self, ax: Any = None) -> Any:
        """The gap to full precision per setting (a bar each)."""
        import matplotlib.pyplot as plt

        ax = ax if ax is not None else plt.subplots(figsize=(5, 3))[1]
        ax.bar(self.frame.setting, self.frame.gap)
        ax.set_ylabel("loss - full-precision loss (nats)")
        ax.set_title(f"{self.model_name}: round-to-nearest fake quantization")
        return ax


def parse_bits(setting: str) -> tuple[int, int]:
    """``"W4A16"`` -> ``(4, 16)``.

    Raises:
        MassiveLensError: for another form or a width outside 2-16.
    """
    match = re.fullmatch(r"W(\d+)A(\d+)", setting.strip().upper())
    if match is None or not all(2 <= int(b) <= 16 for b in match.groups()):
        raise MassiveLensError(f"bad quantization setting {setting!r}: write W<bits>A<bits> with widths 2-16 "
                               "(16: full precision), e.g. W8A8, W4A16, W4A4")
    return int(match.group(1)), int(match.group(2))


def lowbit_grid(
    model: Any,
    corpus: Corpus = None,
    *,
    settings: Sequence[str] = GRID,
    seq_len: int = 128,
    n_seqs: int = 8,
    per_token: bool = True,
    calibration: Any = None,
) -> LowBitGrid:
    """Loss at each weight/activation bit width, and its gap to full precision.

    Round-to-nearest (:mod:`massive_lens.lowbit`): symmetric per-output-channel weights; activations
    (every linear layer's input) dynamic symmetric per token (default) or static per tensor
    calibrated on held-out text (``per_token=False``, as :func:`measure_outliers`' W8A8). No
    rotation, no smoothing, no GPTQ; the unembedding stays in full precision.

    Args:
        model: a TransformerLens-style model (a bridge, a HookedTransformer or a MassiveLM).
        corpus: evaluation text, split as in :func:`measure_outliers` (first ``n_seqs`` sequences
            evaluated, the next calibrate).
        settings: ``"W<w>A<a>"`` names (default :data:`GRID`: W8A8, W4A16, W4A4).
        seq_len, n_seqs, calibration: as in :func:`measure_outliers`.
        per_token: per-token activations (default), else static per-tensor ranges.

    Returns:
        A :class:`LowBitGrid`.

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
    tokens, calib = _eval_and_calibration(view, corpus, calibration, seq_len, n_seqs)
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
    return LowBitGrid(view.name, pd.DataFrame(rows), fp)


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


def _eval_and_calibration(
    view: ModelView, corpus: Corpus, calibration: Any, seq_len: int, n_seqs: int
) -> tuple[Tensor, Tensor]:
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


def _activation_stats(view: ModelView, tokens: Int[Tensor, "batch pos"], scorer: NextTokenLoss
                      ) -> tuple[pd.DataFrame, float, float]:
    """Per-layer outlier statistics, the sink metric and the loss, from one forward pass (in
    batches, see :func:`_loss`; every statistic is a mean over sequences, or a max)."""
    model = view.model
    rows: dict[int, list[dict[str, Any]]] = {}
    sink_shares: dict[int, list[Tensor]] = {}
    sizes = [len(batch) for batch in scorer.batches(tokens)]  # the batches _loss runs

    def resid(x: Float[Tensor, "batch pos d_model"], hook: Any) -> None:
        if not bool(torch.isfinite(x).all()):
            raise view.overflow_error(hook.name)
        layer = int(hook.name.split(".")[1])
        a = x.detach().float().abs()
        med = median_scale(a, Criterion())[1].clamp(min=1e-12)
        top = a.flatten(1).amax(1)
        centered = x.detach().float() - x.detach().float().mean(-1, keepdim=True)
        kurt = centered.pow(4).mean(-1) / centered.pow(2).mean(-1).pow(2).clamp(min=1e-24)
        norms = x.detach().float().norm(dim=-1)
        first = (norms[:, 0] / norms[:, 1:].median(1).values.clamp(min=1e-12)).mean()
        rows.setdefault(layer, []).append(dict(
            layer=layer, max_inf_norm=float(top.max()), top1=float(top.mean()),
            median=float(med.mean()), ratio=float((top / med).mean()),
            kurtosis=float(kurt.mean()), first_token_norm_ratio=float(first),
        ))

    def pattern(p: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any) -> None:
        sink_shares.setdefault(int(hook.name.split(".")[1]), []).append(first_token_mass(p))

    hooks = [(lambda n: n.endswith("hook_resid_post"), resid),
             (lambda n: n.endswith("attn.hook_pattern"), pattern)]
    with model_lock(model):
        loss = _loss(scorer, tokens, hooks)
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
    sink = sink_metric(torch.cat(list(shares.values())) if shares else torch.zeros(0))
    return frame, sink, loss
