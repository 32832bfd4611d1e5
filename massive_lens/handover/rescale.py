"""Make the residual stream fit float16 by scaling it down: the rescaling fix.

Every norm a pre-norm block reads the residual through is scale-invariant (RMSNorm and
LayerNorm give the same output for ``c·x`` as for ``x``, up to their small ``eps``), and so is
the final norm before the unembedding. Multiplying the whole residual stream by a factor ``c``
therefore changes no output, while its values, massive activations included, shrink ``c``
times and can fit float16's 65,504. The residual is the sum of the embedding and of every
sublayer's output, so scaling those scales it: the embedding (and learned positions), and each
sublayer's output. Where a block has post-sublayer norms (Gemma's sandwich norms), its output is
the post-norm's, so it is the post-norm weight that scales; elsewhere the output projection
(``W_O``, ``W_out``) and its bias. This is the fix proposed for Gemma 3 in float16 in
huggingface/transformers PR #37226 ("[RFC] Fix Gemma 3 FP16 with activation scaling": scale
the embedding and the ``post_*_layernorm`` weights).

:func:`rescale_hooks` applies it without touching a weight: hooks multiply the embedding, the
post-norms' normalized output (or the attention's ``hook_z`` and the MLP's ``hook_post``, the
inputs of ``W_O`` and ``W_out``) by ``c``, and move each output bias to ``c·b``. ``c`` is a power
of two, so every multiplication is exact in float16; the same factor folded into the weights
gives the same numbers. :func:`rescale_factor` picks it from the float32 peaks. It cannot help
an overflow that does not live in the residual stream: attention scores (``q·k``) read the
normalized residual, so they do not shrink.

>>> from massive_lens import tiny_model
>>> from massive_lens.core.model_view import ModelView
>>> view = ModelView(tiny_model("llama"))
>>> [name for name, _ in rescale_hooks(view, 0.125)][:3]
['hook_embed', 'blocks.0.attn.hook_z', 'blocks.0.mlp.hook_post']
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

# the sites whose values scale with the residual stream (precision_check's peaks)
RESIDUAL_SITES = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                  "ln1.hook_in", "ln2.hook_in")
HEADROOM = 2.0


def rescale_factor(peaks: pd.DataFrame, limit: float, headroom: float = HEADROOM) -> float:
    """The largest power of two ``c <= 1`` that brings the largest residual-stream value in
    ``peaks`` (``precision_check``'s float32 ``peaks``: ``site``, ``max_abs``) to ``limit /
    headroom`` or below (1.0 when it is there already).

    Args:
        peaks: per site and layer, the float32 ``max_abs``.
        limit: the dtype's largest value (65,504 for float16).
        headroom: how far below ``limit`` the largest value should land (default 2: the
            residual still grows through a layer's sums before the next site sees it).

    Returns:
        The factor ``c``.

    >>> rescale_factor(pd.DataFrame(dict(site=["hook_resid_post"], max_abs=[150_000.0])), 65504.0)
    0.125
    """
    rows = peaks[peaks["site"].isin(RESIDUAL_SITES)]
    top = float(rows["max_abs"].max()) if len(rows) else 0.0
    if not math.isfinite(top) or top <= limit / headroom:
        return 1.0
    return 2.0 ** -math.ceil(math.log2(top * headroom / limit))


def _times(x: Tensor, hook: Any, *, factor: float) -> Tensor:
    return x * factor


def _bias(x: Tensor, hook: Any, *, shift: Tensor) -> Tensor:
    return x + shift.to(x.device, x.dtype)


def _post_norm(view: ModelView, layer: int, which: str) -> str | None:
    name = view.block_hook(layer, f"{which}_post.hook_normalized")
    return name if name in view.hook_names else None


def rescale_hooks(view: ModelView, factor: Any) -> list[tuple[str, Any]]:
    """Hooks that run the model with its residual stream ``factor`` times smaller (see the
    module docstring).

    Args:
        view: the model's :class:`~massive_lens.core.model_view.ModelView`.
        factor: the scale ``c`` (a power of two keeps it exact), in (0, 1].

    Returns:
        ``(hook name, function)`` pairs for ``model.hooks`` / ``run_with_hooks``.

    Raises:
        MassiveLensError: for a factor outside (0, 1], or a model without an embedding hook or
            the per-block hooks the scaling goes through.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise MassiveLensError(f"factor is the residual stream's scale, in (0, 1], got {factor!r}")
    if "hook_embed" not in view.hook_names:
        raise MassiveLensError(f"{view.name} has no hook_embed, so its residual stream cannot be rescaled by hooks")
    times = partial(_times, factor=factor)
    hooks: list[tuple[str, Any]] = [("hook_embed", times)]
    if "hook_pos_embed" in view.hook_names and getattr(view.cfg, "positional_embedding_type", "") == "standard":
        hooks.append(("hook_pos_embed", times))
    for layer in range(view.n_layers):
        block = view.block(layer)
        for which, inner, out, bias in (("ln1", "attn.hook_z", "hook_attn_out", ("attn", "b_O")),
                                        ("ln2", "mlp.hook_post", "hook_mlp_out", ("mlp", "b_out"))):
            post = _post_norm(view, layer, which)
            if post is not None:  # a sandwich norm: its weight sets the output's size
                hooks.append((post, times))
                continue
            if not view.has_hook(layer, inner):
                raise MassiveLensError(f"{view.name} has no {view.block_hook(layer, inner)!r}, the input of the "
                                       "output projection the rescaling scales; rescale its weights instead")
            hooks.append((view.block_hook(layer, inner), times))
            b = getattr(getattr(block, bias[0], None), bias[1], None)
            if isinstance(b, Tensor) and bool(b.detach().abs().max() > 0):  # c·(xW) + b -> c·(xW + b)
                hooks.append((view.block_hook(layer, out), partial(_bias, shift=(factor - 1) * b.detach().float())))
    return hooks


def rescaled_peak(peaks: pd.DataFrame, factor: float) -> float:
    """The largest residual-stream value once scaled by ``factor``.

    Args:
        peaks: ``precision_check``'s float32 peaks.
        factor: the scale.

    Returns:
        ``factor`` times the largest ``max_abs`` at a residual-stream site.
    """
    rows = peaks[peaks["site"].isin(RESIDUAL_SITES)]
    return factor * float(rows["max_abs"].max()) if len(rows) else float("nan")


def _ratio_of(loss: float, base: float) -> float:
    return math.exp(loss - base) if math.isfinite(loss) else float("inf")


def cause_of(verdict: dict[str, Any], problems: list[tuple], limit: float) -> str:
    """What made an unsafe verdict: the first value past the dtype's range (site, layer, value), and
    the hook where the run in the dtype first saw inf or NaN; ``""`` for a safe one.

    Args:
        verdict: one ``precision_check`` verdict row (``verdict``, ``nonfinite_at``, ``ppl_ratio``).
        problems: that dtype's problem rows (``dtype, problem, site, layer, seq, pos, dim, value, ...``).
        limit: the dtype's largest value.

    Returns:
        A sentence naming the cause.
    """
    if verdict["verdict"] != "unsafe":
        return ""
    over = sorted((r for r in problems if r[1] == "overflow"), key=lambda r: r[3])
    text = ""
    if over:
        _, _, site, layer, _, pos, dim, value, *_ = over[0]
        what = "q·k before its scaling" if site.endswith("attn_scores") else f"|{site}|"
        text = f"{what} reaches {abs(value):,.0f} > {limit:,.0f} at layer {layer} (pos {pos}, dim {dim})"
    if verdict["nonfinite_at"]:
        text += ("; " if text else "") + f"the run's first inf/NaN at {verdict['nonfinite_at']}"
    return text or f"no overflow: rounding moves the perplexity x{verdict['ppl_ratio']:.4g}"


def smallest_fix(view: ModelView, run: Any, verdicts: list[dict[str, Any]], peaks: pd.DataFrame, base: float,
                 tolerance: float, confirm: bool = True) -> list[dict[str, Any]]:
    """Per verdict, the smallest fix that holds in a run in the dtype, from least to most change:
    ``rescale`` (float16 only: the whole model stays in float16, the residual stream scaled by
    :func:`rescale_factor`), ``keep blocks in float32`` (the verdict's own ``kept_float32``),
    ``bfloat16`` (float16 only: float32's range, 8 bits of mantissa) and ``float32``.

    Args:
        view: the model's view (in float32).
        run: ``run(dtype, hooks) -> mean loss`` of the model cast to ``dtype`` with ``hooks``.
        verdicts: ``precision_check``'s verdict rows as dicts (one per dtype).
        peaks: ``precision_check``'s float32 peaks.
        base: the float32 loss.
        tolerance: the largest relative perplexity change that passes.
        confirm: whether the verdicts were confirmed by runs (else nothing is run here either).

    Returns:
        Per verdict: ``rescale_factor``, ``rescale_ppl_ratio``, ``bfloat16_ppl_ratio`` (each NaN
        where not measured) and ``smallest_fix`` (a sentence).
    """
    bf16 = {v["dtype"]: v for v in verdicts}.get("bfloat16")
    out = []
    for v in verdicts:
        row = dict(rescale_factor=float("nan"), rescale_ppl_ratio=float("nan"), bfloat16_ppl_ratio=float("nan"))
        if v["verdict"] != "unsafe" or not confirm:
            row["smallest_fix"] = ("none needed" if v["verdict"] == "safe" else
                                   "not measured (confirm=False): " + v["fix"])
            out.append(row)
            continue
        dtype = torch.float16 if v["dtype"] == "float16" else torch.bfloat16
        options: list[tuple[str, float]] = []
        if dtype == torch.float16:
            factor = rescale_factor(peaks, torch.finfo(dtype).max)
            row["rescale_factor"] = factor
            if factor < 1:
                row["rescale_ppl_ratio"] = _ratio_of(run(dtype, rescale_hooks(view, factor)), base)
                options.append((f"rescale: scale the embedding and each sublayer's output (post-norm weights, "
                                f"else W_O/W_out and their biases) by {factor:g}, so the largest residual value "
                                f"{rescaled_peak(peaks, factor):,.0f} fits", row["rescale_ppl_ratio"]))
        if v["kept_float32"]:
            options.append((f"keep {v['kept_float32']} in float32", v["kept_ppl_ratio"]))
        if dtype == torch.float16:
            row["bfloat16_ppl_ratio"] = (bf16["ppl_ratio"] if bf16 is not None
                                         else _ratio_of(run(torch.bfloat16, []), base))
            options.append(("bfloat16", row["bfloat16_ppl_ratio"]))
        name = v["dtype"]
        good = [(what, r) for what, r in options if math.isfinite(r) and r <= 1 + tolerance]
        row["smallest_fix"] = (f"{good[0][0]}: perplexity x{good[0][1]:.4g} against float32, measured in "
                               f"{'bfloat16' if good[0][0] == 'bfloat16' else name}" if good else
                               "float32 (no smaller fix held: " + ", ".join(f"{w.split(':')[0]} x{r:.4g}"
                                                                            for w, r in options) + ")")
        out.append(row)
    return out
