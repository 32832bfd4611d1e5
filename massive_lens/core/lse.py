"""Attention on a few key columns without the pattern: the kernel's log-sum-exp.

A query's attention to key ``j`` is ``exp(q . k_j * scale - LSE(q))``, where ``LSE(q)`` is the
log of the softmax's denominator. Fused kernels (PyTorch SDPA's flash kernel on CPU,
FlashAttention and the memory-efficient kernel on GPU) never build the ``[head, query, key]``
pattern, but they return the LSE. So an analysis that needs attention on a few key columns
(the sinks, candidate columns, the first token) or on a narrow band (each key's next 64
queries, the sink rule's test) runs the model on that kernel and computes just those entries
from ``q``, ``k`` and the LSE (:class:`~massive_lens.core.layer_attention.LayerAttention`): linear
memory in the length, and no second O(n^2) pass.

:func:`lse_run` does it for a TransformerBridge over a Hugging Face model, and for a view that
runs the Hugging Face model's own decoder layers (nnsight: the view's ``attention_modules()``):
for the length of the block (under :func:`~massive_lens.core.model_lock.model_lock`) each
attention module runs its own Hugging Face code (the bridge's eager re-implementation is set
aside) with its attention function replaced by the kernel that returns the LSE, and each layer's
:class:`LayerAttention` (``q`` after rotary, ``k``, ``v``, the heads' output ``z``, the LSE,
the scale and mask) goes to a callback that reduces it at once. Everything is put back on exit,
exceptions included. :func:`lse_support` says why a model cannot (a HookedTransformer or a
model trained here computes its own pattern; soft caps and position biases are refused by name);
analyses then read the eager pattern instead and say so. A learned sink logit per head (gpt-oss's
``s_aux``: one more key with value zero) is folded into the LSE, so the columns stay exact, and
:attr:`LayerAttention.null_mass` is the attention that goes to it.

The kernel bypasses the bridge's eager attention: hooks on its scores, pattern and rotary never
fire, and ``z`` is read before ``hook_z``. With a hook attached there (:func:`attached_attention_edits`)
:func:`~massive_lens.core.attention_pass.choose_path` takes the eager path under ``"auto"`` and
refuses ``"lse"``: an edit is always read.

>>> from massive_lens import tiny_model
>>> from massive_lens.core.model_view import ModelView
>>> view = ModelView(tiny_model("llama"))
>>> seen = []
>>> with lse_run(view, lambda att: seen.append(att.columns([0])[0, 0, :, 0])):
...     _ = view.forward(view.tokenize("Hello there."), [])
>>> torch.allclose(seen[0], view.activation(view.tokenize("Hello there."), "blocks.0.attn.hook_pattern")[0, 0, :, 0])
True
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.layer_attention import LayerAttention
from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

LSE = "lse"  # attention from q, k and the kernel's log-sum-exp, the model run on SDPA
EAGER = "eager"  # attention read from the eager pattern (hook_pattern)
PATHS = ("auto", LSE, EAGER)
_NAME = "massive_lens_lse"  # the attention implementation registered with transformers


# ---------------------------------------------------------------------------------------------- the kernel
# id(hf module) -> route: (layer, callback, layers seen, the module's rotary (cos, sin) of this call)
_ACTIVE: dict[int, tuple[int, Callable[[LayerAttention], None] | None, set[int], dict[str, Any]]] = {}
_ACTIVE_GUARD = threading.Lock()
_SUPPORT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason (None: supported)
_BYPASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [(name, weakref to hook point)]
_ROTARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why the kernel misses a rotary (None: not)


class _Refused(Exception):
    """Raised inside the kernel for an attention it cannot run exactly (the reason as text)."""


def _kernel(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float
            ) -> tuple[Tensor, Tensor]:
    """SDPA's output ``[batch head query d_head]`` and LSE ``[batch head query]`` from the fused kernel."""
    if query.device.type == "cuda":
        if mask is None and query.dtype in (torch.float16, torch.bfloat16):
            out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scale)
            return out[0], out[1]
        bias = None if mask is None else (
            torch.where(mask, 0.0, float("-inf")).to(query.dtype) if mask.dtype == torch.bool
            else mask.to(query.dtype)).expand(query.shape[0], query.shape[1], -1, -1)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, 0.0,
                                                                     causal and mask is None, scale=scale)
        return out[0], out[1][..., : query.shape[2]]
    if mask is not None and mask.dtype == torch.bool:  # the CPU kernel adds a mask of the query's dtype
        mask = torch.zeros((), dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal and mask is None,
                                                                     attn_mask=mask, scale=scale)


def _lse_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                   **kwargs: Any) -> tuple[Tensor, None]:
    """The attention function registered with transformers: SDPA through the kernel that returns
    the LSE, each layer handed to the active run's callback."""
    route = _ACTIVE.get(id(module))
    for name, what in (("softcap", "a soft cap on the attention logits"),
                       ("position_bias", "a position bias (ALiBi or relative)")):
        if kwargs.get(name) is not None:
            raise _Refused(f"its attention applies {what} ({name}), which the fused kernel does not")
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if sinks is not None and sinks.numel() != query.shape[1]:
        raise _Refused(f"its learned sink logits have {sinks.numel()} entries for {query.shape[1]} heads")
    if dropout:
        raise _Refused("its attention applies dropout (the model is in training mode)")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    group = query.shape[1] // key.shape[1]
    k, v = (key, value) if group == 1 else (key.repeat_interleave(group, 1), value.repeat_interleave(group, 1))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    out, lse = _kernel(query, k, v, attention_mask, causal, scale)
    if sinks is not None:  # one more key per head, logit s and value zero: in the normaliser, not in the sum
        sinks = sinks.detach().float().reshape(-1).to(lse.device)
        full = torch.logaddexp(lse.float(), sinks[None, :, None])
        out = (out.float() * torch.exp(lse.float() - full).nan_to_num(0.0)[..., None]).to(out.dtype)
        lse = full
    if route is not None:
        layer, callback, seen, inputs = route
        seen.add(layer)
        if callback is not None:
            callback(LayerAttention(layer, query, key, value, out, lse, scale, attention_mask,
                                    causal and attention_mask is None, sinks, rotary=inputs.get("rotary")))
    return out.transpose(1, 2), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if _NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(_NAME, _lse_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_NAME, sdpa_mask)


def _attention_modules(view: ModelView) -> tuple[list[tuple[int, Any, Any]], str | None]:
    """``(layer, bridge attention or None, HF attention)`` of every attention layer, or why there are none."""
    own = view.attention_modules()  # a view over the HF model's own layers (nnsight) lists them itself
    if own is not None:
        bad = next(((layer, hf) for layer, hf in own if not _dispatches(hf)), None)
        if bad is not None:
            return [], (f"layer {bad[0]}'s attention ({type(bad[1]).__name__}) is not a Hugging Face attention "
                        "module that dispatches through transformers' attention functions")
        return [(layer, None, hf) for layer, hf in own], None if own else "it has no attention layer"
    if not hasattr(view.model, "original_model"):
        return [], (f"{type(view.model).__name__} is not a TransformerBridge over a Hugging Face model (a "
                    "HookedTransformer or a model trained here computes its own attention pattern)")
    try:
        from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
    except ImportError:  # pragma: no cover - a TransformerLens without the bridge
        return [], "this TransformerLens has no TransformerBridge"
    found = []
    for layer in range(view.n_layers):
        if not view.has_hook(layer, "attn.hook_pattern"):
            continue  # a layer without attention (recurrent, state-space)
        attn = getattr(view.block(layer), "attn", None)
        hf = getattr(attn, "original_component", None)
        if not isinstance(attn, AttentionBridge) or not _dispatches(hf):
            return [], (f"layer {layer}'s attention ({type(hf).__name__}) is not a Hugging Face attention module "
                        "that dispatches through transformers' attention functions")
        found.append((layer, attn, hf))
    if not found:
        return [], "it has no attention layer"
    return found, None


def _dispatches(hf: Any) -> bool:
    """Whether ``hf`` looks like a Hugging Face attention module that picks its attention function
    by its config's ``_attn_implementation``."""
    return hasattr(getattr(hf, "config", None), "_attn_implementation")


def _hint(view: ModelView) -> str:
    """What to do instead of the LSE path: the eager pattern, where the view serves one."""
    return "; use attention='eager'" if view.serves_patterns else ""


@contextlib.contextmanager
def lse_run(view: ModelView, callback: Callable[[LayerAttention], None] | None = None, *,
            implementation: str = _NAME) -> Iterator[set[int]]:
    """Run ``view``'s model on the fused kernel for the block, each attention layer's
    :class:`LayerAttention` handed to ``callback`` as it runs; yields the set of layers seen.

    ``implementation="sdpa"``: transformers' own SDPA (a plain SDPA forward, nothing captured).
    The model is put back on exit (attention forwards, attention implementation), exceptions
    included. A model that cannot is a :class:`MassiveLensError` naming why (see
    :func:`lse_support`)."""
    modules, reason = _attention_modules(view)
    if reason is not None:
        raise MassiveLensError(f"{view.name} cannot run on the fused attention kernel: {reason}{_hint(view)}")
    _register()

    seen: set[int] = set()
    with model_lock(view.model), contextlib.ExitStack() as stack:
        configs = {id(c): c for m in view.model.original_model.modules()
                   if hasattr(c := getattr(m, "config", None), "_attn_implementation_internal")}
        saved = {key: c._attn_implementation_internal for key, c in configs.items()}
        stack.callback(_restore_configs, configs, saved)
        for layer, attn, hf in modules:
            if attn is not None:  # a bridge: its attention component runs the HF module's own forward
                _own_forward(attn, stack)
            inputs: dict[str, Any] = {}  # the module's rotary (cos, sin), kept by a pre-hook as it is called
            stack.callback(hf.register_forward_pre_hook(partial(_keep_rotary, inputs=inputs), with_kwargs=True).remove)
            with _ACTIVE_GUARD:
                _ACTIVE[id(hf)] = (layer, callback, seen, inputs)
            stack.callback(_ACTIVE.pop, id(hf), None)
        for c in configs.values():
            c._attn_implementation_internal = implementation
        try:
            yield seen
        except _Refused as exc:
            raise MassiveLensError(f"{view.name} cannot run on the fused attention kernel: {exc}"
                                   f"{_hint(view)}") from None


def _keep_rotary(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, inputs: dict[str, Any]) -> None:
    """Keep the rotary ``(cos, sin)`` a Hugging Face attention module is called with (its
    ``position_embeddings``: what a bridge's ``attn.hook_cos``/``hook_sin`` show on the eager path); None
    where it gets none (no rotary, or a complex form)."""
    rotary = kwargs.get("position_embeddings")
    real = isinstance(rotary, tuple) and len(rotary) == 2 and all(
        isinstance(x, Tensor) and x.is_floating_point() for x in rotary)
    inputs["rotary"] = rotary if real else None


def _own_forward(attn: Any, stack: contextlib.ExitStack) -> None:
    """Run a bridge attention component through ``AttentionBridge.forward`` (the HF module's own code)
    for the length of ``stack``, where a subclass re-implements it eagerly."""
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    if type(attn).forward is not AttentionBridge.forward and "forward" not in attn.__dict__:
        object.__setattr__(attn, "forward", types.MethodType(AttentionBridge.forward, attn))
        stack.callback(attn.__dict__.pop, "forward", None)


def _restore_configs(configs: dict[int, Any], saved: dict[int, Any]) -> None:
    for key, c in configs.items():
        c._attn_implementation_internal = saved[key]


def lse_support(view: ModelView) -> str | None:
    """None when ``view``'s model runs exactly on the fused kernel (checked once per model on a
    few tokens: every attention layer dispatched to it and none was refused), else why not."""
    reason = _SUPPORT.get(view.model, "unknown") if _weakrefable(view.model) else "unknown"
    if reason != "unknown":
        return reason
    modules, reason = _attention_modules(view)
    if reason is None:
        batch = view.full_batch(torch.zeros(1, 4, dtype=torch.long))
        hook_dict = view.model.hook_dict if view.serves_patterns else {}  # nnsight: no hook points
        points, on_eager, on_lse, shown = _hook_points(hook_dict), set(), set(), set()
        try:
            with model_lock(view.model), _firing(points, on_lse), \
                    lse_run(view, lambda att: shown.add(att.layer) if att.rotary is not None else None) as seen:
                view.forward(batch, [], check_finite=False)
            with contextlib.suppress(Exception), model_lock(view.model), _firing(points, on_eager):
                if points:  # failed (a user's hook): every hooked point counts
                    view.forward(batch, [], check_finite=False)
            z = {id(hp) for name, hp in hook_dict.items() if name.endswith("attn.hook_z")}
            if on_eager and _weakrefable(view.model):  # honoured: fires on both paths, and not z (read before hook_z)
                _BYPASSED[view.model] = [(name, weakref.ref(hp)) for key, (name, hp) in points.items()
                                         if key not in on_eager & on_lse or key in z]
            if _weakrefable(view.model):
                _ROTARY[view.model] = _rotary_gap(view, modules, hook_dict, on_eager, shown)
            missing = sorted({layer for layer, _, _ in modules} - seen)
            if missing:
                reason = (f"layer {missing[0]}'s attention does not dispatch through transformers' attention "
                          "functions, so no kernel gives its LSE")
        except MassiveLensError as exc:
            reason = str(exc).split(": ", 1)[-1].removesuffix(_hint(view))
        except Exception as exc:  # noqa: BLE001 - any architecture-specific failure means: not this way
            reason = f"its Hugging Face attention failed on the kernel ({type(exc).__name__}: {str(exc)[:160]})"
    if _weakrefable(view.model):
        _SUPPORT[view.model] = reason
    return reason


def _rotary_gap(view: ModelView, modules: list[tuple[int, Any, Any]], hook_dict: dict[str, Any], on_eager: set[int],
                shown: set[int]) -> str | None:
    """Why the kernel's run misses a rotary ``(cos, sin)`` that the eager path shows (``attn.hook_cos``
    fired there, in ``on_eager``) at some layer (its module got no ``position_embeddings``); None if none."""
    eager = sorted(layer for layer, _, _ in modules if view.has_hook(layer, "attn.hook_cos")
                   and id(hook_dict.get(view.hook_name(layer, "attn.hook_cos"))) in on_eager)
    missed = [layer for layer in eager if layer not in shown]
    return None if not missed else (f"layer {missed[0]}'s attention rotates by a (cos, sin) that its eager hooks "
                                    "show but its Hugging Face module is not called with (position_embeddings)")


def lse_rotary(view: ModelView) -> str | None:
    """None when the LSE path hands every attention layer the rotary ``(cos, sin)`` that the eager
    path's ``attn.hook_cos``/``hook_sin`` show (the ``position_embeddings`` its Hugging Face module is
    called with; none where the model has no rotary), else why not (also where the model has no
    LSE path: :func:`lse_support`'s reason). Measured once per model, by :func:`lse_support`.

    >>> from massive_lens import tiny_model
    >>> from massive_lens.core.model_view import ModelView
    >>> lse_rotary(ModelView(tiny_model("llama"))) is None
    True
    """
    reason = lse_support(view)
    if reason is not None:
        return reason
    return _ROTARY.get(view.model) if _weakrefable(view.model) else None


def _weakrefable(model: Any) -> bool:
    try:
        weakref.ref(model)
    except TypeError:
        return False
    return True


def _hook_points(hook_dict: dict[str, Any]) -> dict[int, tuple[str, Any]]:
    """Each distinct hook point (a bridge lists one under several names) by ``id``: its shortest
    name (TransformerLens's ``blocks.1.attn.hook_z`` before ``blocks.1.attn.o.hook_in``) and itself."""
    points: dict[int, tuple[str, Any]] = {}
    for name, hp in sorted(hook_dict.items(), key=lambda item: (len(item[0]), item[0]), reverse=True):
        points[id(hp)] = (name, hp)
    return points


@contextlib.contextmanager
def _firing(points: dict[int, tuple[str, Any]], fired: set[int]) -> Iterator[None]:
    """Record in ``fired`` the ``id`` of every hook point of ``points`` that runs in the block (plain
    torch hooks, removed on exit)."""
    with contextlib.ExitStack() as stack:
        for key, (_, hp) in points.items():
            stack.callback(hp.register_forward_hook(lambda *_, key=key: fired.add(key)).remove)
        yield


def _attached(hp: Any) -> bool:
    """Whether a hook point holds a forward hook now (TransformerLens keeps its hooks as torch's)."""
    return bool(getattr(hp, "_forward_hooks", None) or getattr(hp, "_forward_pre_hooks", None))


def attached_attention_edits(view: ModelView, hooks: Sequence[tuple[Any, Any]] = ()) -> list[str]:
    """The hook points holding a hook now (a user's ``add_hook`` or ``model.hooks(...)``, an entered
    intervention), or named in ``hooks`` (the caller's own, to run in the same forward, by name or by a
    filter of names), that the LSE
    path would not honour: those that do not fire on both paths
    (``hook_attn_scores``, ``hook_pattern``, the rotary hooks; measured once per model by
    :func:`lse_support`) and ``hook_z``, whose input the LSE path reads from the kernel. On a model
    without the LSE path every hooked point counts; an nnsight model has none (it edits in a trace).

    >>> from massive_lens import tiny_model
    >>> from massive_lens.core.model_view import ModelView
    >>> model = tiny_model("llama")
    >>> with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", lambda x, hook: x),
    ...                             ("blocks.1.hook_resid_post", lambda x, hook: x)]):
    ...     attached_attention_edits(ModelView(model))
    ['blocks.1.attn.hook_pattern']
    """
    if not view.serves_patterns:  # nnsight: no hook points
        return []
    hook_dict = view.model.hook_dict
    named = set()
    for name, _ in hooks:  # a hook point's name, or a filter of names (TransformerLens takes both)
        if callable(name):
            named |= {id(hp) for point, hp in hook_dict.items() if name(point)}
        elif name in hook_dict:
            named.add(id(hook_dict[name]))
    with model_lock(view.model):  # another thread's analysis holds its own hooks only while it holds the lock
        bypassed = _BYPASSED.get(view.model) if lse_support(view) is None and _weakrefable(view.model) else None
        if bypassed is None:
            return sorted(name for name, hp in _hook_points(hook_dict).values() if _attached(hp) or id(hp) in named)
        return sorted(name for name, ref in bypassed
                      if (hp := ref()) is not None and (_attached(hp) or id(hp) in named))


def path_text(path: str) -> str:
    """How the attention was read, for summaries."""
    return ("attention from q, k and the SDPA kernel's log-sum-exp (no pattern)" if path == LSE
            else "attention read from the eager pattern")
