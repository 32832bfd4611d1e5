"""What each block of a model is, for :func:`massive_lens.trace_origin`: which hook holds what.

Read from the model's own hooks and modules (never from its architecture's name), block by
block (:class:`BlockPlan`):

- ``blocks.{l}.hook_attn_out`` / ``hook_mlp_out`` are what is added to the residual stream;
  on models with post-sublayer norms (Gemma 2/3 "sandwich" norms, OLMo 2's post-norms only)
  we read ``ln1_post.hook_out`` / ``ln2_post.hook_out``, the output *after* the post-norm,
  explicitly, and ``ln2_post.hook_in`` (the raw MLP output);
- a *parallel* block (GPT-NeoX/Pythia, GPT-J, Phi-1/2, Falcon, Cohere: no
  ``hook_resid_mid``) feeds attention and MLP the same ``resid_pre`` and adds both; its
  "residual after attention" is ``resid_pre + attn``, exact by construction;
- the MLP reads its input through ``ln2`` (``ln1``, shared with attention, in a parallel block
  without an ``ln2``; no norm at all with post-norms only); ``ln.hook_scale`` divides the
  (centred, for LayerNorm) input, ``normalized = x / scale`` (solved from the norm's input and
  output where the hook is missing); the norm's input is kept to check the attribution;
- ``mlp.hook_post`` is the input of ``W_out``; ``mlp.hook_pre`` is the gate pre-activation of
  a gated MLP (the only pre-activation otherwise) and ``mlp.hook_pre_linear`` the up value.
  Dense MLPs (``W_in [d_model, d_mlp]``, ``W_out [d_mlp, d_model]``) have neurons; so does a
  mixture of experts stored as transformers stores it (:mod:`massive_lens.origin.experts`:
  the experts module's inputs, routing and output are recorded by PyTorch hooks, removed
  after the pass); any other MLP has a ledger term but no neuron rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor

from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.origin.experts import Experts, find_experts


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """What one block is, read from its hooks and modules."""

    layer: int
    parallel: bool  # attention and MLP both read resid_pre (no hook_resid_mid)
    mlp_norm: str | None  # "ln2", "ln1" (shared, parallel block) or None (no pre-MLP norm)
    dense: bool  # a dense MLP with per-neuron hooks and W_in/W_out
    gated: bool  # with a gate (W_gate, mlp.hook_pre_linear)
    post_norm: bool  # the MLP output passes ln2_post before the residual
    d_mlp: int | None
    hooks: dict[str, str]  # capture key -> hook name
    experts: Experts | None = None  # a mixture of experts as transformers stores it (origin.experts)


def _weight(mlp: Any, name: str) -> Tensor | None:
    """``W_in``, ``W_gate`` or ``W_out`` of an MLP bridge (None where it has none or cannot say)."""
    try:
        weight = getattr(mlp, name, None)
    except Exception:  # noqa: BLE001 - bridges raise many kinds for weights they cannot expose
        weight = None
    return weight if isinstance(weight, Tensor) else None


def block_plan(view: ModelView, layer: int) -> BlockPlan:
    """Which hooks hold what in block ``layer`` (raises a clear error for a block without an
    attention and an MLP output, e.g. a state-space or linear-attention block)."""
    block = view.block(layer)
    name = partial(view.block_hook, layer)  # "hook_attn_out" -> "blocks.{layer}.hook_attn_out"
    has = partial(view.has_hook, layer)
    parallel = not has("hook_resid_mid")
    attn_post, mlp_post = has("ln1_post.hook_out"), has("ln2_post.hook_out")
    missing = [n for n in ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out") if not has(n)]
    if missing or getattr(block, "mlp", None) is None:
        kind = type(block).__name__
        raise MassiveLensError(
            f"{view.name}: block {layer} ({kind}) has no {'/'.join(missing) or 'mlp module'}: trace_origin "
            "needs every block to add an attention output and an MLP output to the residual stream "
            "(state-space, recurrent and linear-attention blocks do not)")
    hooks = {
        "resid_pre": name("hook_resid_pre"),
        "resid_post": name("hook_resid_post"),
        "attn": name("ln1_post.hook_out" if attn_post else "hook_attn_out"),
        "mlp": name("ln2_post.hook_out" if mlp_post else "hook_mlp_out"),
    }
    if not parallel:
        hooks["resid_mid"] = name("hook_resid_mid")
    if mlp_post:
        hooks["mlp_raw"] = name("ln2_post.hook_in")
    if attn_post:
        hooks["attn_raw"] = name("ln1_post.hook_in")
    for key in ("z", "pattern"):  # per-head attribution (origin.heads), where the hooks exist
        if has(f"attn.hook_{key}"):
            hooks[key] = name(f"attn.hook_{key}")
    norm = "ln2" if has("ln2.hook_in") else ("ln1" if parallel and has("ln1.hook_in") else None)
    if norm is not None:
        hooks["norm_in"], hooks["norm_out"] = name(f"{norm}.hook_in"), name(f"{norm}.hook_out")
        if has(f"{norm}.hook_scale"):
            hooks["scale"] = name(f"{norm}.hook_scale")
    elif has("mlp.hook_in"):
        hooks["norm_in"] = name("mlp.hook_in")
    w_in, w_gate, w_out = (_weight(block.mlp, name) for name in ("W_in", "W_gate", "W_out"))
    d_mlp = None if w_out is None else int(w_out.shape[0])
    dense = (w_in is not None and w_out is not None and tuple(w_in.shape) == (view.d_model, d_mlp)
             and tuple(w_out.shape) == (d_mlp, view.d_model) and (w_gate is None or w_gate.shape == w_in.shape)
             and has("mlp.hook_post") and has("mlp.hook_pre")
             and (w_gate is None or has("mlp.hook_pre_linear")) and "norm_in" in hooks)
    gated = dense and w_gate is not None
    if dense:
        hooks.update(post=name("mlp.hook_post"), pre=name("mlp.hook_pre"))
        if gated:
            hooks["up"] = name("mlp.hook_pre_linear")
    experts = None if dense else find_experts(view.model, block.mlp)
    return BlockPlan(layer=layer, parallel=parallel, mlp_norm=norm, dense=dense, gated=gated, post_norm=mlp_post,
                     d_mlp=d_mlp if dense else None, hooks=hooks, experts=experts)


def is_post_norm(view: ModelView) -> bool:
    return view.has_hook(0, "ln2_post.hook_out")


def d_mlp(view: ModelView) -> int:
    """The widest dense MLP's width (``4 * d_model`` when no block has a dense MLP)."""
    widths = []
    for block in view.blocks:
        w_out = _weight(getattr(block, "mlp", None), "W_out")
        if w_out is not None:
            widths.append(int(w_out.shape[0]))
    return max(widths, default=4 * view.d_model)
