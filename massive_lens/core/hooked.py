"""A ``HookedTransformer`` (TransformerLens 3.x) seen with a ``TransformerBridge``'s hook names.

Both kinds share the familiar vocabulary (``blocks.{l}.hook_resid_post``,
``blocks.{l}.attn.hook_pattern``, ``blocks.{l}.mlp.hook_post``, ...), but a bridge also
names a few points that a ``HookedTransformer`` reaches under another name or not at all:

================================  =====================================================
bridge name                       what it is on a ``HookedTransformer``
================================  =====================================================
``blocks.{l}.attn.hook_out``      ``blocks.{l}.hook_attn_out``
``blocks.{l}.mlp.hook_out``       ``blocks.{l}.hook_mlp_out``
``blocks.{l}.ln1.hook_in``        ``blocks.{l}.hook_resid_pre``
``blocks.{l}.ln2.hook_in``        ``blocks.{l}.hook_resid_mid`` (``hook_resid_pre`` in a parallel block)
``blocks.{l}.ln1.hook_out``       ``blocks.{l}.ln1.hook_normalized`` times the norm's ``w`` (plus ``b``)
``blocks.{l}.ln2.hook_out``,      ``blocks.{l}.ln2.hook_normalized`` times the norm's ``w`` (plus ``b``)
``blocks.{l}.mlp.hook_in``
================================  =====================================================

:func:`hook_aliases` lists them for one model and :func:`translate` rewrites a hook list, so
:class:`~massive_lens.core.model_view.ModelView` offers every analysis one vocabulary. A
renamed hook may edit; a computed one (a norm's output) is read-only.

Weight processing. ``HookedTransformer.from_pretrained`` processes weights by default
(``fold_ln``, ``center_writing_weights``, ``center_unembed``, ``fold_value_biases``);
:func:`weight_processing` detects what was applied (from ``cfg.normalization_type`` and the
weights themselves) and :data:`PROCESSING` says what each changes in the numbers.

>>> class HookedTransformer:  # any class of that name (TL 3.x's, or a subclass) counts
...     pass
>>> is_hooked_transformer(HookedTransformer()), is_hooked_transformer(object())
(True, False)
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from massive_lens.errors import MassiveLensError

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HookedTransformer -> weights checked

PROCESSING = {
    "fold_ln": "the norms' weights are folded into the next linear layers (W_Q, W_K, W_V, W_in, W_gate, W_U), so "
               "the norms' outputs, hook_q/k/v and single weights differ; the residual stream does not change",
    "center_writing_weights": "every weight that writes into the residual stream (W_E, W_pos, W_O, W_out) has its "
                              "mean over d_model removed, so each residual vector loses its mean: the values and "
                              "ratios of massive activations change",
    "center_unembed": "W_U has its mean over the vocabulary removed: logits shift by a constant per position "
                      "(probabilities and losses do not change)",
    "fold_value_biases": "b_V is folded into b_O, so hook_v and hook_z lose the value bias and decompose_attention's "
                         "sink/content/bias split moves; the attention output does not change",
}
_CENTRED = 1e-5  # |mean| / rms below which a weight counts as centred (raw weights sit near 1e-2)


@dataclass(frozen=True)
class Alias:
    """A bridge hook name read at ``target``; ``norm`` set: through that norm's affine weights."""

    target: str
    norm: Any = None


def is_hooked_transformer(model: Any) -> bool:
    """Whether ``model`` is a ``HookedTransformer`` (or a subclass), by class name: TransformerLens
    4.x has no such class to import."""
    return any(cls.__name__ == "HookedTransformer" for cls in type(model).__mro__)


def hook_aliases(model: Any, native: frozenset[str]) -> dict[str, Alias]:
    """The bridge hook names ``model`` lacks, each with the native hook it is read at (empty
    for anything but a ``HookedTransformer``)."""
    if not is_hooked_transformer(model):
        return {}
    parallel = bool(getattr(model.cfg, "parallel_attn_mlp", False))
    aliases: dict[str, Alias] = {}
    for layer, block in enumerate(model.blocks):
        p = f"blocks.{layer}."
        wanted = {
            "attn.hook_out": Alias(p + "hook_attn_out"),
            "mlp.hook_out": Alias(p + "hook_mlp_out"),
            "ln1.hook_in": Alias(p + "hook_resid_pre"),
            "ln2.hook_in": Alias(p + ("hook_resid_pre" if parallel else "hook_resid_mid")),
            "ln1.hook_out": Alias(p + "ln1.hook_normalized", getattr(block, "ln1", None)),
            "ln2.hook_out": Alias(p + "ln2.hook_normalized", getattr(block, "ln2", None)),
            "mlp.hook_in": Alias(p + "ln2.hook_normalized", getattr(block, "ln2", None)),
        }
        for name, alias in wanted.items():
            if p + name not in native and alias.target in native:
                aliases[p + name] = alias
    return aliases


def translate(fwd_hooks: list[tuple[Any, Any]], aliases: dict[str, Alias]) -> list[tuple[Any, Any]]:
    """``fwd_hooks`` with every aliased name moved to its native hook (the hook function still
    sees the name it asked for, as ``hook.name``)."""
    if not aliases:
        return fwd_hooks
    out = []
    for name, fn in fwd_hooks:
        alias = aliases.get(name) if isinstance(name, str) else None
        out.append((name, fn) if alias is None else (alias.target, _aliased(fn, name, alias)))
    return out


def weight_processing(model: Any) -> list[str]:
    """Which of TransformerLens's weight processing steps ``model`` (a ``HookedTransformer``)
    shows: ``fold_ln`` from ``cfg.normalization_type`` (``LNPre``/``RMSPre``), the others
    from the weights (centred rows of ``W_E`` in a LayerNorm model, centred ``W_U``, value
    biases all zero while output biases are not)."""
    if not is_hooked_transformer(model):
        return []
    cfg = model.cfg
    kind = str(getattr(cfg, "normalization_type", None))
    found = ["fold_ln"] if kind.endswith("Pre") else []
    with torch.no_grad():
        W_E = getattr(getattr(model, "embed", None), "W_E", None)
        if kind.startswith("LN") and _centred(W_E, -1):
            found.append("center_writing_weights")
        if _centred(getattr(getattr(model, "unembed", None), "W_U", None), -1):
            found.append("center_unembed")
        b_V = [_param(block.attn, "b_V") for block in model.blocks]
        b_O = [_param(block.attn, "b_O") for block in model.blocks]
        if all(b is not None and not b.any() for b in b_V) and any(b is not None and b.any() for b in b_O):
            found.append("fold_value_biases")
    return found


def processing_warning(name: str, steps: list[str]) -> str:
    """The warning for a processed ``HookedTransformer``: each step and what it changes."""
    what = "; ".join(f"{step}: {PROCESSING[step]}" for step in steps)
    return (f"{name} is a HookedTransformer with processed weights ({', '.join(steps)}). {what}. massive_lens "
            "studies the raw residual stream: load it with HookedTransformer.from_pretrained_no_processing(...) "
            "or massive_lens.load_model(name, backend='hooked')")


class _NamedHook:
    """The native HookPoint, answering to the (alias) name the analysis asked for."""

    def __init__(self, hook: Any, name: str):
        self._hook, self.name = hook, name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._hook, attr)


def _aliased(fn: Any, name: str, alias: Alias) -> Any:
    def hook_fn(x: Tensor, hook: Any) -> Any:
        shown = _NamedHook(hook, name)
        if alias.norm is None:
            return fn(x, hook=shown)
        if fn(_affine(x, alias.norm), hook=shown) is not None:
            raise MassiveLensError(f"{name} is read-only on a HookedTransformer (it is computed from "
                                   f"{alias.target} and the norm's weights); edit {alias.target} instead")
        return None

    return hook_fn


def _affine(x: Tensor, norm: Any) -> Tensor:
    """A norm's output from its ``hook_normalized`` value: ``x * w + b`` (``LNPre``/``RMSPre``
    norms have neither: their normalised value is the output)."""
    w, b = getattr(norm, "w", None), getattr(norm, "b", None)
    out = x if w is None else x * w.to(x.dtype)
    return out if b is None else out + b.to(x.dtype)


def _centred(weight: Any, dim: int) -> bool:
    if not isinstance(weight, Tensor) or weight.numel() == 0:
        return False
    w = weight.detach().float()
    return bool((w.mean(dim).abs() <= _CENTRED * w.pow(2).mean(dim).sqrt().clamp(min=1e-12)).all())


def _param(module: Any, name: str) -> Tensor | None:
    value = getattr(module, name, None)
    if not isinstance(value, Tensor):
        value = getattr(module, "_" + name, None)  # grouped-query attention keeps the kv biases as _b_V
    return value if isinstance(value, Tensor) else None


def warn_if_processed(model: Any, name: str) -> None:
    """Warn when a HookedTransformer's weights were processed (:func:`weight_processing`): once per model
    and state of its weights (a weight changed in place counts as a new state)."""
    if not is_hooked_transformer(model):
        return
    state = (str(getattr(model.cfg, "normalization_type", None)), tuple(p._version for p in model.parameters()))
    try:
        if _CHECKED.get(model) == state:
            return
        _CHECKED[model] = state
    except TypeError:  # not weak-referenceable: check every time
        pass
    steps = weight_processing(model)
    if steps:
        warnings.warn(processing_warning(name, steps), UserWarning, stacklevel=4)
