"""The one forward pass of :func:`massive_lens.trace_origin`.

Every hook slices the activation at the traced positions the moment it fires (never a full cache);
which hook holds what is read block by block (:func:`~massive_lens.origin.blocks.block_plan`).
``hook_embed`` (+ ``hook_pos_embed`` where a learned positional embedding fires) sums to
``blocks.0.hook_resid_pre`` (Gemma's ``sqrt(d_model)`` embedding scale is already in it); where it does
not (an embedding LayerNorm, as in BLOOM, or a scale applied after the hook), the embedding term is
read where the first block reads it (``resid_pre`` minus the positional term). A hook that fires with
the positions flattened (``[batch * pos, ...]``, as in OPT's MLP) is reshaped back. The heads' outputs
and where each head looks (its attention on the first token and its largest on one key) are read
through the attention pass (:func:`~massive_lens.core.attention_pass.attention_reading`) on the path
:func:`~massive_lens.core.attention_pass.choose_path` takes for the text: the eager pattern on a short
text or with an edit attached, the fused kernel on a long one.

Tracing every massive entry of a text, the pass cannot know which positions it traces until the last
layer, yet only those need the MLP's neuron-level activations (``d_mlp`` wide, the bulk of what a pass
would keep). So each layer keeps them only at its *candidates*: positions where a token-specific entry
passes a criterion ten times looser (:data:`CANDIDATE_LOOSE`) at this layer or an earlier one, decided
when the layer's ``hook_resid_post`` fires (:attr:`Capture.kept`). An MLP event at a position a layer
did not keep is read by :func:`refill`, a second pass sliced at the traced positions. A long text's one
pass, which keeps every term at the candidates only, is :mod:`massive_lens.origin.one_pass`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core import sparse_bool
from massive_lens.core.attention_pass import PassLayer, attention_reading, choose_path
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.outliers import token_specific
from massive_lens.core.pass_reader import PassReader, attention_layers
from massive_lens.core.reduce import ResidualReducer
from massive_lens.core.stats import rel_error
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError
from massive_lens.origin.blocks import BlockPlan, block_plan, is_post_norm
from massive_lens.origin.experts import record

_EMBED_TOL = 1e-5  # relative: embed (+ pos_embed) vs resid_pre of block 0
SCOPED = ("post", "pre", "up", "norm_in", "norm_out", "scale")  # kept at each layer's candidate positions only
CANDIDATE_LOOSE = 0.1  # a candidate passes the criterion with both thresholds scaled by this


@dataclass(kw_only=True)
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
    _where: dict[int, int] | None = field(default=None, init=False, repr=False)  # position -> index, see index()
    norms: dict[int, tuple[Tensor, Tensor, bool]] = field(default_factory=dict, repr=False)  # layer -> norm_affine
    kept: dict[int, Tensor] = field(default_factory=dict, repr=False)  # layer -> indices SCOPED keys hold (else all)
    missing: Tensor | None = field(default=None, repr=False)  # one_pass: chosen positions not kept at every layer
    final: Tensor | None = field(default=None, repr=False)  # [missing, d_model]: their last resid_post, where kept

    def index(self, pos: int) -> int:  # the position -> index map is built once (asked hundreds of times)
        self._where = self._where or {int(p): i for i, p in enumerate(self.positions.tolist())}
        return self._where[int(pos)]

    def at(self, key: str, layer: int) -> Tensor | None:
        """``[pos, _]`` of a per-block key (None: not in the block; :data:`SCOPED` keys: read with :meth:`row`)."""
        return self.layers[key][layer] if key in self.layers else self.neuron_data.get(layer, {}).get(key)

    def covers(self, layer: int, index: int) -> bool:  # whether layer's SCOPED keys hold capture index index
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
        where = None if rows is None else (rows == index).nonzero()
        return index if where is None else int(where[0]) if len(where) else None


LAYERED = ("resid_pre", "resid_post", "attn", "mlp", "resid_mid")  # [layer, pos, d_model] in Capture.layers
_NEURON_KEYS = ("post", "pre", "up", "norm_in", "norm_out", "scale", "mlp_raw", "attn_raw", "z", "pattern")


def capture(
    view: ModelView, batch: Batch, positions: Int[Tensor, " pos"], criterion: Criterion | None, copy: bool = False,
) -> Capture:
    """One no-grad forward pass; with ``criterion`` also find the massive entries (in-hook).

    Where every position of a one-text float32 CPU batch is kept, the per-neuron hooks keep
    the activations themselves, not copies; an activation the model then changes in place (its
    version counter moved) makes the pass run again with copies (``copy=True``)."""
    state = CapturePass(view, batch, positions, criterion, copy)
    state.run()
    if state.changed_in_place():
        return capture(view, batch, positions, criterion, copy=True)
    return state.result()


class CapturePass:
    """What one :func:`capture` pass has kept so far, and the steps that keep and assemble it: :meth:`run`
    attaches :meth:`hooks` (each calls :meth:`keep`; tracing every massive entry, each layer's ``hook_resid_post``
    also calls :meth:`settle` through the reducer, to cut that layer's :attr:`CUT` activations to the
    candidates); :meth:`changed_in_place` says whether a kept view moved; :meth:`result` builds the Capture.
    :class:`~massive_lens.origin.one_pass.OnePass` overrides the steps marked so."""

    CUT: tuple[str, ...] = SCOPED  # the keys a settled layer holds at its candidates only

    def __init__(self, view: ModelView, batch: Batch, positions: Tensor, criterion: Criterion | None,
                 copy: bool) -> None:
        self.view, self.batch, self.positions = view, batch, positions
        self.plans = tuple(block_plan(view, layer) for layer in range(view.n_layers))
        self.n_batch, self.seq = batch.tokens.shape
        self.idx, seq = positions.to(view.input_device), self.seq
        self.every = len(positions) == seq and bool((positions.cpu() == torch.arange(seq)).all())  # no gather
        self.keep_views = self.every and self.n_batch == 1 and not copy  # keep activations, not copies
        scoped = self.every and criterion is not None  # trace every massive entry: CUT keys at candidates only
        self.loose = loosened(criterion) if scoped else None
        self.reducer = None if criterion is None else \
            ResidualReducer(batch, criterion, entries=True, on_layer=self.settle if scoped else None)
        self.store: dict[tuple[str, int], Tensor] = {}  # (key, layer) -> [pos, _]; layer -1 for the embeddings
        self.layered: dict[str, Tensor] = {}  # LAYERED key -> [layer, pos, d_model], filled in place
        self.filled: set[tuple[str, int]] = set()  # (key, layer) written into layered
        self.versions: dict[tuple[str, int], int] = {}  # (key, layer) -> version counter of a kept activation
        self.candidate = torch.zeros(seq, dtype=torch.bool)  # positions that were candidates at any layer so far
        self.kept: dict[int, Tensor] = {}  # layer -> the rows its CUT keys hold (see Capture.kept)
        self.stale = False  # a kept activation changed in place before its layer was settled
        self.moe: dict[int, dict[str, Tensor]] = {p.layer: {} for p in self.plans if p.experts is not None}
        self.missing: Tensor | None = None  # Capture.missing and Capture.final (OnePass sets them)
        self.final: Tensor | None = None
        self.reader = self.attention()

    def hooks(self) -> list[tuple[str, Any]]:
        """(hook name, function) for every key of every block, and the embeddings."""
        hooks = [("hook_embed", partial(self.keep, "embed", -1)),
                 (self.view.block_hook(0, "resid_pre"), partial(self.keep, "resid_pre0", -1))]
        if "hook_pos_embed" in self.view.hook_names:
            hooks.append(("hook_pos_embed", partial(self.keep, "pos_embed", -1)))
        for plan in self.plans:
            for key, name in plan.hooks.items():
                if key == "pattern" or (key == "z" and self.reader is not None):  # read through the attention pass
                    continue
                fn = partial(self.keep, key, plan.layer)
                if key == "resid_post" and self.reducer is not None:  # one hook: the copy, then the reduction
                    fn = partial(_both, fn, self.reducer.hook(plan.layer))
                hooks.append((name, fn))
        return hooks

    def run(self) -> None:
        """The forward pass (to the last block's residual), then the overflow check."""
        hooks = self.hooks() + (self.reader.hooks if self.reader is not None else [])
        handles = [h for p in self.plans if p.experts is not None
                   for h in record(p.experts, self.positions, self.n_batch, self.seq, self.moe[p.layer])]
        try:
            with self.reader if self.reader is not None else contextlib.nullcontext():
                # with a reducer the residual's largest |x| per layer is the overflow check (below)
                self.view.forward(self.batch, hooks, check_finite=self.reducer is None,
                                  stop_after=self.view.hook_name(self.view.n_layers - 1, "resid_post"))
        finally:
            for handle in handles:
                handle.remove()
        bad = None if self.reducer is None else self.reducer.first_nonfinite()
        if bad is not None:
            first = next((key for key in ("resid_pre", "attn", "resid_mid", "mlp") if (key, bad) in self.filled
                          and not bool(torch.isfinite(self.layered[key][bad]).all())), "resid_post")
            raise self.view.overflow_error(self.plans[bad].hooks.get(first, self.plans[bad].hooks["resid_post"]))

    def attention(self) -> PassReader | None:
        """The attention pass's reading of the heads' outputs and where they look on ``choose_path``'s
        path (None where neither the pattern nor the kernel runs: ``hook_z`` is read where it fires)."""
        try:
            path = choose_path(self.view, "auto", self.batch)
        except MassiveLensError:
            return None
        layers = [layer for layer in attention_layers(self.view) if "z" in self.plans[layer].hooks]
        return attention_reading(self.view, self.read, path=path, columns=[0], want={"z_read", "max_attention"},
                                 layers=layers, max_queries=self.max_queries())

    def max_queries(self) -> Any:  # OnePass: the queries the heads are read at (every one: None)
        return None if self.every else self.positions

    def read_rows(self, layer: int) -> Tensor | None:  # OnePass: the rows of the queries max_queries named
        return None if self.every else self.idx

    def read(self, at: PassLayer) -> None:
        """One attention layer: ``hook_z`` (:meth:`keep`); per query and head, attention on token 0 and its top."""
        self.keep("z", at.layer, at.z_read)
        rows = self.read_rows(at.layer)
        first = at.cols[:1, :, :, 0] if rows is None else at.cols[:1, :, rows.to(at.cols.device), 0]
        summary = torch.stack([first.float(), at.max_attention[:1]], -1).transpose(1, 2)  # [1, pos, head, 2]
        self.store["pattern", at.layer] = summary[0].detach().float().cpu()

    def keep(self, key: str, layer: int, act: Tensor, hook: Any = None) -> None:
        """The hook of ``key`` at ``layer``: keep the activation at the traced positions."""
        n_batch, seq = self.n_batch, self.seq
        if act.ndim == 2 and act.shape[0] == n_batch * seq:  # positions flattened (OPT's MLP)
            act = act.reshape(n_batch, seq, -1)
        if key == "z" and act.ndim == 4:  # [batch, pos, head, d_head] -> [batch, pos, head * d_head]
            act = act.flatten(2)
        wide = key != "pos_embed" or act.shape[-1] == self.view.d_model
        if act.ndim == 3 and act.shape[:2] == (n_batch, seq) and wide:
            self.hold(key, layer, act)

    def hold(self, key: str, layer: int, act: Float[Tensor, "batch pos _"]) -> None:  # OnePass: its own rows
        """Keep ``act`` (a ``[batch, pos, _]`` activation) at the traced positions."""
        part = (act[0] if self.every else act[0, self.idx]).detach()
        if key in LAYERED and layer >= 0 and part.shape[-1] == self.view.d_model:
            if key not in self.layered:  # [layer, pos, d_model], filled in place: no stack afterwards
                self.layered[key] = torch.empty(self.view.n_layers, len(self.idx), self.view.d_model)
            self.layered[key][layer].copy_(part)
            self.filled.add((key, layer))
        else:
            self.hold_part(key, layer, part)

    def hold_part(self, key: str, layer: int, part: Float[Tensor, "pos _"]) -> None:
        """Keep ``part`` as it is where that is safe (checked by :meth:`changed_in_place`), else a copy."""
        if self.keep_views and part.dtype == torch.float32 and part.device.type == "cpu":
            self.store[key, layer] = part  # the activation itself: no copy (see changed_in_place)
            self.versions[key, layer] = part._version
        else:
            self.store[key, layer] = part.to("cpu", torch.float32, copy=True)

    def settle(self, layer: int, mag: Tensor, scale: Tensor) -> None:  # OnePass: the rows it kept first
        """Keep layer ``layer``'s CUT activations at the candidates so far (all while they are many)."""
        self.candidate.logical_or_(candidates(mag, scale, self.loose)[0].cpu())
        if layer in self.kept or 2 * int(self.candidate.sum()) > self.seq:
            return
        self.cut_to(layer, self.candidate.nonzero()[:, 0])

    def cut_to(self, layer: int, rows: Tensor) -> None:  # OnePass: also the rows its next layers keep
        """Cut ``layer``'s CUT activations to ``rows`` (copies: the views are dropped)."""
        for key in self.CUT:
            part = self.store.get((key, layer))
            if part is None:
                continue
            version = self.versions.pop((key, layer), None)
            self.stale |= version is not None and part._version != version
            self.store[key, layer] = part[rows.to(part.device)].to("cpu", torch.float32)
        self.kept[layer] = rows

    def changed_in_place(self) -> bool:  # whether the model changed a kept view after its hook fired
        return self.stale or any(self.store[key]._version != version for key, version in self.versions.items())

    def result(self) -> Capture:  # OnePass: first cut to the positions chosen
        layers, notes = self._layers(), []
        embed, pos_embed, resid0 = self._embeddings(notes)
        neuron_data = {p.layer: _neuron_data(p, self.store) for p in self.plans}
        for layer, data in self.moe.items():
            neuron_data[layer].update({f"moe_{k}": v for k, v in data.items()})
        if any(not p.dense and p.experts is None for p in self.plans):
            skipped = [p.layer for p in self.plans if not p.dense and p.experts is None]
            notes.append(f"note: the MLPs of layer(s) {', '.join(map(str, skipped))} are not dense MLPs with "
                         "W_in/W_out (e.g. a mixture of experts): their ledger terms are exact, but they have no "
                         "neuron rows, super weights or why-this-token attribution")
        return Capture(positions=self.positions.cpu(), embed=embed, pos_embed=pos_embed, resid_pre0=resid0,
                       layers=layers, post_norm=is_post_norm(self.view), gated=any(p.gated for p in self.plans),
                       reducer=self.reducer, plans=self.plans, neuron_data=neuron_data, notes=notes, kept=self.kept,
                       missing=self.missing, final=self.final)

    def _layers(self) -> dict[str, Tensor]:
        """``[layer, pos, d_model]`` per residual key; a parallel block's ``resid_mid`` is resid_pre + attn."""
        layers = {}
        for key in ("resid_pre", "resid_post", "attn", "mlp"):
            missed = [p.hooks[key] for p in self.plans if (key, p.layer) not in self.filled]
            if missed:
                raise MassiveLensError(f"{self.view.name}: hook {missed[0]} exists but did not fire with a [batch, "
                                       "pos, d_model] activation; trace_origin cannot read that term of the residual "
                                       "stream")
            layers[key] = self.layered[key]
        mid = self.layered.get("resid_mid", torch.empty_like(layers["resid_pre"]))
        for p in self.plans:
            if ("resid_mid", p.layer) not in self.filled:
                mid[p.layer] = layers["resid_pre"][p.layer] + layers["attn"][p.layer]
        layers["resid_mid"] = mid
        return layers

    def _embeddings(self, notes: list[str]) -> tuple[Tensor, Tensor | None, Tensor]:
        """``embed``, ``pos_embed`` and ``resid_pre`` of block 0 (embed read there where the hooks disagree)."""
        pos_embed = self.store.get(("pos_embed", -1))
        embed, resid0 = self.store["embed", -1], self.store["resid_pre0", -1]
        summed = embed + (0 if pos_embed is None else pos_embed) if embed.shape == resid0.shape else None
        if summed is None or (resid0.numel() and rel_error(summed, resid0) > _EMBED_TOL):  # none kept: read again
            embed = resid0 - (0 if pos_embed is None else pos_embed)
            notes.append("note: hook_embed (+ hook_pos_embed) is not what the first block reads (an embedding norm "
                         "or scale comes after it); the embed term is read at blocks.0.hook_resid_pre")
        return embed, pos_embed, resid0


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
    return sparse_bool.any_along(token_specific(loose.passes(mag, scale)), -1)


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


def _both(first: Any, second: Any, act: Tensor, hook: Any) -> None:  # one hook: first, then second
    first(act, hook)
    second(act, hook)


def _neuron_data(plan: BlockPlan, store: dict[tuple[str, int], Tensor]) -> dict[str, Tensor]:
    data = {key: store[key, plan.layer] for key in _NEURON_KEYS if (key, plan.layer) in store}
    if "scale" in data:
        data["scale"] = data["scale"][..., 0]
    if plan.dense and any(data.get(k) is None or data[k].shape[-1] != plan.d_mlp
                          for k in ("post", "pre", *(("up",) if plan.gated else ()))):
        return {k: v for k, v in data.items() if k not in ("post", "pre", "up")}  # hooks not per neuron
    return data
