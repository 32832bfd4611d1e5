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
All are built by one generic builder, :func:`_hooks`, from small edit functions bound with
``functools.partial``, like TransformerLens's ``patching.py``.

>>> from massive_lens import tiny_model
>>> model = tiny_model("llama")
>>> with remove_sink_attention(model, calibration="Some calibration text. " * 8) as iv:
...     logits = model(torch.tensor([[256, 72, 105]]))
>>> iv.name, logits.shape[-1] > 0, iv.record.sinks[0].tolist()
('sink_attention_removed', True, [[True, False, False]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.patching import layer_pos_patch_setter

from massive_lens.attention import SinkSet, find_sinks, post_attention_norm, sink_term
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import TOKEN_KINDS, ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.calibration import (
    Calibration,
    calibrate,
    massive_entries,
    online_sinks,
    rotated_hook,
    stash,
)
from massive_lens.interventions.checks import Record, downstream, reading

DESCRIPTIONS = {
    "original": "no intervention",
    "zero": "massive activations set to zero where they appear",
    "mean": "massive activations set to their calibration mean",
    "control": "as many median-magnitude activations set to zero",
    "zero_every": "massive activations set to zero at every layer where they are massive",
    "mean_every": "massive activations set to their calibration mean at every layer where they are massive",
    "sink_term_mean": "each head's sink term replaced by its calibration mean",
    "sink_term_zero": "each head's sink term set to zero",
    "sink_attention_removed": "attention to sink positions dropped, renormalized",
    "bias_surgery": "explicit per-head k/v bias slot; sinks masked; massive activations zeroed",
    "bias_surgery_every": "explicit per-head k/v bias slot; sinks masked; massive activations zeroed at every "
                          "layer where they are massive",
    "sink_patched": "residual stream at the sink positions patched from another text",
}
WHERE = {"first": "first layer", "every": "every massive layer"}
Sinks = SinkSet | Tensor | Sequence[int] | None


class HookState:
    """Per-forward scratch shared by the hooks of one intervention: the sinks (given, or found
    online), the positions each massive dim targets, the current layer's pattern, values and
    queries, and the :class:`~massive_lens.interventions.checks.Record` of what it measured."""

    def __init__(self, calib: Calibration | None = None, sinks: Sinks = None):
        self.calib = calib
        self.given = _given_sinks(sinks)
        self.sinks: Tensor | None = None  # found online in this forward pass (later positions)
        self.targets: Tensor | None = None  # [batch pos n_dims] where each dim was massive at its first layer
        self.stash: dict[str, Tensor] = {}
        self.record = Record()

    def reset(self) -> None:
        self.sinks, self.targets = None, None
        self.stash.clear()

    def mask(self, batch: int, pos: int, device: torch.device) -> Bool[Tensor, "batch pos"]:
        """The sinks of the current forward pass (a sequence with none: its first token)."""
        if isinstance(self.given, Tensor):
            if tuple(self.given.shape) != (batch, pos):
                raise MassiveLensError(
                    f"sinks= was given for {list(self.given.shape)} [batch, pos] but the model runs on "
                    f"{[batch, pos]}; pass the sinks of these tokens, a list of positions, or none (found online)")
            found = self.given.to(device)
        else:
            found = torch.zeros(batch, pos, dtype=torch.bool, device=device)
            if self.given is not None:
                found[:, [p for p in self.given if p < pos]] = True
            else:
                found[:, 0] = self.calib.sink_first if self.calib is not None else True
                if self.sinks is not None and tuple(self.sinks.shape) == (batch, pos):
                    found |= self.sinks.to(device)
        none = ~found.any(-1)
        if bool(none.any()):
            found = found.clone()
            found[none, 0] = True
        return found


def _given_sinks(sinks: Sinks) -> Tensor | list[int] | None:
    if sinks is None:
        return None
    if isinstance(sinks, SinkSet):
        sinks = sinks.mask
    if isinstance(sinks, Tensor):
        if sinks.dtype != torch.bool or sinks.ndim != 2:
            raise MassiveLensError(f"sinks= as a tensor must be a bool [batch, pos] mask, got {sinks.dtype} "
                                   f"{list(sinks.shape)}; or pass a list of positions")
        return sinks.cpu()
    positions = [int(p) for p in sinks]
    if not positions or min(positions) < 0:
        raise MassiveLensError(f"sinks= positions must be a non-empty list of positions >= 0, got {positions}")
    return positions


class Intervention:
    """Forward hooks plus a context manager that attaches them and always removes them.

    ``record``: what its hooks measured so far (see :meth:`check`); ``acts_on``: where it
    edits the forward pass, relative to the model's norms; ``where``: ``first`` or
    ``every`` for massive-activation edits.
    """

    def __init__(self, model: Any, name: str, fwd_hooks: list[tuple[str, Callable]], *,
                 state: HookState | None = None, acts_on: str = "", where: str = "", removes: bool = False,
                 edits_massive: bool = False, uses_sinks: bool = False,
                 observer: Callable[[], Intervention] | None = None):
        self.model, self.name, self.fwd_hooks = model, name, fwd_hooks
        self.acts_on, self.where = acts_on, where
        self.removes, self.edits_massive, self.uses_sinks = removes, edits_massive, uses_sinks
        self._state = state or HookState()
        self._observer = observer
        self._stack: list[Any] = []

    @property
    def description(self) -> str:
        return DESCRIPTIONS.get(self.name, self.name)

    @property
    def record(self) -> Record:
        """What this intervention's hooks measured over every forward pass so far."""
        return self._state.record

    @property
    def label(self) -> str:
        """The name, with where a massive-activation edit acts (``zero (first layer)``)."""
        return f"{self.name} ({WHERE[self.where]})" if self.where else self.name

    def check(self, text: Any) -> pd.DataFrame:
        """Run ``text`` untouched and under this intervention, and compare what the targets hold downstream.

        Args:
            text: a string, a list of strings or a token tensor (with ``sinks=`` given as a
                mask, of the same shape).

        Returns:
            A DataFrame with one row per target and layer: ``kind`` (``massive``: a targeted
            dim's mean ``|value|`` at the positions it targeted; ``sink_mass``: attention of
            non-sink queries to the sinks), ``dim``, ``layer``, ``without``, ``with``,
            ``kept`` (with / without); ``.attrs["verdict"]`` holds the one-line reading
            (e.g. "zero (first layer): dim 5 back to 95% of its value by layer 2; the model
            rebuilds it").

        Raises:
            MassiveLensError: if this intervention has nothing to check (``patch_sink_from``).
        """
        if self._observer is None or self._state.calib is None:
            raise MassiveLensError(f"{self.name} records no downstream check (it has no calibrated targets)")
        view = ModelView(self.model)
        batch = view.tokenize(text)
        base = self._observer()
        view.forward(batch, base.fwd_hooks)
        kept, self._state.record = self._state.record, Record()
        try:
            view.forward(batch, self.fwd_hooks)
        finally:
            mine, self._state.record = self._state.record, kept
        frame = downstream(base.record, mine)
        calib = self._state.calib
        frame.attrs["verdict"] = reading(frame, label=self.label, first_layer=calib.first_layer,
                                         massive_layers=calib.massive_layers, removes=self.removes,
                                         edits_massive=self.edits_massive, uses_sinks=self.uses_sinks)["check"]
        return frame

    def __iter__(self):
        return iter(self.fwd_hooks)

    def __len__(self) -> int:
        return len(self.fwd_hooks)

    @property
    def active(self) -> bool:
        """Whether its hooks are attached now (inside ``with``); entering again is refused."""
        return bool(self._stack)

    def __enter__(self) -> Intervention:
        if self._stack:
            raise MassiveLensError(
                f"{self.label} is already active (inside its own with block); entering it again would "
                "attach its hooks twice and apply its edit twice. Use one with block, or build a second "
                "intervention to stack two edits"
            )
        ctx = self.model.hooks(fwd_hooks=self.fwd_hooks)
        ctx.__enter__()
        self._stack.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        if not self._stack:
            raise MassiveLensError(f"{self.label} was exited without being entered; use it as `with intervention:`")
        return self._stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"Intervention({self.name!r}: {self.description}; {len(self.fwd_hooks)} hooks)"


# --------------------------------------------------------------------------- hook functions


@dataclass(frozen=True)
class _ResidPlan:
    """What the resid_post hook of one layer does (column indices into the calibrated dims)."""

    layer: int
    first: Tensor  # dims first massive here: their targets are set here
    edit: Tensor  # dims edited here
    fill: Tensor | None  # the value each edited dim gets (None: no edit)
    measure: Tensor  # dims whose targets' |value| is recorded here
    detect: bool  # find the later sinks online here
    last_first: bool  # the last layer where targets are set (record them)
    sticky: bool  # where="every": edit the targets too, not only entries massive now
    control: bool


def _reset(act: Tensor, hook: Any, *, state: HookState) -> None:
    state.reset()


def _resid_step(resid: Float[Tensor, "batch pos d_model"], hook: Any, *, state: HookState, dims: Tensor,
                plan: _ResidPlan, criterion: Criterion) -> Tensor:
    """Set targets and find sinks (on the values as they arrive), edit, then record what stays."""
    hits = massive_entries(resid, dims, criterion) if len(plan.first) or len(plan.edit) else None
    if plan.detect:
        state.sinks = online_sinks(resid, state.calib)
    if len(plan.first):
        if state.targets is None or state.targets.shape[:2] != resid.shape[:2]:
            state.targets = torch.zeros(*resid.shape[:2], len(dims), dtype=torch.bool, device=resid.device)
        state.targets[..., plan.first] = hits[..., plan.first]
        if plan.last_first:
            state.record.targets.append(state.targets.any(-1).cpu())
    out = resid
    if plan.fill is not None and len(plan.edit):
        where = hits[..., plan.edit]
        if plan.sticky and state.targets is not None:
            where = where | state.targets[..., plan.edit]
        out = resid.clone()
        if plan.control:
            massive = torch.zeros_like(resid, dtype=torch.bool)
            massive[..., dims.to(resid.device)] = hits
            _zero_median_entries(out, where.sum((1, 2)), massive=massive)
        else:
            cols = dims[plan.edit].to(resid.device)
            out[..., cols] = torch.where(where, plan.fill.to(out), out[..., cols])
    if len(plan.measure) and state.targets is not None:
        targets = state.targets[..., plan.measure].to(torch.float32)
        values = out.detach()[..., dims[plan.measure].to(out.device)].abs().float()
        state.record.add_values(plan.layer, dims[plan.measure].tolist(), (values * targets).sum((0, 1)).double().cpu(),
                                targets.sum((0, 1)).double().cpu())
    return out


def _zero_median_entries(resid: Float[Tensor, "batch pos d_model"], counts: Tensor,
                         massive: Bool[Tensor, "batch pos d_model"]) -> None:
    """Zero, per sequence, ``counts[b]`` non-massive entries whose magnitude is nearest the
    median magnitude of the hidden state (the paper's control)."""
    for b, k in enumerate(counts.tolist()):
        if k:
            mag = resid[b].abs().flatten()
            gap = (mag - mag.median()).abs().masked_fill(massive[b].flatten(), float("inf"))
            resid[b].view(-1)[gap.topk(int(k), largest=False).indices] = 0.0


def _measure_pattern(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *, state: HookState,
                     layer: int, first: bool) -> None:
    """Record the attention non-sink queries still pay to the sinks (and to a bias slot)."""
    sinks = state.mask(pattern.shape[0], pattern.shape[-1], pattern.device)
    if first:
        state.record.sinks.append(sinks.cpu())
    queries = (~sinks).to(torch.float32)
    n = float(queries.sum()) * pattern.shape[1]
    total = torch.einsum("bhqk,bk,bq->", pattern.detach().float(), sinks.to(torch.float32), queries)
    state.record.add_mass(state.record.mass, layer, float(total), n)
    slot = state.stash.get("slot")
    if slot is not None and slot.shape[-1] == pattern.shape[-2]:
        state.record.add_mass(state.record.slot, layer, float(torch.einsum("bhq,bq->", slot.detach().float(), queries)),
                              n)


def _drop_sinks(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *, state: HookState,
                renormalize: bool) -> Tensor:
    sinks = state.mask(pattern.shape[0], pattern.shape[-1], pattern.device)
    kept = pattern * (~sinks)[:, None, None, :].to(pattern.dtype)
    if renormalize:
        total = kept.sum(-1, keepdim=True)
        kept = torch.where(total > 1e-9, kept / total.clamp(min=1e-9), pattern)
    return torch.where(sinks[:, None, :, None], pattern, kept)  # sink queries keep their own row


def _replace_sink_term(z: Float[Tensor, "batch pos head_index d_head"], hook: Any, *, state: HookState,
                       mean: Tensor | None) -> Tensor:
    sinks = state.mask(z.shape[0], z.shape[1], z.device)
    sink_z = sink_term(state.stash["pattern"], state.stash["v"], sinks)
    target = torch.zeros_like(sink_z) if mean is None else mean.to(z).expand_as(sink_z)
    edited = z - sink_z + target
    return torch.where(sinks[:, :, None, None], z, edited)  # sink queries keep their own output


def _slot_pattern(pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *, state: HookState,
                  key: Tensor, scale: float) -> Tensor:
    """softmax over [scores without sink keys, q . k' * scale]; the slot's share is stashed."""
    sinks = state.mask(pattern.shape[0], pattern.shape[-1], pattern.device)
    q = state.stash["q"]  # [batch query head d_head]
    group = q.shape[2] // key.shape[0]
    slot = torch.einsum("bqhd,hd->bhq", q, key.to(q).repeat_interleave(group, 0)) * scale
    scores = state.stash["scores"].masked_fill(sinks[:, None, None, :], float("-inf"))
    full = torch.cat([scores, slot[..., None]], -1).softmax(-1)
    state.stash["slot"] = full[..., -1]
    return full[..., :-1].to(pattern.dtype)


def _add_slot_value(z: Float[Tensor, "batch pos head_index d_head"], hook: Any, *, state: HookState,
                    value: Tensor) -> Tensor:
    group = z.shape[2] // value.shape[0]
    share = state.stash["slot"]  # [batch head query]
    return z + torch.einsum("bhq,hd->bqhd", share.to(z), value.to(z).repeat_interleave(group, 0))


# --------------------------------------------------------------------------- the generic builder


def _hooks(model: Any, calib: Calibration, state: HookState, *,
           fill: Callable[[int, list[int]], Tensor] | None = None, where: str = "first", control: bool = False,
           per_layer: Callable[[ModelView, int, HookState], list] | None = None,
           measure_massive: bool = False, measure_attention: bool = False) -> list:
    """Hooks for one intervention: a reset, then at each ``resid_post`` that needs one the
    targets, the online sinks, the residual edit (``fill(layer, dims)``: the value each of
    ``dims`` gets at ``layer``) and the record of what stays; then ``per_layer(view, layer,
    state)`` for every attention layer after the sinks appear, and the record of the
    attention still on the sinks."""
    view = ModelView(model)
    hooks: list = [(view.hook_name(0, "resid_pre"), partial(_reset, state=state))]
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
        plan = _ResidPlan(
            layer=layer, first=torch.tensor(cols_first.get(layer, []), dtype=torch.long),
            edit=torch.tensor(edit, dtype=torch.long),
            fill=fill(layer, [names[i] for i in edit]) if fill is not None and edit else None,
            measure=torch.tensor([i for i, d in enumerate(names) if first_layer[d] <= layer] if measure_massive else [],
                                 dtype=torch.long),
            detect=layer == detect, last_first=layer == last_first, sticky=where == "every", control=control)
        hooks.append((view.hook_name(layer, "resid_post"),
                      partial(_resid_step, state=state, dims=dims, plan=plan, criterion=calib.criterion)))
    for layer in calib.attn_layers:
        if per_layer is not None:
            hooks += per_layer(view, layer, state)
        if measure_attention:
            hooks.append((view.hook_name(layer, "attn.hook_pattern"),
                          partial(_measure_pattern, state=state, layer=layer, first=layer == calib.attn_layers[0])))
    return hooks


def _calibration(model: Any, calibration: Any) -> Calibration:
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


def _acts_on(model: Any, *, resid: Sequence[int] = (), attn: Sequence[int] = (), inside: str = "") -> str:
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


def _observer(model: Any, calib: Calibration, sinks: Sinks) -> Callable[[], Intervention]:
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
    calib = _calibration(model, calibration)
    state = HookState(calib, sinks)
    hooks = _hooks(model, calib, state, measure_massive=True, measure_attention=True)
    return Intervention(model, "original", hooks, state=state, acts_on=_acts_on(model), uses_sinks=True,
                        edits_massive=bool(calib.dims))


def ablate_massive(model: Any, mode: str | float = "zero", *, calibration: Any = None,
                   control: bool = False, where: str = "first") -> Intervention:
    """Set the massive activations to ``"zero"``, their calibration ``"mean"`` or a number, at
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
            entries of that layer) or a number every massive entry is set to.
        calibration: calibration text (a corpus; None: the offline default text) or a
            :class:`~massive_lens.interventions.Calibration` from
            :func:`~massive_lens.calibrate`; use other text than the evaluation text.
        control: zero the same number of median-magnitude, non-massive activations per
            sequence instead (needs ``mode="zero"``).
        where: ``"first"`` (default) or ``"every"``.

    Returns:
        An :class:`Intervention` named ``"zero"``, ``"mean"``, ``"value=<mode>"`` or
        ``"control"`` (with ``_every`` appended for ``where="every"``).

    Raises:
        MassiveLensError: if the calibration text has no massive activations, ``mode`` or
            ``where`` is none of the above, or ``control=True`` with a ``mode`` other than
            ``"zero"``.

    >>> from massive_lens import tiny_model
    >>> ablate_massive(tiny_model("llama"), calibration="No massive activations here. " * 5)
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: tiny-llama has no massive activations in the calibration text ...
    """
    if where not in WHERE:
        raise MassiveLensError(f"where must be 'first' (the layer where each dim first appears) or 'every' "
                               f"(every layer where it is massive), got {where!r}")
    calib = _calibration(model, calibration)
    if not calib.dims:
        raise MassiveLensError(
            f"{ModelView(model).name} has no massive activations in the calibration text "
            f"({calib.source}, criterion {calib.criterion}); nothing to ablate. Use more or other "
            "calibration text, or a looser Criterion")
    if control and mode != "zero":
        raise MassiveLensError("the control zeroes median-magnitude activations: use mode='zero' with control=True")
    if mode == "mean":
        def fill(layer: int, dims: list[int]) -> Tensor:
            at = calib.dims_at[layer].tolist()
            return calib.means_at[layer][[at.index(d) for d in dims]]
    elif mode == "zero":
        def fill(layer: int, dims: list[int]) -> Tensor:
            return torch.zeros(len(dims))
    elif isinstance(mode, (int, float)) and not isinstance(mode, bool):
        def fill(layer: int, dims: list[int]) -> Tensor:
            return torch.full((len(dims),), float(mode))
    else:
        raise MassiveLensError(f"mode must be 'zero', 'mean' or a number, got {mode!r}")
    name = "control" if control else (mode if isinstance(mode, str) else f"value={mode:g}")
    name += "_every" if where == "every" else ""
    state = HookState(calib)
    hooks = _hooks(model, calib, state, fill=fill, where=where, control=control, measure_massive=True)
    layers = calib.dims if where == "first" else calib.dims_at
    removes = not control and (mode == "zero" or (not isinstance(mode, str) and float(mode) == 0.0))
    return Intervention(model, name, hooks, state=state, acts_on=_acts_on(model, resid=list(layers)), where=where,
                        removes=removes, edits_massive=True, observer=_observer(model, calib, None))


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
    calib = _calibration(model, calibration)

    def per_layer(view: ModelView, layer: int, state: HookState) -> list:
        mean = calib.sink_z[layer] if mode == "mean" else None
        return [(view.hook_name(layer, "attn.hook_pattern"), partial(stash, state=state, key="pattern")),
                (view.hook_name(layer, "attn.hook_v"), partial(stash, state=state, key="v")),
                (view.hook_name(layer, "attn.hook_z"), partial(_replace_sink_term, state=state, mean=mean))]

    state = HookState(calib, sinks)
    hooks = _hooks(model, calib, state, per_layer=per_layer, measure_attention=True)
    return Intervention(model, f"sink_term_{mode}", hooks, state=state, uses_sinks=True,
                        acts_on=_acts_on(model, attn=calib.attn_layers, inside="each head's output z (before W_O)"),
                        observer=_observer(model, calib, sinks))


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
    calib = _calibration(model, calibration)

    def per_layer(view: ModelView, layer: int, state: HookState) -> list:
        return [(view.hook_name(layer, "attn.hook_pattern"),
                 partial(_drop_sinks, state=state, renormalize=renormalize))]

    state = HookState(calib, sinks)
    hooks = _hooks(model, calib, state, per_layer=per_layer, measure_attention=True)
    return Intervention(model, "sink_attention_removed", hooks, state=state, uses_sinks=True,
                        acts_on=_acts_on(model, attn=calib.attn_layers, inside="the attention pattern (after softmax)"),
                        observer=_observer(model, calib, sinks))


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
    calib = _calibration(model, calibration)

    def per_layer(view: ModelView, layer: int, state: HookState) -> list:
        attn = model.blocks[layer].attn
        scale = float(getattr(getattr(attn, "original_component", None), "scaling", attn.W_Q.shape[-1] ** -0.5))
        return [(view.hook_name(layer, "attn.hook_attn_scores"), partial(stash, state=state, key="scores")),
                (rotated_hook(view, layer, "q"), partial(stash, state=state, key="q")),
                (view.hook_name(layer, "attn.hook_pattern"),
                 partial(_slot_pattern, state=state, key=calib.sink_k[layer], scale=scale)),
                (view.hook_name(layer, "attn.hook_z"),
                 partial(_add_slot_value, state=state, value=calib.sink_v[layer]))]

    def zero(layer: int, dims: list[int]) -> Tensor:
        return torch.zeros(len(dims))

    state = HookState(calib, sinks)
    edits = suppress and bool(calib.dims)
    hooks = _hooks(model, calib, state, fill=zero if edits else None, where=where, per_layer=per_layer,
                   measure_massive=edits, measure_attention=True)
    layers = (calib.dims if where == "first" else calib.dims_at) if edits else ()
    acts_on = _acts_on(model, resid=list(layers), attn=calib.attn_layers,
                       inside="the attention scores, pattern (a slot added, sinks masked) and z")
    return Intervention(model, "bias_surgery" + ("_every" if where == "every" else ""), hooks, state=state,
                        acts_on=acts_on, where=where if edits else "", removes=edits, edits_massive=edits,
                        uses_sinks=True, observer=_observer(model, calib, sinks))


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
    chosen = list(range(view.n_layers)) if layers is None else list(layers)
    names = [view.hook_name(layer, "resid_post") for layer in chosen]
    if max(positions) >= batch.tokens.shape[1]:
        raise MassiveLensError(f"sink positions {list(positions)} lie beyond other_text's "
                               f"{batch.tokens.shape[1]} tokens; pass positions= within it")
    cache: dict[str, Tensor] = {}
    view.forward(batch, [(n, partial(_keep, cache=cache, name=n)) for n in names], stop_after=names[-1])
    hooks = [(name, partial(_patch_positions, clean=cache[name], positions=list(positions))) for name in names]
    kinds = ", ".join(f"{p} ({TOKEN_KINDS[int(found.kinds[0, p])]})" for p in positions)
    return Intervention(model, "sink_patched", hooks,
                        acts_on=_acts_on(model, resid=chosen) + f", at positions {kinds}")


def _keep(act: Tensor, hook: Any, *, cache: dict[str, Tensor], name: str) -> None:
    cache[name] = act.detach().clone()


def _patch_positions(resid: Float[Tensor, "batch pos d_model"], hook: Any, *, clean: Tensor,
                     positions: list[int]) -> Tensor:
    resid = resid.clone()
    for pos in positions:
        if pos < resid.shape[1]:
            layer_pos_patch_setter(resid, (None, pos), clean.to(resid).expand(resid.shape[0], -1, -1))
    return resid
