"""Round-to-nearest fake quantization: the one rounding rule, and the engine that applies it layer by layer.

Fake quantization rounds a tensor onto a b-bit integer grid and scales it back, so the model
computes in floating point with exactly the values a b-bit kernel would see. One rule,
:func:`rtn`, on a range ``[low, high]``:

* **symmetric**: ``2^(b-1) - 1`` levels each side of zero, scale ``max(|low|, |high|) / qmax``;
* **asymmetric**: ``2^b`` levels on ``[min(low, 0), max(high, 0)]`` with an integer zero point.

The ranges come from the tensor itself (dynamic: per tensor, per output channel of a weight,
per token, per group; :func:`fake_quant`, :func:`fake_quant_weight`, :func:`fake_quant_tokens`)
or from held-out text (static: :func:`fake_quant_activation`).

:func:`fake_quantized` applies it to every linear layer of a model, the engine behind
:func:`~massive_lens.quant.measure_outliers`' W8A8 and :func:`~massive_lens.quant.lowbit_grid`:

* **weights**: symmetric, one scale per output channel (the largest ``|w|`` over the input
  axes) or per tensor;
* **activations** (the input of every linear layer), either *static per tensor*
  (``per_token=False``): asymmetric on the ``[min, max]`` range calibrated on held-out text, so an
  outlier stretches the one range and every other value loses its levels; or *dynamic per
  token* (``per_token=True``): symmetric, one scale per token from its own largest ``|x|``, so an
  outlier costs only the other entries of its own token.

``bits=None`` (or 16) leaves that side in full precision. Plain round-to-nearest: no rotation
(:mod:`massive_lens.quant.simulate` adds those), no smoothing, no GPTQ-style error correction;
the unembedding stays in full precision unless ``include_head=True``. Both engines attach
their hooks through :func:`attached`, which puts every weight back on every exit path.

>>> fake_quant_weight(torch.tensor([1.0, -0.6, 0.001]), bits=4).tolist()
[1.0, -0.5714285969734192, 0.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor, nn

from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_lock import model_lock
from massive_lens.errors import MassiveLensError
from massive_lens.quant.settings import GRANULARITIES
from massive_lens.quant.sites import linear_sites

FULL = (None, 16)  # bit widths that mean "not quantized"


def rtn(x: Tensor, bits: int, low: Tensor | float, high: Tensor | float, *, symmetric: bool = True) -> Tensor:
    """Round-to-nearest on the range ``[low, high]`` (broadcast against ``x``; values outside clip).

    Symmetric: ``2^(b-1) - 1`` levels each side of zero, scale ``max(|low|, |high|) / qmax``;
    asymmetric: ``2^b`` levels on ``[min(low, 0), max(high, 0)]`` with an integer zero point.
    Ranges given as tensors are computed in ``x``'s dtype; as Python numbers (a calibrated
    static range), the scale and zero point are computed in double precision.

    Args:
        x: the tensor to round.
        bits: the grid's width.
        low: the range's low end (a tensor broadcast against ``x``, or a number).
        high: its high end, likewise.
        symmetric: symmetric (default) or asymmetric with a zero point.

    Returns:
        ``x`` on the grid, in its own dtype and shape.

    >>> rtn(torch.tensor([1.0, -0.6, 0.001]), 4, -1.0, 1.0).tolist()
    [1.0, -0.5714285969734192, 0.0]
    >>> rtn(torch.tensor([0.0, 0.5, 2.0]), 8, 0.0, 1.0, symmetric=False).tolist()[2]
    1.0
    """
    if not isinstance(low, Tensor) and not isinstance(high, Tensor):
        return _rtn_numbers(x, bits, float(low), float(high), symmetric)
    low, high = torch.as_tensor(low, dtype=x.dtype), torch.as_tensor(high, dtype=x.dtype)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = torch.maximum(low.abs(), high.abs()).clamp(min=1e-12) / qmax
        return (x / scale).round().clamp(-qmax, qmax) * scale
    low, high = low.clamp(max=0.0), high.clamp(min=0.0)
    scale = (high - low).clamp(min=1e-12) / (2 ** bits - 1)
    zero = (-low / scale).round()
    return ((x / scale).round() + zero).clamp(0, 2 ** bits - 1).sub(zero) * scale


def _rtn_numbers(x: Tensor, bits: int, low: float, high: float, symmetric: bool) -> Tensor:
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = max(abs(low), abs(high), 1e-12) / qmax
        return (x / scale).round().clamp(-qmax, qmax) * scale
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max(high - low, 1e-12) / (2 ** bits - 1)
    zero = round(-low / scale) - 2 ** (bits - 1)  # centred on zero: the integers stay small in float32
    q = (x / scale).round() + zero
    return (q.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) - zero) * scale


def fake_quant(x: Tensor, bits: int, granularity: str = "token", *, symmetric: bool = True, group_size: int = 128
               ) -> Tensor:
    """Dynamic round-to-nearest of ``x``, ranges from ``x`` itself: one range for the whole tensor
    (``"tensor"``), per row of the last axis (``"token"``, or ``"channel"`` for a weight's
    output rows) or per ``group_size`` consecutive entries of the last axis (``"group"``; a last
    partial group is its own group).

    Args:
        x: the tensor to round.
        bits: the grid's width.
        granularity: ``"tensor"``, ``"channel"``, ``"token"`` (default) or ``"group"``.
        symmetric: symmetric (default) or asymmetric.
        group_size: the group width of ``"group"``.

    Returns:
        ``x`` on the grid.

    Raises:
        MassiveLensError: for another granularity.

    >>> fake_quant(torch.tensor([[1.0, 0.3], [100.0, 0.3]]), 4).tolist()
    [[1.0, 0.2857142984867096], [100.0, 0.0]]
    """
    if granularity not in GRANULARITIES:
        raise MassiveLensError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return rtn(x, bits, x.amin(), x.amax(), symmetric=symmetric)
    if granularity in ("token", "channel"):
        return rtn(x, bits, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), symmetric=symmetric)
    width = x.shape[-1]
    pad = -width % group_size
    grouped = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, group_size))  # zeros never widen a range
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    return rtn(grouped, bits, low, high, symmetric=symmetric).flatten(-2)[..., :width]


def fake_quant_weight(w: Tensor, in_dims: tuple[int, ...] | None = None, bits: int = 8) -> Tensor:
    """Symmetric ``bits``-bit: per tensor, or per output channel (max over the ``in_dims`` axes).

    Args:
        w: the weight.
        in_dims: its input axes (None: one scale for the tensor).
        bits: the grid's width (default 8).

    Returns:
        ``w`` on the grid.

    >>> fake_quant_weight(torch.tensor([1.0, -0.5, 0.001])).tolist()
    [1.0, -0.5039370059967041, 0.0]
    """
    amax = w.abs().amax() if in_dims is None else w.abs().amax(dim=in_dims, keepdim=True)
    return rtn(w, bits, -amax, amax)


def fake_quant_activation(x: Tensor, low: float, high: float, bits: int = 8) -> Tensor:
    """Asymmetric ``bits``-bit on the calibrated range ``[low, high]`` (values outside are clipped).

    Args:
        x: the activation.
        low: the calibrated range's low end.
        high: its high end.
        bits: the grid's width (default 8).

    Returns:
        ``x`` on the grid.

    >>> [round(v, 4) for v in fake_quant_activation(torch.tensor([0.0, 0.5, 2.0]), 0.0, 1.0).tolist()]
    [0.0, 0.498, 1.0]
    """
    return rtn(x, bits, float(low), float(high), symmetric=False)


def fake_quant_tokens(x: Tensor, bits: int = 8) -> Tensor:
    """Symmetric ``bits``-bit with one scale per token: the largest ``|x|`` over every axis after
    ``[batch, pos]`` (the last axis of a 2-D input).

    Args:
        x: the activation.
        bits: the grid's width (default 8).

    Returns:
        ``x`` on the grid.

    >>> fake_quant_tokens(torch.tensor([[1.0, 0.3], [100.0, 0.3]]), bits=4).tolist()
    [[1.0, 0.2857142984867096], [100.0, 0.0]]
    """
    start = 2 if x.ndim >= 3 else x.ndim - 1
    amax = x.abs().flatten(start).amax(-1).reshape(*x.shape[:start], *[1] * (x.ndim - start))
    return rtn(x, bits, -amax, amax)


@contextlib.contextmanager
def attached(hooks: Iterable[tuple[nn.Module, Any, Any]], weights: Iterable[nn.Parameter]) -> Iterator[None]:
    """For the block: each ``(module, pre, post)`` as the module's forward pre-hook (with kwargs)
    and forward hook; on every exit path, exceptions included, the hooks are removed and each of
    ``weights`` has its own tensor back (the hooks may swap it while their module runs).

    Args:
        hooks: ``(module, pre_hook, forward_hook)`` triples.
        weights: the parameters the hooks may swap.

    Returns:
        A context manager.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> before = lin.weight.data_ptr()
    >>> def pre(module, args, kwargs): lin.weight.data = lin.weight.data * 0
    >>> with attached([(lin, pre, lambda *a: None)], [lin.weight]):
    ...     bool(lin(torch.ones(1, 2)).eq(lin.bias).all())
    True
    >>> lin.weight.data_ptr() == before, len(lin._forward_pre_hooks)
    (True, 0)
    """
    saved: dict[int, tuple[nn.Parameter, Tensor]] = {}
    for weight in weights:
        saved.setdefault(id(weight), (weight, weight.data))  # a reference, put back on every exit path
    handles = []
    try:
        for module, pre, post in hooks:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for weight, data in saved.values():
            weight.data = data


def _calibrate(scorer: NextTokenLoss, batch: Tensor, head: bool) -> None:
    """One calibration pass: stopped at the output head, which runs (if it is quantized) a few
    positions at a time, so no pass holds its logits; the whole pass where that is not exact."""
    if not scorer.exact:
        scorer.forward(batch, ())
        return
    hidden = scorer.hidden(batch)
    for row in hidden if head else ():
        for a in range(0, len(row), scorer.step):
            scorer.logits(row, a, a + scorer.step)


def calibrated_ranges(model: Any, sites: list[tuple[nn.Module, nn.Parameter, tuple[int, ...]]],
                      calibration: Tensor) -> dict[int, list[float]]:
    """Each site's ``[min, max]`` input over the calibration tokens (unquantized passes), by the
    site's index: the static per-tensor ranges of :func:`fake_quantized`.

    Args:
        model: the model (as :func:`fake_quantized`).
        sites: its :func:`~massive_lens.quant.sites.linear_sites`.
        calibration: ``[batch, pos]`` tokens.

    Returns:
        ``{site index: [low, high]}``.
    """
    ranges: dict[int, list[float]] = {}
    device = next(model.parameters()).device
    scorer = NextTokenLoss(model, lambda x, hooks: model(x.to(device)))
    batches = scorer.batches(calibration)
    scorer.check(calibration)  # decides, unquantized and unobserved, whether the head can be sliced
    head = any(module is scorer.head for module, _, _ in sites)
    observers = [(module, _observer(ranges, i), lambda *a: None) for i, (module, _, _) in enumerate(sites)]
    with attached(observers, []), torch.no_grad():
        for batch in batches:  # ranges are min / max: exact in batches, and in slices at the head
            _calibrate(scorer, batch, head)
    return ranges


@contextlib.contextmanager
def fake_quantized(
    model: Any, calibration: Int[Tensor, "batch pos"] | None = None, *, per_channel: bool = True,
    include_head: bool = False, w_bits: int | None = 8, a_bits: int | None = 8, per_token: bool = False,
    ranges: dict[int, list[float]] | None = None,
) -> Iterator[Any]:
    """Inside the block, ``model`` computes with fake-quantized linear layers (module docstring).

    Args:
        model: a MassiveLM, a TransformerBridge or a Hugging Face ``nn.Module``.
        calibration: tokens whose ``[min, max]`` calibrate static per-tensor activation ranges
            (needed only for ``per_token=False`` with ``a_bits`` below 16).
        per_channel: weights per output channel (default), else per tensor.
        include_head: also quantize the unembedding (default False).
        w_bits: weight bits, 8 or 4 (or any width from 2); None or 16: not quantized.
        a_bits: activation bits, likewise.
        per_token: dynamic per-token activations instead of static per-tensor ranges.
        ranges: static ranges already calibrated (:func:`calibrated_ranges` of these sites);
            None: calibrated here on ``calibration``.

    Returns:
        A context manager that yields ``model``.

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

    Each weight is swapped for its quantized version only while its module runs, so the block
    holds one quantized layer at a time, not a second copy of the model.

    Raises:
        MassiveLensError: for a bit width below 2, static activations without ``calibration``,
            or a model with no linear layers.
    """
    w_bits, a_bits = (None if b in FULL else b for b in (w_bits, a_bits))
    if any(b is not None and b < 2 for b in (w_bits, a_bits)):
        raise MassiveLensError(f"bit widths must be at least 2 (or None/16 for full precision); got W{w_bits}A{a_bits}")
    static = a_bits is not None and not per_token
    if static and calibration is None and ranges is None:
        raise MassiveLensError("static per-tensor activation ranges need calibration tokens (or per_token=True)")
    sites = linear_sites(model, include_head)
    with model_lock(model):  # other threads' analyses wait until the weights are back
        if ranges is None:
            ranges = calibrated_ranges(model, sites, calibration) if static else {}
        hooks = []
        for i, (module, weight, in_dims) in enumerate(sites):
            if a_bits is None:
                act = None
            elif per_token:
                act = lambda x: fake_quant_tokens(x, a_bits)  # noqa: E731
            else:
                act = _static(ranges[i], a_bits) if i in ranges else None
            hooks.append((module, *_weight_swap(weight, in_dims if per_channel else None, w_bits, act)))
        with attached(hooks, [weight for _, weight, _ in sites]):
            yield model


def _observer(ranges: dict[int, list[float]], i: int) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        low, high = float(x.min()), float(x.max())
        old = ranges.get(i, [low, high])
        ranges[i] = [min(old[0], low), max(old[1], high)]

    return hook


def _static(bounds: list[float], bits: int) -> Any:
    low, high = bounds
    return lambda x: fake_quant_activation(x, low, high, bits)


def _weight_swap(weight: nn.Parameter, in_dims: tuple[int, ...] | None, w_bits: int | None, act: Any
                 ) -> tuple[Any, Any]:
    """Hooks that quantize the module's input (``act``, if any) and swap in its quantized weight
    for the length of its forward, then put the full-precision tensor back."""
    kept: list[Tensor] = []

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        kept.append(weight.data)
        if w_bits is not None:
            weight.data = fake_quant_weight(weight.data, in_dims, w_bits)
        if act is None:
            return None
        if args:
            return (act(args[0]), *args[1:]), kwargs
        key = next(iter(kwargs))
        return args, {**kwargs, key: act(kwargs[key])}

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        weight.data = kept.pop()

    return pre, post
