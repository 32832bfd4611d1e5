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

The model is never left changed: hooks are removed and the original weight tensors put
back on every exit path, exceptions included. Each weight is quantized only while its own
layer runs (a copy of one layer at a time, never of the whole model), and the loss passes
are split so that one pass's logits stay small next to the weights.

>>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
>>> report = measure_outliers(MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2)),
...                           "One. Two. Three. " * 40, seq_len=32, n_seqs=2)
>>> list(report.to_frame().columns)[:3], sorted(report.totals)[:3]
(['layer', 'max_inf_norm', 'top1'], ['first_token_norm_ratio', 'fp_loss', 'gap'])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from massive_lens.core.budget import logit_batches, trim_allocator
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, first_token_mass, median_scale, sink_metric
from massive_lens.core.model_view import ModelView, model_lock
from massive_lens.core.render import profile_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.metrics import next_token_stats


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
            f"{row.sink_metric:.0%}; loss {self.fp_loss:.3f} -> W8A8 ({kind} weights) "
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
    layers, sink, fp = _activation_stats(view, tokens)  # one pass: statistics and FP loss
    with fake_quantized(model, calib, per_channel=per_channel, include_head=include_head):
        w8a8 = _loss(model, tokens)
    return OutlierReport(view.name, layers, sink, fp, w8a8, per_channel)


@contextlib.contextmanager
def fake_quantized(
    model: Any, calibration: Int[Tensor, "batch pos"], *, per_channel: bool = True,
    include_head: bool = False,
) -> Iterator[Any]:
    """Inside the block, ``model`` computes in simulated W8A8 (see the module docstring).

    >>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
    >>> m = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))
    >>> original = m.blocks[0].mlp.W_in.data_ptr()
    >>> tokens = m.to_tokens("Now run this.")
    >>> full = m(tokens)
    >>> with fake_quantized(m, m.to_tokens("Calibrate on this.")):
    ...     bool((m(tokens) - full).abs().max() > 0)  # each layer quantized while it runs
    True
    >>> m.blocks[0].mlp.W_in.data_ptr() == original  # the very same tensor is back
    True

    Each weight is swapped for its int8 version only while its module runs, so the block
    holds one quantized layer at a time, not a second copy of the model.
    """
    sites = _sites(model, include_head)
    handles: list[Any] = []
    saved: list[tuple[nn.Parameter, Tensor]] = []
    lock = model_lock(model)  # other threads' analyses wait until the weights are back
    lock.acquire()
    try:
        ranges: dict[int, list[float]] = {}
        for i, (module, _, _) in enumerate(sites):
            handles.append(module.register_forward_pre_hook(_observer(ranges, i), with_kwargs=True))
        with torch.no_grad():
            for batch in logit_batches(model, calibration):  # ranges are min / max: exact in batches
                model(batch.to(_device(model)))
        for handle in handles:
            handle.remove()
        handles.clear()
        seen: set[int] = set()
        for i, (module, weight, in_dims) in enumerate(sites):
            if id(weight) not in seen:
                seen.add(id(weight))
                saved.append((weight, weight.data))  # a reference, put back on every exit path
            pre, post = _weight_swap(weight, in_dims if per_channel else None, ranges.get(i))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for weight, data in saved:
            weight.data = data
        lock.release()


def fake_quant_weight(w: Tensor, in_dims: tuple[int, ...] | None = None) -> Tensor:
    """Symmetric int8: per tensor, or per output channel (max over the ``in_dims`` axes).

    >>> fake_quant_weight(torch.tensor([1.0, -0.5, 0.001])).tolist()
    [1.0, -0.5039370059967041, 0.0]
    """
    amax = w.abs().amax() if in_dims is None else w.abs().amax(dim=in_dims, keepdim=True)
    scale = amax.clamp(min=1e-12) / 127
    return (w / scale).round().clamp(-127, 127) * scale


def fake_quant_activation(x: Tensor, low: float, high: float) -> Tensor:
    """Asymmetric int8 on the calibrated range ``[low, high]`` (values outside are clipped).

    >>> [round(v, 4) for v in fake_quant_activation(torch.tensor([0.0, 0.5, 2.0]), 0.0, 1.0).tolist()]
    [0.0, 0.498, 1.0]
    """
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max(high - low, 1e-12) / 255
    zero = round(-low / scale) - 128
    q = (x / scale).round() + zero
    return (q.clamp(-128, 127) - zero) * scale


# --------------------------------------------------------------------------- internals


def _sites(model: Any, include_head: bool) -> list[tuple[nn.Module, nn.Parameter, tuple[int, ...]]]:
    """(module whose first input is the linear input, weight, input axes of the weight).

    A model that knows its own linear layers (``MassiveLM``) lists them with
    ``quantization_sites(include_head)``; for a Hugging Face model (or a bridge over one)
    every ``nn.Linear`` is a site."""
    own = getattr(model, "quantization_sites", None)
    if own is not None:
        return own(include_head)
    hf = getattr(model, "original_model", model)
    if not isinstance(hf, nn.Module):
        raise MassiveLensError(
            f"fake_quantized needs a MassiveLM, a TransformerBridge or an nn.Module; got "
            f"{type(model).__name__}"
        )
    head = getattr(hf, "get_output_embeddings", lambda: None)()
    head_ids = {id(m) for m in head.modules()} if head is not None and not include_head else set()
    sites = [
        (m, m.weight, (1,)) for m in hf.modules()
        if isinstance(m, nn.Linear) and id(m) not in head_ids
    ]
    if not sites:
        raise MassiveLensError(f"found no nn.Linear layers to quantize in {type(hf).__name__}")
    return sites


def _observer(ranges: dict[int, list[float]], i: int) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        low, high = float(x.min()), float(x.max())
        old = ranges.get(i, [low, high])
        ranges[i] = [min(old[0], low), max(old[1], high)]

    return hook


def _weight_swap(weight: nn.Parameter, in_dims: tuple[int, ...] | None, bounds: list[float] | None
                 ) -> tuple[Any, Any]:
    """Hooks that quantize the module's input (where calibrated) and swap in its int8 weight for
    the length of its forward, then put the full-precision tensor back."""
    kept: list[Tensor] = []

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        kept.append(weight.data)
        weight.data = fake_quant_weight(weight.data, in_dims)
        if bounds is None:
            return None
        low, high = bounds
        if args:
            return (fake_quant_activation(args[0], low, high), *args[1:]), kwargs
        key = next(iter(kwargs))
        return args, {**kwargs, key: fake_quant_activation(kwargs[key], low, high)}

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        weight.data = kept.pop()

    return pre, post


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _loss(model: Any, tokens: Int[Tensor, "batch pos"], fwd_hooks: list[tuple[Any, Any]] = ()) -> float:
    """Mean next-token loss over ``tokens`` (every sequence the same length), in batches whose
    logits stay small (:func:`~massive_lens.core.budget.logit_batches`), one sequence's loss
    at a time."""
    losses = []
    with torch.no_grad():
        for chunk in logit_batches(model, tokens):
            logits = model.run_with_hooks(chunk.to(_device(model)), fwd_hooks=list(fwd_hooks))
            losses.append(next_token_stats(logits, chunk.to(logits.device))[0])
            del logits
            trim_allocator()
    return float(torch.cat(losses).mean())


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


def _activation_stats(view: ModelView, tokens: Int[Tensor, "batch pos"]) -> tuple[pd.DataFrame, float, float]:
    """Per-layer outlier statistics, the sink metric and the loss, from one forward pass (in
    batches, see :func:`_loss`; every statistic is a mean over sequences, or a max)."""
    model = view.model
    rows: dict[int, list[dict[str, Any]]] = {}
    sink_shares: dict[int, list[Tensor]] = {}
    sizes = [len(batch) for batch in logit_batches(model, tokens)]  # the batches _loss runs

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
        loss = _loss(model, tokens, hooks)
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
