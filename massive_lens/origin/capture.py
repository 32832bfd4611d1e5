"""The one forward pass of :func:`massive_lens.trace_origin`.

Every hook slices the activation at the traced positions the moment it fires, so the pass
keeps ``[positions, d_model]`` (and ``[positions, d_mlp]`` for the MLP neurons) per layer and
never a full cache. Which hook holds what is read from the model's own hooks and modules
(never from its architecture's name), block by block (:class:`BlockPlan`):

- ``hook_embed`` (+ ``hook_pos_embed`` where a learned positional embedding fires) sums to
  ``blocks.0.hook_resid_pre``; Gemma's ``sqrt(d_model)`` embedding scale is already in it.
  Where they do not (an embedding LayerNorm, as in BLOOM, or a scale applied after the hook),
  the embedding term is read where the first block reads it (``resid_pre`` minus the
  positional term);
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

A hook that fires with the positions flattened (``[batch * pos, ...]``, as in OPT's MLP) is
reshaped back.

Tracing every massive entry of a text, the pass cannot know which positions it traces until
the last layer, yet only those need the MLP's neuron-level activations (``d_mlp`` wide, the
bulk of what a pass would keep). So each layer keeps them only at its *candidates*: positions
where a token-specific entry passes a criterion ten times looser (:data:`CANDIDATE_LOOSE`) at
this layer or an earlier one, decided when the layer's ``hook_resid_post`` fires
(:attr:`Capture.kept`). An MLP event at a position a layer did not keep is read by
:func:`refill`, a second pass sliced at the traced positions; the residual-stream terms are
always kept at every position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core.criterion import Criterion, token_specific
from massive_lens.core.model_view import ModelView
from massive_lens.core.reduce import ResidualReducer
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError
from massive_lens.origin.experts import Experts, find_experts, record

_EMBED_TOL = 1e-5  # relative: embed (+ pos_embed) vs resid_pre of block 0
SCOPED = ("post", "pre", "up", "norm_in", "norm_out", "scale")  # kept at each layer's candidate positions only
CANDIDATE_LOOSE = 0.1  # a candidate passes the criterion with both thresholds scaled by this


@dataclass(frozen=True)
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


@dataclass
class Capture:
    """Activations at ``positions`` (index ``i`` of every tensor is ``positions[i]``)."""

    positions: Int[Tensor, " pos"]
    embed: Float[Tensor, "pos d_model"]
    pos_embed: Float[Tensor, "pos d_model"] | None
    resid_pre0: Float[Tensor, "pos d_model"]
    layers: dict[str, Float[Tensor, "layer pos _"]]  # attn, mlp, resid_pre, resid_mid, resid_post
    post_norm: bool
    gated: bool
    reducer: ResidualReducer | None = field(default=None, repr=False)
    plans: tuple[BlockPlan, ...] = ()
    neuron_data: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # layer -> post, pre, up, ...
    notes: list[str] = field(default_factory=list)
    _where: dict[int, int] | None = field(default=None, repr=False)  # position -> index, see index()
    norms: dict[int, tuple[Tensor, Tensor, bool]] = field(default_factory=dict, repr=False)  # layer -> norm_affine
    kept: dict[int, Tensor] = field(default_factory=dict, repr=False)  # layer -> indices SCOPED keys hold (else all)

    def index(self, pos: int) -> int:
        if self._where is None:  # built once: analyses ask for the same few positions hundreds of times
            self._where = {int(p): i for i, p in enumerate(self.positions.tolist())}
        return self._where[int(pos)]

    def at(self, key: str, layer: int) -> Tensor | None:
        """``[pos, _]`` of a per-block key (neuron keys: None for a block without them; a
        :data:`SCOPED` key holds only the rows of :attr:`kept`, so read it with :meth:`row`)."""
        if key in self.layers:
            return self.layers[key][layer]
        return self.neuron_data.get(layer, {}).get(key)

    def covers(self, layer: int, index: int) -> bool:
        """Whether layer ``layer``'s :data:`SCOPED` keys hold capture index ``index``."""
        return self._kept_row(layer, index) is not None

    def row(self, key: str, layer: int, index: int) -> Tensor | None:
        """Capture index ``index`` of a per-block key (None for a block without the key)."""
        data = self.at(key, layer)
        if data is None:
            return None
        row = self._kept_row(layer, index) if key in SCOPED else index
        if row is None:
            raise MassiveLensError(f"internal: layer {layer}'s {key} was not kept at capture index {index}; "
                                   "refill() reads it (please report this)")
        return data[row]

    def _kept_row(self, layer: int, index: int) -> int | None:
        rows = self.kept.get(layer)
        if rows is None:
            return index
        where = (rows == index).nonzero()
        return int(where[0]) if len(where) else None


def _has(view: ModelView, name: str) -> bool:
    return name in view.hook_names


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
    prefix = f"blocks.{layer}."
    parallel = not _has(view, prefix + "hook_resid_mid")
    attn_post, mlp_post = _has(view, prefix + "ln1_post.hook_out"), _has(view, prefix + "ln2_post.hook_out")
    missing = [n for n in ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
               if not _has(view, prefix + n)]
    if missing or getattr(block, "mlp", None) is None:
        kind = type(block).__name__
        raise MassiveLensError(
            f"{view.name}: block {layer} ({kind}) has no {'/'.join(missing) or 'mlp module'}: trace_origin "
            "needs every block to add an attention output and an MLP output to the residual stream "
            "(state-space, recurrent and linear-attention blocks do not)")
    hooks = {
        "resid_pre": prefix + "hook_resid_pre",
        "resid_post": prefix + "hook_resid_post",
        "attn": prefix + ("ln1_post.hook_out" if attn_post else "hook_attn_out"),
        "mlp": prefix + ("ln2_post.hook_out" if mlp_post else "hook_mlp_out"),
    }
    if not parallel:
        hooks["resid_mid"] = prefix + "hook_resid_mid"
    if mlp_post:
        hooks["mlp_raw"] = prefix + "ln2_post.hook_in"
    if attn_post:
        hooks["attn_raw"] = prefix + "ln1_post.hook_in"
    for key in ("z", "pattern"):  # per-head attribution (origin.heads), where the hooks exist
        if _has(view, prefix + f"attn.hook_{key}"):
            hooks[key] = prefix + f"attn.hook_{key}"
    norm = "ln2" if _has(view, prefix + "ln2.hook_in") else ("ln1" if parallel and _has(view, prefix + "ln1.hook_in")
                                                              else None)
    if norm is not None:
        hooks["norm_in"], hooks["norm_out"] = prefix + f"{norm}.hook_in", prefix + f"{norm}.hook_out"
        if _has(view, prefix + f"{norm}.hook_scale"):
            hooks["scale"] = prefix + f"{norm}.hook_scale"
    elif _has(view, prefix + "mlp.hook_in"):
        hooks["norm_in"] = prefix + "mlp.hook_in"
    w_in, w_gate, w_out = (_weight(block.mlp, name) for name in ("W_in", "W_gate", "W_out"))
    d_mlp = None if w_out is None else int(w_out.shape[0])
    dense = (w_in is not None and w_out is not None and tuple(w_in.shape) == (view.d_model, d_mlp)
             and tuple(w_out.shape) == (d_mlp, view.d_model) and (w_gate is None or w_gate.shape == w_in.shape)
             and _has(view, prefix + "mlp.hook_post") and _has(view, prefix + "mlp.hook_pre")
             and (w_gate is None or _has(view, prefix + "mlp.hook_pre_linear")) and "norm_in" in hooks)
    gated = dense and w_gate is not None
    if dense:
        hooks.update(post=prefix + "mlp.hook_post", pre=prefix + "mlp.hook_pre")
        if gated:
            hooks["up"] = prefix + "mlp.hook_pre_linear"
    experts = None if dense else find_experts(view.model, block.mlp)
    return BlockPlan(layer, parallel, norm, dense, gated, mlp_post, d_mlp if dense else None, hooks, experts)


def is_post_norm(view: ModelView) -> bool:
    return "blocks.0.ln2_post.hook_out" in view.hook_names


def d_mlp(view: ModelView) -> int:
    """The widest dense MLP's width (``4 * d_model`` when no block has a dense MLP)."""
    widths = []
    for block in view.blocks:
        w_out = _weight(getattr(block, "mlp", None), "W_out")
        if w_out is not None:
            widths.append(int(w_out.shape[0]))
    return max(widths, default=4 * view.d_model)


_LAYERED = ("resid_pre", "resid_post", "attn", "mlp", "resid_mid")  # [layer, pos, d_model] in Capture.layers
_NEURON_KEYS = ("post", "pre", "up", "norm_in", "norm_out", "scale", "mlp_raw", "attn_raw", "z", "pattern")


def capture(
    view: ModelView, batch: Batch, positions: Int[Tensor, " pos"], criterion: Criterion | None, copy: bool = False
) -> Capture:
    """One no-grad forward pass; with ``criterion`` also find the massive entries (in-hook).

    Where every position of a one-text float32 CPU batch is kept, the per-neuron hooks keep
    the activations themselves, not copies; an activation the model then changes in place (its
    version counter moved) makes the pass run again with copies (``copy=True``)."""
    plans = tuple(block_plan(view, layer) for layer in range(view.n_layers))
    store: dict[tuple[str, int], Tensor] = {}
    layered: dict[str, Tensor] = {}
    filled: set[tuple[str, int]] = set()
    idx = positions.to(view.input_device)
    n_batch, seq = batch.tokens.shape
    every = len(positions) == seq and bool((positions.cpu() == torch.arange(seq)).all())  # no gather needed
    keep_views = every and n_batch == 1 and not copy
    versions: dict[tuple[str, int], int] = {}
    scoped = every and criterion is not None  # trace every massive entry: SCOPED keys at candidates only
    loose = loosened(criterion) if scoped else None
    candidate = torch.zeros(seq, dtype=torch.bool)
    kept: dict[int, Tensor] = {}
    stale = False  # a kept activation changed in place before its layer was settled

    def settle(layer: int, mag: Tensor, scale: Tensor) -> None:
        """Keep layer ``layer``'s SCOPED activations at the candidates so far (all while they are many)."""
        nonlocal stale
        candidate.logical_or_(candidates(mag, scale, loose)[0].cpu())
        if 2 * int(candidate.sum()) > seq:
            return
        rows = candidate.nonzero()[:, 0]
        for key in SCOPED:
            part = store.get((key, layer))
            if part is None:
                continue
            version = versions.pop((key, layer), None)
            stale |= version is not None and part._version != version
            store[key, layer] = part[rows.to(part.device)].to("cpu", torch.float32)  # a copy: the view is dropped
        kept[layer] = rows

    def grab(key: str, layer: int):
        def hook(act: Tensor, hook: Any) -> None:
            if act.ndim == 2 and act.shape[0] == n_batch * seq:  # positions flattened (OPT's MLP)
                act = act.reshape(n_batch, seq, -1)
            if key == "pattern" and act.ndim == 4 and act.shape[0] == n_batch and act.shape[2:] == (seq, seq):
                act = pattern_summary(act[:1, :, idx])  # [1, pos, head, 2]: kept small, never [q, k]
                store[key, layer] = act[0].detach().float().cpu()
                return
            if key == "z" and act.ndim == 4:  # [batch, pos, head, d_head] -> [batch, pos, head * d_head]
                act = act.flatten(2)
            wide = key != "pos_embed" or act.shape[-1] == view.d_model
            if act.ndim == 3 and act.shape[:2] == (n_batch, seq) and wide:
                part = (act[0] if every else act[0, idx]).detach()
                if key in _LAYERED and layer >= 0 and part.shape[-1] == view.d_model:
                    if key not in layered:  # [layer, pos, d_model], filled in place: no stack afterwards
                        layered[key] = torch.empty(view.n_layers, len(idx), view.d_model)
                    layered[key][layer].copy_(part)
                    filled.add((key, layer))
                elif keep_views and part.dtype == torch.float32 and part.device.type == "cpu":
                    store[key, layer] = part  # the activation itself: no copy (checked below)
                    versions[key, layer] = part._version
                else:
                    store[key, layer] = part.to("cpu", torch.float32, copy=True)

        return hook

    hooks = [("hook_embed", grab("embed", -1)), ("blocks.0.hook_resid_pre", grab("resid_pre0", -1))]
    if "hook_pos_embed" in view.hook_names:
        hooks.append(("hook_pos_embed", grab("pos_embed", -1)))
    reducer = None if criterion is None else \
        ResidualReducer(batch, criterion, entries=True, on_layer=settle if scoped else None)
    for plan in plans:
        for key, name in plan.hooks.items():
            fn = grab(key, plan.layer)
            if key == "resid_post" and reducer is not None:  # one hook: the copy, then the reduction
                fn = _then(fn, reducer.hook(plan.layer))
            hooks.append((name, fn))
    last = view.hook_name(view.n_layers - 1, "resid_post")
    moe: dict[int, dict[str, Tensor]] = {p.layer: {} for p in plans if p.experts is not None}
    handles = [h for p in plans if p.experts is not None
               for h in record(p.experts, positions, n_batch, seq, moe[p.layer])]
    try:
        # with a reducer the residual's largest |x| per layer is the overflow check (see below), so
        # the per-hook checks are not needed
        view.forward(batch, hooks, stop_after=last, check_finite=reducer is None)
    finally:
        for handle in handles:
            handle.remove()
    bad = None if reducer is None else reducer.first_nonfinite()
    if bad is not None:
        first = next((key for key in ("resid_pre", "attn", "resid_mid", "mlp") if (key, bad) in filled
                      and not bool(torch.isfinite(layered[key][bad]).all())), "resid_post")
        raise view.overflow_error(plans[bad].hooks.get(first, plans[bad].hooks["resid_post"]))
    if stale or any(store[key]._version != version for key, version in versions.items()):
        return capture(view, batch, positions, criterion, copy=True)  # changed in place after its hook
    notes: list[str] = []
    layers = {}
    for key in ("resid_pre", "resid_post", "attn", "mlp"):
        missed = [p.hooks[key] for p in plans if (key, p.layer) not in filled]
        if missed:
            raise MassiveLensError(f"{view.name}: hook {missed[0]} exists but did not fire with a [batch, pos, "
                                   "d_model] activation; trace_origin cannot read that term of the residual stream")
        layers[key] = layered[key]
    # a parallel block has no residual between its attention and its MLP: resid_pre + attn
    mid = layered.get("resid_mid", torch.empty_like(layers["resid_pre"]))
    for p in plans:
        if ("resid_mid", p.layer) not in filled:
            mid[p.layer] = layers["resid_pre"][p.layer] + layers["attn"][p.layer]
    layers["resid_mid"] = mid
    neuron_data = {p.layer: _neuron_data(p, store) for p in plans}
    for layer, data in moe.items():
        neuron_data[layer].update({f"moe_{k}": v for k, v in data.items()})
    pos_embed = store.get(("pos_embed", -1))
    embed, resid0 = store["embed", -1], store["resid_pre0", -1]
    if (embed.shape != resid0.shape or _rel(embed + (0 if pos_embed is None else pos_embed), resid0) > _EMBED_TOL):
        embed = resid0 - (0 if pos_embed is None else pos_embed)
        notes.append("note: hook_embed (+ hook_pos_embed) is not what the first block reads (an embedding norm "
                     "or scale comes after it); the embed term is read at blocks.0.hook_resid_pre")
    dense = [p for p in plans if p.dense]
    if len(dense) + len(moe) < len(plans):
        skipped = [p.layer for p in plans if not p.dense and p.experts is None]
        notes.append(f"note: the MLPs of layer(s) {', '.join(map(str, skipped))} are not dense MLPs with "
                     "W_in/W_out (e.g. a mixture of experts): their ledger terms are exact, but they have no "
                     "neuron rows, super weights or why-this-token attribution")
    gated = any(p.gated for p in plans)
    return Capture(positions.cpu(), embed, pos_embed, resid0, layers, is_post_norm(view), gated, reducer,
                   plans, neuron_data, notes, kept=kept)


def loosened(criterion: Criterion) -> Criterion | None:
    """``criterion`` with both thresholds scaled by :data:`CANDIDATE_LOOSE`, counting token-specific
    entries only (None where that is not a criterion: every position is then a candidate)."""
    try:
        return Criterion(criterion.abs_threshold * CANDIDATE_LOOSE,
                         max(1.0, criterion.ratio_threshold * CANDIDATE_LOOSE), criterion.median_over, "exclude")
    except MassiveLensError:  # both thresholds at their minimum
        return None


def candidates(mag: Float[Tensor, "batch pos d_model"], scale: Tensor, loose: Criterion | None
               ) -> Bool[Tensor, "batch pos"]:
    """Positions with a token-specific entry under ``loose`` (:func:`loosened`), given ``|resid|``
    and its median scale (:func:`~massive_lens.core.criterion.median_scale`): where a massive
    activation may be growing.

    >>> x = torch.ones(1, 8, 4); x[0, 0, 1] = 200.0  # 200x its median: a candidate, not massive
    >>> candidates(x, torch.ones(1, 1, 1), loosened(Criterion())).tolist()
    [[True, False, False, False, False, False, False, False]]
    """
    if loose is None:
        return torch.ones(mag.shape[:2], dtype=torch.bool, device=mag.device)
    return token_specific(loose.passes(mag, scale)).any(-1)


def refill(view: ModelView, batch: Batch, cap: Capture, needed: list[tuple[int, int]]) -> None:
    """Make sure every ``(layer, pos)`` in ``needed`` has its :data:`SCOPED` activations: where a
    layer did not keep one (it was not a candidate yet), one more pass sliced at all the needed
    positions reads them for every layer."""
    if all(cap.covers(layer, cap.index(pos)) for layer, pos in needed):
        return
    positions = sorted({int(pos) for _, pos in needed})
    extra = capture(view, batch, torch.tensor(positions), None)
    index = torch.tensor([cap.index(p) for p in positions])
    for layer, data in extra.neuron_data.items():
        cap.neuron_data.setdefault(layer, {}).update({k: v for k, v in data.items() if k in SCOPED})
        cap.kept[layer] = index


def _then(first: Any, second: Any) -> Any:
    def hook(act: Tensor, hook: Any) -> None:
        first(act, hook)
        second(act, hook)

    return hook


def pattern_summary(pattern: Float[Tensor, "batch head query key"]) -> Float[Tensor, "batch query head 2"]:
    """Per query and head: the attention on the first token and the largest attention on any
    one key (what the per-head attribution says about a head; the full pattern is not kept)."""
    p = pattern.float()
    return torch.stack([p[..., 0], p.amax(-1)], -1).transpose(1, 2)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _neuron_data(plan: BlockPlan, store: dict[tuple[str, int], Tensor]) -> dict[str, Tensor]:
    data = {key: store[key, plan.layer] for key in _NEURON_KEYS if (key, plan.layer) in store}
    if "scale" in data:
        data["scale"] = data["scale"][..., 0]
    if plan.dense and any(data.get(k) is None or data[k].shape[-1] != plan.d_mlp
                          for k in ("post", "pre", *(("up",) if plan.gated else ()))):
        return {k: v for k, v in data.items() if k not in ("post", "pre", "up")}  # hooks not per neuron
    return data
