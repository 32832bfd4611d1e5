"""The one generic builder of every intervention's hooks, where each acts, and :func:`observe`.

>>> from massive_lens import tiny_model
>>> observe(tiny_model("gpt2"), calibration="Calibrate on this. " * 10).name
'original'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.attention.sinks import Sinks, post_attention_norm
from massive_lens.core.attention_pass import attention_reading, choose_path
from massive_lens.core.model_view import ModelView
from massive_lens.interventions.calibration import calibrate
from massive_lens.interventions.calibration_result import Calibration
from massive_lens.interventions.edits import ResidPlan, record_sink_attention, reset, resid_step
from massive_lens.interventions.intervention import Intervention
from massive_lens.interventions.state import HookState


def build_hooks(model: Any, calib: Calibration, state: HookState, *,
                fill: Callable[[int, list[int]], Tensor] | None = None, where: str = "first", control: bool = False,
                per_layer: Callable[[ModelView, int, HookState], list] | None = None,
                measure_massive: bool = False, measure_attention: bool = False) -> list:
    """Hooks for one intervention: a reset, then at each ``resid_post`` that needs one the
    targets, the online sinks, the residual edit (``fill(layer, dims)``: the value each of
    ``dims`` gets at ``layer``) and the record of what stays; then ``per_layer(view, layer,
    state)`` for every attention layer after the sinks appear, and the record of the
    attention still on the sinks: the attention pass's reading of the forward the hooks run in
    (:func:`~massive_lens.core.attention_pass.attention_reading`, its path
    :func:`~massive_lens.core.attention_pass.choose_path`'s for a forward of unknown length: the
    eager pattern where the view serves one, read after the edits; else, nnsight, the fused
    kernel, run around each forward by ``state.reading``) reduced by
    :func:`~massive_lens.interventions.edits.record_sink_attention`."""
    view = ModelView(model)
    hooks: list = [(view.hook_name(0, "resid_pre"), partial(reset, state=state))]
    first_layer = calib.first_layer
    names = sorted(first_layer)
    dims = torch.tensor(names, dtype=torch.long)
    cols_first = {layer: [i for i, d in enumerate(names) if first_layer[d] == layer] for layer in calib.dims}
    edit_at: dict[int, list[int]] = {}
    if fill is not None:
        edit_at = dict(cols_first) if where == "first" else {
            layer: [i for i, d in enumerate(names) if d in set(at.tolist())] for layer, at in calib.dims_at.items()}
    uses_sinks = per_layer is not None or measure_attention
    detect = calib.sink_layer if state.given is None and calib.sink_layer >= 0 and uses_sinks else -1
    wanted = set(edit_at) | ({detect} if detect >= 0 else set())
    if measure_massive or fill is not None:
        wanted |= set(cols_first)
    if measure_massive and names:
        wanted |= set(range(min(cols_first), view.n_layers))
    last_first = max(cols_first) if cols_first else -1
    for layer in sorted(wanted):
        edit = edit_at.get(layer, [])
        plan = ResidPlan(
            layer=layer, first=torch.tensor(cols_first.get(layer, []), dtype=torch.long),
            edit=torch.tensor(edit, dtype=torch.long),
            fill=fill(layer, [names[i] for i in edit]) if fill is not None and edit else None,
            measure=torch.tensor([i for i, d in enumerate(names) if first_layer[d] <= layer] if measure_massive else [],
                                 dtype=torch.long),
            detect=layer == detect, last_first=layer == last_first, sticky=where == "every", control=control)
        hooks.append((view.hook_name(layer, "resid_post"),
                      partial(resid_step, state=state, dims=dims, plan=plan, criterion=calib.criterion)))
    for layer in calib.attn_layers if per_layer is not None else ():
        hooks += per_layer(view, layer, state)
    if measure_attention and calib.attn_layers:  # its hooks after the edits': it reads the edited attention
        state.reading = attention_reading(view, partial(record_sink_attention, state=state, first=calib.attn_layers[0]),
                                          path=choose_path(view, "auto", None), columns=state.sink_columns,
                                          layers=calib.attn_layers)
        hooks += state.reading.hooks
    return hooks


def calibration_of(model: Any, calibration: Any) -> Calibration:
    """``calibration`` as a :class:`Calibration` of ``model`` (text is calibrated now; a
    Calibration of a model of other sizes is refused by :func:`calibrate`)."""
    return calibrate(model, calibration, progress=False)


def _span(layers: Sequence[int]) -> str:
    layers = sorted(layers)
    if not layers:
        return "no layer"
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ", ".join(map(str, layers))


def acts_on(model: Any, *, resid: Sequence[int] = (), attn: Sequence[int] = (), inside: str = "") -> str:
    """Where an intervention edits the forward pass, relative to the model's norms."""
    post = post_attention_norm(model)
    parts = []
    if resid:
        parts.append(f"the residual stream (resid_post) at {_span(resid)}" +
                     (", after this model's post-sublayer norms, so the edit is exact" if post else ""))
    if attn:
        parts.append(f"{inside} at {_span(attn)}" +
                     ("; this model's post-attention norm then rescales the edited attention output" if post else ""))
    return "; ".join(parts) or "nothing (measures only)"


def observer(model: Any, calib: Calibration, sinks: Sinks) -> Callable[[], Intervention]:
    return lambda: observe(model, calibration=calib, sinks=sinks)


def observe(model: Any, *, calibration: Any = None, sinks: Sinks = None) -> Intervention:
    """Edit nothing; record what the interventions record (the untouched baseline of their checks).

    Args:
        model: a TransformerLens-style model.
        calibration: calibration text (a corpus; None: the offline default text) or a
            :class:`~massive_lens.interventions.Calibration` from
            :func:`~massive_lens.calibrate`.
        sinks: the sinks (a bool ``[batch, pos]`` mask of the tokens it will run on, a
            :class:`~massive_lens.attention.SinkSet`, or a list of positions); None: found
            online with the calibrated rule.

    Returns:
        An :class:`Intervention` named ``"original"`` whose ``record`` holds the massive
        dims' ``|value|`` at their targets, layer by layer, and the attention to the sinks.

    >>> from massive_lens import tiny_model
    >>> observe(tiny_model("gpt2"), calibration="Calibrate on this. " * 10).acts_on
    'nothing (measures only)'
    """
    calib = calibration_of(model, calibration)
    state = HookState(calib, sinks)
    hooks = build_hooks(model, calib, state, measure_massive=True, measure_attention=True)
    return Intervention(model, "original", hooks, state=state, acts_on=acts_on(model), uses_sinks=True,
                        edits_massive=bool(calib.dims))
