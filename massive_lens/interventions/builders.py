"""Causal tests of the claim that massive activations and attention sinks act as a fixed bias.

Sun et al. (2024, sections 3-4) argue that the few massive activations, and the attention
that sink tokens draw because of them, work like bias terms: what matters is that they are
there and (nearly) constant, not what the input says. Each intervention here edits one
part of that story during the forward pass, and :func:`massive_lens.perplexity`
judges the result:

- :func:`ablate_massive`: set the massive activations to zero, to their calibration mean,
  or to a value, at the layer where each first appears (``where="first"``, the paper's
  choice) or at every layer where it is massive in calibration (``where="every"``: a model
  can rebuild a value zeroed once); ``control=True`` zeroes the same number of
  median-magnitude activations instead;
- :func:`fix_sink_term`: replace each head's sink term ``sum_{i in C} p_ki v_i`` by its
  calibration mean (the fixed-bias hypothesis predicts no loss) or by zero;
- :func:`remove_sink_attention`: drop the attention paid to sink positions (renormalized);
- :func:`bias_surgery`: section 4.3 on a pretrained model: each head gets an explicit extra
  key/value slot ``(k', v')`` (the calibration means of the sink keys and values, keys after
  RoPE, exact for a sink at position 0), the sink positions are masked out, and the massive
  activations are zeroed. If perplexity holds, the sink was only ever a bias;
- :func:`patch_sink_from`: patch the sink positions' residual stream from another text;
- :func:`observe`: no edit; measures what the others measure, on the untouched model.

The sink set C is what draws attention as a sink or carries a persistent massive activation
(:class:`~massive_lens.core.criterion.SinkRule`). Pass it (``sinks=``, e.g. from
:func:`~massive_lens.attention.find_sinks` on the same tokens) to use exactly that;
otherwise each forward pass finds it *online* with the rule fitted at calibration (see
:mod:`massive_lens.interventions.calibration`). Attention interventions apply to the layers
after the sinks first carry a massive activation (all layers when they carry none).

Every intervention checks itself: it records, on whatever it runs on, what its targets hold
downstream (the massive dims' ``|value|`` at every later layer, the attention still paid to
the sinks; :mod:`massive_lens.interventions.checks`); :meth:`Intervention.check` sets that
against the untouched model, and :func:`~massive_lens.run_interventions` does so for every
row of Table 3. Each also says where it acts relative to the model's norms
(``acts_on``): on post-norm models (Gemma 2/3) an edit of the residual stream is exact,
while an edit inside attention is followed by the post-attention norm.

Every intervention is an :class:`Intervention`: a context manager (``with fix_sink_term(m):``)
that is also a hook list (``model.hooks(fwd_hooks=iv.fwd_hooks)``, ``perplexity(hooks=iv)``).
All are built by one generic builder, :func:`build_hooks`, from small edit functions bound with
``functools.partial``, like TransformerLens's ``patching.py``.

>>> from massive_lens import tiny_model
>>> model = tiny_model("llama")
>>> with remove_sink_attention(model, calibration="Some calibration text. " * 8) as iv:
...     logits = model(torch.tensor([[256, 72, 105]]))
>>> iv.name, logits.shape[-1] > 0, iv.record.sinks[0].tolist()
('sink_attention_removed', True, [[True, False, False]])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.attention import find_sinks
from massive_lens.attention.sinks import Sinks, SinkSet
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.access import attention_access, require
from massive_lens.interventions.arm_stats import ARMS, arm_fill, refuse_old, template_hooks
from massive_lens.interventions.assemble import acts_on, build_hooks, calibration_of, observe, observer
from massive_lens.interventions.edits import (
    add_slot_value,
    drop_sinks,
    keep,
    patch_positions,
    put_template,
    replace_sink_term,
    slot_pattern,
)
from massive_lens.interventions.intervention import WHERE, Intervention
from massive_lens.interventions.sink_stats import unpad
from massive_lens.interventions.state import HookState, stash

__all__ = ["Intervention", "ablate_massive", "bias_surgery", "fix_sink_term", "observe", "patch_sink_from",
           "remove_sink_attention"]
MODES = ("zero", "mean", *ARMS)  # ablate_massive's named modes


def ablate_massive(model: Any, mode: str | float = "zero", *, calibration: Any = None,
                   control: bool = False, where: str = "first", seed: int = 0, sinks: Sinks = None) -> Intervention:
    """Set the massive activations to ``"zero"``, their calibration ``"mean"``, a control arm
    (``"resample"``, ``"noise"``, ``"template"``: :mod:`~massive_lens.interventions.arm_stats`) or a number, at
    the layer where each dim first appears (``where="first"``) or at every layer where it is
    massive in calibration (``where="every"``). ``control=True``: zero as many
    median-magnitude activations instead (same layers, same count per sequence).

    ``first`` is the paper's choice; a model may rebuild a value zeroed once a few layers
    later, which the intervention's own check (``record``, :meth:`Intervention.check`)
    shows; ``every`` then keeps it removed. With ``every``, each layer edits the positions
    where the dim is massive now and those it was massive at in its first layer.

    Args:
        model: a TransformerLens-style model.
        mode: ``"zero"`` (default), ``"mean"`` (each dim's calibration mean at its massive
            entries of that layer), ``"resample"`` (a calibration value of that dim, layer and
            token kind), ``"noise"`` (a Gaussian draw with its calibration mean and variance),
            ``"template"`` (zeroed, and every later norm's output at the targeted positions set to
            the calibrated post-norm vector) or a number every massive entry is set to.
        calibration: calibration text (a corpus; None: the offline default text) or a
            :class:`~massive_lens.interventions.Calibration` from
            :func:`~massive_lens.calibrate`; use other text than the evaluation text.
        control: zero the same number of median-magnitude, non-massive activations per
            sequence instead (needs ``mode="zero"``).
        where: ``"first"`` (default) or ``"every"`` (not with ``"template"``, which restores every later layer).
        seed: the seed of the ``resample`` and ``noise`` draws.
        sinks: a :class:`~massive_lens.attention.SinkSet` of the tokens it runs on (as
            :func:`~massive_lens.run_interventions` passes): ``resample`` matches its token kinds
            (None: the first token ``bos``, the rest ``other``); otherwise unused.

    Returns:
        An :class:`Intervention` named after ``mode`` (``"zero"``, ``"resample"``, ...), ``"value=<mode>"`` or
        ``"control"`` (with ``_every`` appended for ``where="every"``).

    Raises:
        MassiveLensError: if the calibration text has no massive activations, ``mode`` (a
            non-finite number included) or ``where`` is none of the above, ``control=True`` with a
            ``mode`` other than ``"zero"``, or the Calibration predates the arm's statistics.

    >>> from massive_lens import tiny_model
    >>> ablate_massive(tiny_model("llama"), calibration="No massive activations here. " * 5)
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: tiny-llama has no token-specific massive activations in the calibration ...
    """
    if where not in WHERE:
        raise MassiveLensError(f"where must be 'first' (the layer where each dim first appears) or 'every' "
                               f"(every layer where it is massive), got {where!r}")
    number = isinstance(mode, (int, float)) and not isinstance(mode, bool)
    if not (mode in MODES if isinstance(mode, str) else number and math.isfinite(mode)):
        raise MassiveLensError(f"mode must be one of {', '.join(map(repr, MODES))} or a finite number, got {mode!r}")
    if mode == "template" and where != "first":
        raise MassiveLensError("mode='template' restores the post-norm vector at every later layer: use where='first'")
    if control and mode != "zero":
        raise MassiveLensError("the control zeroes median-magnitude activations: use mode='zero' with control=True")
    calib = calibration_of(model, calibration)
    if not calib.dims:
        excluded = (f"; the outlier dimensions ({calib.outlier_text()}, massive at most tokens of a layer) were "
                    "left out: calibrate(..., outliers='include') ablates them too"
                    if len(calib.outlier_dims) and calib.criterion.outliers == "exclude" else "")
        raise MassiveLensError(
            f"{ModelView(model).name} has no token-specific massive activations in the calibration text "
            f"({calib.source}, criterion {calib.criterion}){excluded}; nothing to ablate. Use more or other "
            "calibration text, or a looser Criterion")
    old = refuse_old(calib, mode, ModelView(model).name) if isinstance(mode, str) else None
    if old:
        raise MassiveLensError(old)
    kinds = sinks.kinds if isinstance(sinks, SinkSet) else None

    def fill(layer: int, dims: list[int]) -> Tensor | Any:
        if isinstance(mode, str):
            return arm_fill(calib, mode, layer, dims, seed=seed, kinds=kinds)
        return torch.full((len(dims),), float(mode))

    name = "control" if control else (mode if isinstance(mode, str) else f"value={mode:g}")
    name += "_every" if where == "every" else ""
    state = HookState(calib)
    hooks = build_hooks(model, calib, state, fill=fill, where=where, control=control, measure_massive=True)
    if mode == "template":  # the norms of every layer after the last first-massive layer read the template
        hooks += template_hooks(ModelView(model), calib.template, calib.template_seen, after=max(calib.dims),
                                put=partial(put_template, state=state))
    layers = calib.dims if where == "first" else calib.dims_at
    removes = not control and (mode in ("zero", "template") or (not isinstance(mode, str) and float(mode) == 0.0))
    return Intervention(model, name, hooks, state=state, acts_on=acts_on(model, resid=list(layers)), where=where,
                        removes=removes, edits_massive=True, observer=observer(model, calib, None))


def fix_sink_term(model: Any, mode: str = "mean", *, calibration: Any = None, sinks: Sinks = None) -> Intervention:
    """Replace every head's sink term by its calibration mean (``"mean"``) or zero, at all
    non-sink query positions of the layers after the sinks carry massive activations.

    Args:
        model: a TransformerLens-style model.
        mode: ``"mean"`` (default: each head's calibration mean, the fixed-bias hypothesis)
            or ``"zero"``.
        calibration: calibration text (a corpus; None: the offline default text) or a
            :class:`~massive_lens.interventions.Calibration` from
            :func:`~massive_lens.calibrate`; use other text than the evaluation text.
        sinks: the sinks (a bool ``[batch, pos]`` mask of the tokens it will run on, a
            :class:`~massive_lens.attention.SinkSet`, or a list of positions); None: found
            online with the calibrated rule.

    Returns:
        An :class:`Intervention` named ``"sink_term_mean"`` or ``"sink_term_zero"``.

    Raises:
        MassiveLensError: if ``mode`` is not ``"mean"`` or ``"zero"``, or ``sinks`` is not
            a bool mask or a non-empty list of positions.

    >>> from massive_lens import tiny_model
    >>> len(fix_sink_term(tiny_model("gpt2"), calibration="Calibrate on this. " * 10)) > 0
    True
    """
    if mode not in ("mean", "zero"):
        raise MassiveLensError(f"fix_sink_term mode must be 'mean' or 'zero', got {mode!r}")
    calib = calibration_of(model, calibration)
    require(model, f"fix_sink_term (mode={mode!r})", calib.attn_layers, reads=("pattern", "v", "z"),
            order=(("pattern", "z"), ("v", "z")), per_head=("v", "z"))
    if mode == "mean":
        _measured(model, calib, "sink_z", "fix_sink_term (mode='mean')")

    def per_layer(view: ModelView, layer: int, state: HookState) -> list:
        mean = unpad(calib.sink_z[layer]) if mode == "mean" else None
        return [(view.hook_name(layer, "attn.hook_pattern"), partial(stash, state=state, key="pattern")),
                (view.hook_name(layer, "attn.hook_v"), partial(stash, state=state, key="v")),
                (view.hook_name(layer, "attn.hook_z"), partial(replace_sink_term, state=state, mean=mean))]

    state = HookState(calib, sinks)
    hooks = build_hooks(model, calib, state, per_layer=per_layer, measure_attention=True)
    return Intervention(model, f"sink_term_{mode}", hooks, state=state, uses_sinks=True,
                        acts_on=acts_on(model, attn=calib.attn_layers, inside="each head's output z (before W_O)"),
                        observer=observer(model, calib, sinks))


def remove_sink_attention(model: Any, *, renormalize: bool = True, calibration: Any = None,
                          sinks: Sinks = None) -> Intervention:
    """Drop the attention paid to sink positions (and renormalize each query's row).

    Applies to the layers after the sinks carry massive activations (all layers when they
    carry none); sink queries keep their own attention.

    Args:
        model: a TransformerLens-style model.
        renormalize: rescale each query's remaining attention to sum to one (default); a
            query with nothing left keeps its original row. False: only drop it.
        calibration: calibration text (a corpus; None: the offline default text) or a
            :class:`~massive_lens.interventions.Calibration` from
            :func:`~massive_lens.calibrate`; use other text than the evaluation text.
        sinks: the sinks (a bool ``[batch, pos]`` mask of the tokens it will run on, a
            :class:`~massive_lens.attention.SinkSet`, or a list of positions); None: found
            online with the calibrated rule.

    Returns:
        An :class:`Intervention` named ``"sink_attention_removed"``.

    Raises:
        MassiveLensError: if ``sinks`` is not a bool mask or a non-empty list of positions.

    >>> from massive_lens import tiny_model
    >>> remove_sink_attention(tiny_model("gemma3"), calibration="Text. " * 30).name
    'sink_attention_removed'
    """
    calib = calibration_of(model, calibration)
    require(model, "remove_sink_attention", calib.attn_layers, reads=("pattern",), edits_pattern=True)

    def per_layer(view: ModelView, layer: int, state: HookState) -> list:
        return [(view.hook_name(layer, "attn.hook_pattern"),
                 partial(drop_sinks, state=state, renormalize=renormalize))]

    state = HookState(calib, sinks)
    hooks = build_hooks(model, calib, state, per_layer=per_layer, measure_attention=True)
    return Intervention(model, "sink_attention_removed", hooks, state=state, uses_sinks=True,
                        acts_on=acts_on(model, attn=calib.attn_layers, inside="the attention pattern (after softmax)"),
                        observer=observer(model, calib, sinks))


def bias_surgery(model: Any, *, calibration: Any = None, suppress: bool = True, where: str = "first",
                 sinks: Sinks = None) -> Intervention:
    """Give each head an explicit key/value bias slot (calibration means of the sink keys and
    values), mask the sink positions out of attention, and (``suppress``) zero the massive
    activations. With ``suppress=False`` and a BOS sink, the slot reproduces the model.

    Args:
        model: a TransformerLens-style model.
        calibration: calibration text (a corpus; None: the offline default text) or a
            :class:`~massive_lens.interventions.Calibration` from
            :func:`~massive_lens.calibrate`; use other text than the evaluation text.
        suppress: also zero the massive activations (default); False keeps them.
        where: where ``suppress`` zeroes them: ``"first"`` (default, the layer where each
            first appears) or ``"every"`` (every layer where it is massive in calibration).
        sinks: the sinks (a bool ``[batch, pos]`` mask of the tokens it will run on, a
            :class:`~massive_lens.attention.SinkSet`, or a list of positions); None: found
            online with the calibrated rule.

    Returns:
        An :class:`Intervention` named ``"bias_surgery"`` (``"bias_surgery_every"`` for
        ``where="every"``).

    Raises:
        MassiveLensError: if ``where`` is not ``"first"`` or ``"every"``, or ``sinks`` is not
            a bool mask or a non-empty list of positions.

    >>> from massive_lens import tiny_model
    >>> bias_surgery(tiny_model("qwen2"), calibration="Calibration text. " * 10).name
    'bias_surgery'
    """
    if where not in WHERE:
        raise MassiveLensError(f"where must be 'first' or 'every', got {where!r}")
    calib = calibration_of(model, calibration)
    require(model, "bias_surgery", calib.attn_layers, reads=("attn_scores", "pattern", "z"),
            order=(("attn_scores", "pattern"), ("query", "pattern"), ("pattern", "z")), per_head=("v", "z"),
            positioned=("q", "k"), edits_pattern=True)
    for field in ("sink_k", "sink_v"):
        _measured(model, calib, field, "bias_surgery")
    access = attention_access(model)

    def per_layer(view: ModelView, layer: int, state: HookState) -> list:
        query = access[layer].query_hook
        d_head = access[layer].shapes[query][-1]
        scale = float(getattr(getattr(view.blocks[layer].attn, "original_component", None), "scaling",
                              d_head ** -0.5))
        return [(view.hook_name(layer, "attn.hook_attn_scores"), partial(stash, state=state, key="scores")),
                (view.hook_name(layer, f"attn.hook_{query}"), partial(stash, state=state, key="q")),
                (view.hook_name(layer, "attn.hook_pattern"),
                 partial(slot_pattern, state=state, key=unpad(calib.sink_k[layer]), scale=scale)),
                (view.hook_name(layer, "attn.hook_z"),
                 partial(add_slot_value, state=state, value=unpad(calib.sink_v[layer])))]

    def zero(layer: int, dims: list[int]) -> Tensor:
        return torch.zeros(len(dims))

    state = HookState(calib, sinks)
    edits = suppress and bool(calib.dims)
    hooks = build_hooks(model, calib, state, fill=zero if edits else None, where=where, per_layer=per_layer,
                        measure_massive=edits, measure_attention=True)
    layers = (calib.dims if where == "first" else calib.dims_at) if edits else ()
    where_acts = acts_on(model, resid=list(layers), attn=calib.attn_layers,
                         inside="the attention scores, pattern (a slot added, sinks masked) and z")
    return Intervention(model, "bias_surgery" + ("_every" if where == "every" else ""), hooks, state=state,
                        acts_on=where_acts, where=where if edits else "", removes=edits, edits_massive=edits,
                        uses_sinks=True, observer=observer(model, calib, sinks))


def _measured(model: Any, calib: Any, field: str, what: str) -> None:
    """Refuse a calibration whose ``field`` was not measured (NaN) at an attention layer used."""
    measured = {layer: unpad(getattr(calib, field)[layer]) for layer in calib.attn_layers}
    bad = [layer for layer, value in measured.items() if not value.numel() or not bool(torch.isfinite(value).all())]
    if bad:
        raise MassiveLensError(f"{ModelView(model).name}: {what} needs the calibration's {field} at layer {bad[0]}, "
                               "but this model's attention hooks did not give it there (see "
                               "massive_lens.interventions.access)")


def patch_sink_from(model: Any, other_text: str, *, positions: Sequence[int] | None = None,
                    layers: Sequence[int] | None = None) -> Intervention:
    """Patch the residual stream (``resid_post`` of ``layers``, default all) at the sink
    ``positions`` (default: the sinks of ``other_text``, by the rule of
    :func:`~massive_lens.attention.find_sinks`) with its values on ``other_text``, using
    TransformerLens's ``layer_pos_patch_setter``.

    Args:
        model: a TransformerLens-style model.
        other_text: the one text whose residual stream is copied (run once, now).
        positions: the positions to patch (None: the sinks of ``other_text``: positions
            that draw attention as sinks or carry a persistent massive activation, else
            ``[0]``); positions beyond a patched input's length are skipped.
        layers: the layers whose ``resid_post`` is patched (None: all).

    Returns:
        An :class:`Intervention` named ``"sink_patched"``; its ``acts_on`` names the
        positions and their token kinds.

    Raises:
        MassiveLensError: if a position lies beyond ``other_text``, a layer is out of range,
            or ``other_text`` is empty or too long.

    >>> from massive_lens import tiny_model
    >>> len(patch_sink_from(tiny_model("llama"), "Another text.", layers=[1]))
    1
    """
    view = ModelView(model)
    batch = view.tokenize(other_text)
    found = find_sinks(model, batch.tokens)
    if positions is None:
        positions = found.mask[0].nonzero().flatten().tolist()
    elif not list(positions):
        raise MassiveLensError("positions is empty: pass the positions to patch, or None for other_text's sinks")
    chosen = view.chosen_layers(layers)
    names = [view.hook_name(layer, "resid_post") for layer in chosen]
    if max(positions) >= batch.tokens.shape[1]:
        raise MassiveLensError(f"sink positions {list(positions)} lie beyond other_text's "
                               f"{batch.tokens.shape[1]} tokens; pass positions= within it")
    cache: dict[str, Tensor] = {}
    view.forward(batch, [(n, partial(keep, cache=cache, name=n)) for n in names], stop_after=names[-1])
    hooks = [(name, partial(patch_positions, clean=cache[name], positions=list(positions))) for name in names]
    kinds = ", ".join(f"{p} ({TOKEN_KINDS[int(found.kinds[0, p])]})" for p in positions)
    return Intervention(model, "sink_patched", hooks,
                        acts_on=acts_on(model, resid=chosen) + f", at positions {kinds}")
