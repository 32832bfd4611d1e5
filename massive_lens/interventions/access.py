"""What a model's attention lets an intervention read and edit, probed once per model.

TransformerLens 4.3 bridges differ in what their attention hooks give. Some hand attention
to the Hugging Face module and fire ``attn.hook_pattern`` only after it (OPT, GPT-J,
GPT-Neo, BERT, XGLM, ...): the pattern can be read, but not before ``hook_z`` and an edit
of it is discarded. Some name ``attn.hook_rot_k`` but apply the rotary embedding inside the
module and never fire it (GPT-NeoX, Falcon, Phi-3, Gemma 4, Llama 4, ...): keys after RoPE
cannot be read. Latent attention (DeepSeek-V2/V3) gives values as ``[batch, head, pos,
d_head]`` and a ``hook_z`` that is not per head; JetMoE's mixture of attention heads has
no ``hook_v`` or ``hook_z`` at all.

:func:`attention_access` runs one short forward pass (``n_heads + 1`` tokens, so that a
position axis cannot be mistaken for a head axis) with a reading hook on every attention
hook of every layer, and records which fired, in what order and with what shapes.
:func:`require` turns a missing piece into a :class:`~massive_lens.errors.MassiveLensError`
that names the model, its architecture, the layer and the hook.

>>> from massive_lens import tiny_model
>>> access = attention_access(tiny_model("llama"))[1]
>>> access.before("pattern", "z"), access.key_hook, access.per_head("v")
(True, 'rot_k', True)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

HOOKS = ("q", "k", "v", "rot_q", "rot_k", "cos", "sin", "attn_scores", "pattern", "z")
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {layer: Access}
_EDITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {layer: a pattern edit applies}


@dataclass(frozen=True)
class Access:
    """One attention layer's hooks: ``named`` (the model has them), ``order`` (those that
    fired, in firing order) and ``shapes`` on the probe's ``pos`` tokens."""

    layer: int
    pos: int
    named: frozenset[str] = frozenset()
    order: tuple[str, ...] = ()
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def fires(self, hook: str) -> bool:
        return hook in self.order

    def before(self, first: str, then: str) -> bool:
        """Both fire, ``first`` before ``then``."""
        return self.fires(first) and self.fires(then) and self.order.index(first) < self.order.index(then)

    @property
    def heads(self) -> int | None:
        """The query heads of the pattern (None: it never fires)."""
        shape = self.shapes.get("pattern")
        return shape[1] if shape and len(shape) == 4 else None

    def per_head(self, hook: str) -> bool:
        """Whether ``hook`` fires as ``[batch, pos, head, d_head]`` (keys and values: heads that
        divide the query heads; queries and ``z``: the query heads)."""
        shape, heads = self.shapes.get(hook), self.heads
        if shape is None or heads is None or len(shape) != 4 or shape[1] != self.pos:
            return False
        return shape[2] == heads if hook in ("q", "rot_q", "z") else heads % shape[2] == 0

    def _positioned(self, kind: str) -> str | None:
        """The hook holding queries (``q``) or keys (``k``) as attention uses them: after the
        rotary embedding where the model has one; None when it cannot be read."""
        if self.fires(f"rot_{kind}"):
            return f"rot_{kind}" if self.per_head(f"rot_{kind}") else None
        rotary = any(h in self.named for h in ("rot_q", "rot_k", "cos", "sin"))
        return kind if not rotary and self.per_head(kind) else None

    @property
    def key_hook(self) -> str | None:
        return self._positioned("k")

    @property
    def query_hook(self) -> str | None:
        return self._positioned("q")


def attention_access(model: Any) -> dict[int, Access]:
    """Every layer's :class:`Access` (probed once per model, then cached)."""
    view = ModelView(model)
    if model in _PROBED:
        return _PROBED[model]
    pos = max(2, int(getattr(getattr(model, "cfg", None), "n_heads", 1) or 1) + 1)
    named = {layer: frozenset(h for h in HOOKS if view.has_hook(layer, f"attn.hook_{h}"))
             for layer in range(view.n_layers)}
    order: dict[int, list[str]] = {layer: [] for layer in named}
    shapes: dict[int, dict[str, tuple[int, ...]]] = {layer: {} for layer in named}

    def seen(x: Tensor, hook: Any, *, layer: int, name: str) -> None:
        order[layer].append(name)
        shapes[layer][name] = tuple(x.shape)

    hooks = [(view.block_hook(layer, f"attn.hook_{h}"), partial(seen, layer=layer, name=h))
             for layer, hooks in named.items() for h in sorted(hooks)]
    if hooks:
        view.forward(view.full_batch(probe_tokens(model, pos)), hooks, check_finite=False)
    found = {layer: Access(layer, pos, named[layer], tuple(dict.fromkeys(order[layer])), shapes[layer])
             for layer in named}
    _PROBED[model] = found
    return found


def probe_tokens(model: Any, pos: int) -> Tensor:
    """``[1, pos]`` distinct token ids, none of them padding (a padding id's embedding may be
    zero, and with it every value: an edit would then change nothing)."""
    vocab = int(getattr(model.cfg, "d_vocab", 0) or 2 * pos + 2)
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    ids = [i for i in range(1, vocab) if i != pad][:pos]
    return torch.tensor([ids], dtype=torch.long)


def pattern_edits_apply(model: Any, layer: int) -> bool:
    """Whether zeroing ``attn.hook_pattern`` of ``layer`` changes that block's ``resid_post``
    (probed once per model and layer, on the probe's tokens): a bridge that fires the hook
    after the Hugging Face module used the pattern discards the edit. The probe's tokens are
    never padding: Gemma's and Cohere's padding embedding is zero, which would hide the edit."""
    cache = _EDITS.setdefault(model, {})
    if layer not in cache:
        view = ModelView(model)
        pattern, after = view.hook_name(layer, "attn.hook_pattern"), view.hook_name(layer, "resid_post")
        batch = view.full_batch(probe_tokens(model, attention_access(model)[layer].pos))
        seen: list[Tensor] = []

        def keep(x: Tensor, hook: Any) -> None:
            seen.append(x.detach().clone())

        view.forward(batch, [(after, keep)], stop_after=after, check_finite=False)
        view.forward(batch, [(pattern, lambda p, hook: torch.zeros_like(p)), (after, keep)], stop_after=after,
                     check_finite=False)
        cache[layer] = not torch.equal(seen[0], seen[1])
    return cache[layer]


def architecture(view: ModelView) -> str:
    """`` (SomeForCausalLM)`` when the model's name does not already say its architecture."""
    model = view.model
    arch = getattr(model.cfg, "architecture", None) or type(getattr(model, "original_model", model)).__name__
    return "" if not arch or str(arch) in view.name else f" ({arch})"


def require(model: Any, what: str, layers: Any, *, reads: tuple[str, ...] = (),
            order: tuple[tuple[str, str], ...] = (), per_head: tuple[str, ...] = (),
            positioned: tuple[str, ...] = (), edits_pattern: bool = False) -> None:
    """Raise a clear :class:`MassiveLensError` unless every layer of ``layers`` gives what
    intervention ``what`` needs: the hooks of ``reads`` fire, each pair of ``order`` fires in
    that order (``"query"``: the queries after RoPE), those of ``per_head`` fire per head,
    queries/keys after RoPE (``positioned``: ``"q"``, ``"k"``) can be read, and
    (``edits_pattern``) an edit of ``attn.hook_pattern`` reaches the attention output."""
    view = ModelView(model)
    if not view.serves_patterns:  # a view with no per-head hooks (nnsight): say what runs there instead
        raise view.unsupported(what)
    access = attention_access(model)
    who = f"{view.name}{architecture(view)}"
    for layer in layers:
        a = access[layer]
        for hook in reads:
            if not a.fires(hook):
                why = "the bridge never runs it" if hook in a.named else "the model has no such hook"
                raise MassiveLensError(f"{who}: {what} needs {view.block_hook(layer, 'attn.hook_' + hook)}, but {why}; "
                                       "the massive-activation interventions (ablate_massive) do not need it")
        for kind in positioned:
            if (a.query_hook if kind == "q" else a.key_hook) is None:
                raise MassiveLensError(
                    f"{who}: {what} needs the {'queries' if kind == 'q' else 'keys'} of layer {layer} after the "
                    f"rotary embedding (attn.hook_rot_{kind}), but this architecture's bridge applies it inside "
                    "the Hugging Face module and never fires that hook")
        for first, then in order:
            first = a.query_hook if first == "query" else first
            if not a.before(first, then):
                raise MassiveLensError(
                    f"{who}: {what} needs {view.block_hook(layer, 'attn.hook_' + first)} before hook_{then}, but this "
                    f"architecture's bridge fires it after (it reads the Hugging Face module's attention after "
                    "the fact), so it cannot be used in time; the massive-activation interventions "
                    "(ablate_massive) still work")
        for hook in per_head:
            if not a.per_head(hook):
                raise MassiveLensError(
                    f"{who}: {what} needs {view.block_hook(layer, 'attn.hook_' + hook)} as [batch, pos, head, d_head]; "
                    f"this attention gives {a.shapes.get(hook, 'nothing')} on {a.pos} tokens (e.g. latent or "
                    "compressed attention)")
        if edits_pattern and not pattern_edits_apply(model, layer):
            raise MassiveLensError(
                f"{who}: {what} edits {view.block_hook(layer, 'attn.hook_pattern')}, but this architecture's bridge "
                "fires that hook after the Hugging Face module used the pattern, so an edit would be discarded; "
                "the massive-activation interventions (ablate_massive) still work")
