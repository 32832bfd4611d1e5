"""The attention pass's reader (:func:`~massive_lens.core.attention_pass.attention_reading`): the
hooks that read each attention layer of a forward on the eager path (the pattern gathered with the
values, keys, ``attn.hook_z``, output and null slots' weights asked for; each query's largest attention
is the pattern's row maximum), or the fused kernel's callback on the LSE path
(:func:`~massive_lens.core.lse.lse_run`, run while the reader is entered), handing each layer over as
one :class:`~massive_lens.core.attention_pass.PassLayer` (built with ``make``) whichever path ran, and
feeding the sink rule's evidence in the same forward.

>>> from massive_lens import tiny_model
>>> from massive_lens.core.model_view import ModelView
>>> attention_layers(ModelView(tiny_model("llama", num_hidden_layers=2)))
[0, 1]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.budget import LayerTrim
from massive_lens.core.criterion import SinkEvidence, key_attention
from massive_lens.core.gather import LayerGather
from massive_lens.core.layer_attention import LayerAttention, rest_lse
from massive_lens.core.lse import LSE, lse_run
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError

__all__ = ["AttentionEdit", "PassReader", "attention_layers", "edit_hooks", "missing_attention", "positions_first",
           "rotates"]

# at length, glibc's freed transients handed back every TRIM_EVERY layers of a pass (core.budget.LayerTrim): what an
# analysis keeps of each layer lands between them, and they pile up as resident memory nothing uses. At 8,192
# tokens on SmolLM2 (docs/benchmarks.md issue 50 round 12) trace_origin's peak read 2,959-3,352 MB without (769 MB
# held: glibc's mmap threshold pinned), 1,339-1,484 MB with one every 5th layer, against an SDPA forward's 2,095 MB
TRIM_EVERY = 5


def attention_layers(view: ModelView) -> list[int]:
    """The layers with an attention pattern (not a recurrent or linear-attention layer)."""
    return [layer for layer in range(view.n_layers) if view.has_hook(layer, "attn.hook_pattern")]


def rotates(view: ModelView, layer: int) -> bool:
    """Whether ``layer`` rotates its queries and keys (a rotary hook)."""
    return view.has_hook(layer, "attn.hook_rot_k")


def missing_attention(view: ModelView, layer: int, want: set[str]) -> str | None:
    """Why ``layer`` has no attention that the eager path reads for ``want`` (its pattern, and its scores
    for ``"scores"``/``"rest_lse"``), naming the hooks; None where it has."""
    need = (["attn.hook_attn_scores"] if want & {"scores", "rest_lse"} else []) + ["attn.hook_pattern"]
    if all(view.has_hook(layer, hook) for hook in need):
        return None
    what = "scores and pattern" if len(need) > 1 else "pattern"
    return f"layer {layer} has no attention {what} hooks ({', '.join(need)})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionEdit:
    """An edit of one layer's attention, run on the eager path (the kernel would skip it):
    ``queries(q)`` gets the queries ``[batch query head d_head]`` before any rotary embedding and
    returns them edited; ``scores(scores, q, k)`` gets the scores ``[batch head query key]`` with the
    queries ``[batch query head d_head]`` and keys ``[batch key kv_head d_head]`` they came from (after
    any rotary embedding and ``queries``' edit) and returns the edited scores (None: left as they are)."""

    queries: Callable[[Tensor], Tensor] | None = None
    scores: Callable[[Tensor, Tensor, Tensor], Tensor | None] | None = None


def positions_first(x: Tensor | None, n: int) -> Tensor | None:
    """A query, key or value read ``[batch pos head d_head]`` (``n`` positions), also from a bridge whose
    hook gives ``[batch head pos d_head]`` (DeepSeek-V2's ``hook_v``)."""
    return x.transpose(1, 2) if x is not None and x.shape[1] != n and x.shape[2] == n else x


class _Edit:
    """One layer's :class:`AttentionEdit` as hooks: the queries and keys of the current forward kept
    for the scores' edit."""

    def __init__(self, edit: AttentionEdit):
        self.edit, self.seen = edit, {}

    def queries(self, q: Tensor, hook: Any) -> Tensor:
        return self.edit.queries(q)

    def keep(self, x: Tensor, hook: Any, *, key: str) -> None:
        self.seen[key] = x.detach()

    def scores(self, scores: Tensor, hook: Any) -> Tensor:
        q, k = self.seen.pop("q"), self.seen.pop("k")
        out = self.edit.scores(scores, positions_first(q, scores.shape[2]), positions_first(k, scores.shape[3]))
        return scores if out is None else out


def edit_hooks(view: ModelView, edits: dict[int, AttentionEdit]) -> list[tuple[str, Any]]:
    """The eager hooks that apply ``edits`` (per layer), to run before any hook reading that layer."""
    hooks = []
    for layer, edit in sorted(edits.items()):
        state, rot = _Edit(edit), rotates(view, layer)
        if edit.queries is not None:
            hooks.append((view.hook_name(layer, "attn.hook_q"), state.queries))
        if edit.scores is not None:
            hooks += [(view.hook_name(layer, f"attn.hook_{'rot_' if rot else ''}{key}"), partial(state.keep, key=key))
                      for key in ("q", "k")]
            hooks.append((view.hook_name(layer, "attn.hook_attn_scores"), state.scores))
    return hooks


class PassReader:
    """The pass's reading (:func:`~massive_lens.core.attention_pass.attention_reading`): ``hooks``
    to attach to each forward, run inside ``with reader:``; its per-layer state: the eager path's
    gathered hooks, the LSE path's layers waiting for their ``attn.hook_z`` (``z_read``), and the
    layers handed over (``done``)."""

    def __init__(self, view: ModelView, batch: Batch | None, on_layer: Callable[[Any], None] | None,
                 layers: set[int], cols: Tensor | Callable[[int, int, int], Tensor] | None, band: bool,
                 want: set[str], evidence: SinkEvidence | None, eager_reads: dict[str, set[int]], *, path: str,
                 out_hooks: dict[int, str] | None, evidence_resid: bool, make: Callable[..., Any],
                 null_from: dict[int, str] | None = None,
                 max_queries: Tensor | Callable[[int], Tensor | None] | None = None,
                 edits: dict[int, AttentionEdit] | None = None):
        self.view, self.batch, self.on_layer, self.layers, self.path = view, batch, on_layer, layers, path
        self.cols, self.band, self.want, self.evidence = cols, band, want, evidence
        self.eager_reads, self.make, self.max_queries = eager_reads, make, max_queries
        self.null_from = (null_from or {}) if "null" in want else {}  # eager: per layer "pattern" or "slot_pattern"
        self.pending: dict[int, Any] = {}  # LSE: layers waiting for their attn.hook_z or output
        self.z_seen: set[int] = set()
        self.done: set[int] = set()
        self.kernel: contextlib.ExitStack | None = None
        self.gathers: dict[int, LayerGather] = {}  # eager: each read layer's gather
        self.rotary: dict[int, dict[str, Tensor]] = {}  # eager: each layer's rotary cos/sin of this forward
        self.trim: LayerTrim | None = None  # every TRIM_EVERY layers handed over, at length (sized at the first)
        own = self.lse_hooks(out_hooks) if path == LSE else self.eager_hooks(out_hooks)
        self.hooks: list[tuple[str, Any]] = [*edit_hooks(view, edits or {}),
                                             *(self.resid_hooks() if evidence_resid else []), *own]

    def __enter__(self) -> PassReader:
        if self.kernel is not None:
            raise MassiveLensError(f"{self.view.name}: this attention reading is running already (with reader: once)")
        self.kernel = contextlib.ExitStack()
        if self.path == LSE:
            self.kernel.enter_context(lse_run(self.view, self.from_kernel))
        return self

    def __exit__(self, *exc: Any) -> bool:
        kernel, self.kernel = self.kernel, None
        kernel.__exit__(*exc)
        if exc[0] is None:
            self.flush()
        return False

    def columns_at(self, layer: int, batch: int, pos: int) -> Tensor | None:
        """The key columns read at ``layer`` (a function of the columns asked now)."""
        if callable(self.cols):
            return torch.as_tensor(self.cols(layer, batch, pos), dtype=torch.long).flatten()
        return self.cols

    def resid_hooks(self) -> list[tuple[str, Any]]:
        if self.evidence is None:
            return []
        return [(self.view.hook_name(layer, "resid_post"), partial(_add_resid, evidence=self.evidence, layer=layer))
                for layer in range(self.view.n_layers)]

    # ------------------------------------------------------------------ eager: the pattern and hooks
    def eager_keys(self, layer: int) -> tuple[str, ...]:
        """What the eager path gathers at ``layer`` besides the pattern."""
        def served(key: str) -> bool:
            return key not in self.eager_reads or layer in self.eager_reads[key]
        return (*(["v"] if self.want & {"z", "v"} and served("v") else []),
                *(["k"] if "k" in self.want and served("k") else []),
                *(["z_read"] if "z_read" in self.want else []), *(["out"] if "out" in self.want else []),
                *(["null"] if self.null_from.get(layer) == "slot_pattern" else []),
                *(["q"] if "q" in self.want else []), *(["scores"] if self.want & {"scores", "rest_lse"} else []))

    def eager_hooks(self, out_hooks: dict[int, str] | None) -> list[tuple[str, Any]]:
        names = {"pattern": "attn.hook_pattern", "v": "attn.hook_v", "z_read": "attn.hook_z",
                 "null": "attn.hook_slot_pattern", "scores": "attn.hook_attn_scores", "cos": "attn.hook_cos",
                 "sin": "attn.hook_sin"}
        names.update({f"out{layer}": name for layer, name in (out_hooks or {}).items()})
        gathers: dict[tuple[str, ...], LayerGather] = {}  # one per set of hooks (layers may give different ones)
        hooks = []
        # every layer read must serve a pattern (an error naming the hook where one does not)
        reads = sorted(self.layers) if self.on_layer is not None else []
        for layer in sorted(set(reads) | set(attention_layers(self.view))):
            if layer in reads:
                keys = ("pattern", *self.eager_keys(layer))
                # the hooks fire in any order (some bridges: the pattern last)
                gather = gathers.setdefault(keys, LayerGather(keys, partial(self._eager, keys=keys[1:])))
                names["k"] = "attn.hook_rot_k" if rotates(self.view, layer) else "attn.hook_k"
                names["q"] = "attn.hook_rot_q" if self.view.has_hook(layer, "attn.hook_rot_q") else "attn.hook_q"
                hooks += [(self.view.hook_name(layer, names[f"out{layer}" if key == "out" else key]),
                           gather.hook(key, layer)) for key in keys]
                self.gathers[layer] = gather
                if "rotary" in self.want:  # kept apart: a bridge may name cos/sin hooks it never fires
                    hooks += [(self.view.hook_name(layer, f"attn.hook_{key}"), partial(self._rotary, layer=layer,
                                                                                      key=key))
                              for key in ("cos", "sin") if self.view.has_hook(layer, f"attn.hook_{key}")]
            elif self.evidence is not None:
                hooks.append((self.view.hook_name(layer, "attn.hook_pattern"), partial(_add_pattern, reader=self)))
        return hooks

    def _rotary(self, x: Tensor, hook: Any, *, layer: int, key: str) -> None:
        self.rotary.setdefault(layer, {})[key] = x

    def unread(self, layer: int) -> str | None:
        """Which hooks of ``layer`` the eager path gathers but did not see fire in the last forward (the
        layer was not handed over), in words; None where the layer was read."""
        gather = self.gathers.get(layer)
        if gather is None or layer in self.done:
            return None
        first = ("q", "k", "scores")  # as the scores are made of them
        silent = sorted((key for key in gather.keys if (key, layer) not in gather.held),
                        key=lambda key: first.index(key) if key in first else len(first))
        words = {"q": "queries", "k": "keys", "v": "values", "z_read": "heads' output", "out": "output",
                 "null": "null slots"}
        rot = " (attn.hook_rot_q/hook_rot_k: the rotary embedding is applied where no hook shows it)" \
            if rotates(self.view, layer) and set(silent) <= {"q", "k"} else ""
        return f"the hooks of the {', '.join(words.get(key, key) for key in silent)} did not fire{rot}"

    def _eager(self, layer: int, pattern: Tensor, *acts: Tensor, keys: tuple[str, ...]) -> None:
        got = dict(zip(keys, acts, strict=True))
        band = self.band_of(pattern)
        n_keys, z = pattern.shape[-1], None
        v, k = positions_first(got.get("v"), n_keys), positions_first(got.get("k"), n_keys)
        q, scores = positions_first(got.get("q"), pattern.shape[2]), got.get("scores")
        z_read, heads = got.get("z_read"), pattern.shape[1]
        if z_read is not None and z_read.shape[2] != heads and z_read[0, 0].numel() % heads == 0:
            z_read = z_read.reshape(*z_read.shape[:2], heads, -1)  # per query head, as the LSE path reads hook_z
        if "z" in self.want and v is not None:  # the pattern applied to the values: one value head per query head
            z = torch.einsum("bhqk,bkhd->bqhd", pattern, v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2))
        cols = self.columns_at(layer, pattern.shape[0], pattern.shape[-1])
        self._hand(self.make(layer=layer, shape=tuple(pattern.shape), band=band if self.band else None,
                             cols=None if cols is None else pattern.index_select(-1, cols.to(pattern.device)),
                             z=z, z_read=z_read, k=k, v=v if "v" in self.want else None, out=got.get("out"),
                             null=self.null_of(layer, pattern, got.get("null")),
                             max_attention=self.max_of(layer, pattern), q=q,
                             scores=None if "scores" not in self.want
                             else scores.index_select(-1, cols.to(scores.device)),
                             rest_lse=None if "rest_lse" not in self.want else rest_lse(
                                 scores, None if self.batch is None else self.batch.mask, cols),
                             rotary=self.rotary_of(layer)))

    def rotary_of(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """The eager path's rotary ``(cos, sin)`` of ``layer`` in this forward (where wanted, and both fired)."""
        got = self.rotary.pop(layer, {})
        return (got["cos"], got["sin"]) if "rotary" in self.want and len(got) == 2 else None

    def max_at(self, layer: int) -> Tensor | None:
        """The query positions whose largest attention is read at ``layer`` (None: every query)."""
        queries = self.max_queries(layer) if callable(self.max_queries) else self.max_queries
        return None if queries is None else torch.as_tensor(queries, dtype=torch.long).flatten()

    def max_of(self, layer: int, pattern: Tensor) -> Tensor | None:
        """Each query's largest attention on one key, at :meth:`max_at`, from an eager pattern (where wanted)."""
        if "max_attention" not in self.want:
            return None
        queries = self.max_at(layer)
        top = pattern.detach().amax(-1).float()
        return top if queries is None else top[..., queries.to(top.device)]

    def null_of(self, layer: int, pattern: Tensor, slots: Tensor | None) -> Tensor | None:
        """The eager path's null mass ``[batch head query]`` where ``null_from`` names the layer: one minus
        the keys' weights (``"pattern"``) or the slots' weights summed (``"slot_pattern"``)."""
        source = self.null_from.get(layer)
        if source is None:
            return None
        weights = (pattern if source == "pattern" else slots).detach().float().sum(-1)
        return 1.0 - weights if source == "pattern" else weights

    def band_of(self, pattern: Tensor) -> tuple[Tensor, Tensor] | None:
        """The sink rule's key attention from an eager pattern (fed to the evidence), where wanted."""
        if not self.band and self.evidence is None:
            return None
        band = key_attention(pattern.detach(), self.batch.mask)
        if self.evidence is not None:
            self.evidence.add_key_attention(*band)
        return band

    # ------------------------------------------------------------------ LSE: the kernel
    def lse_hooks(self, out_hooks: dict[int, str] | None) -> list[tuple[str, Any]]:
        hooks = []
        for layer in sorted(self.layers) if self.on_layer is not None else []:
            if "z_read" in self.want and self.view.has_hook(layer, "attn.hook_z"):
                hooks.append((self.view.hook_name(layer, "attn.hook_z"), partial(self._read_z, layer=layer)))
            if "out" in self.want:
                hooks.append((self.view.hook_name(layer, out_hooks[layer]), partial(self._out, layer=layer)))
        return hooks

    def from_kernel(self, att: LayerAttention) -> None:
        for layer in sorted(k for k in self.pending if k < att.layer):  # no attn.hook_z fired there: the kernel's
            self._try(layer, force=True)
        band = att.band(self.batch.mask) if self.band or self.evidence is not None else None
        if self.evidence is not None:
            self.evidence.add_key_attention(*band)
        if att.layer not in self.layers or self.on_layer is None:
            return
        z = att.z.transpose(1, 2) if self.want & {"z", "z_read"} else None  # [batch query head d_head]
        cols = self.columns_at(att.layer, att.q.shape[0], att.q.shape[2])
        self.pending[att.layer] = self.make(
            layer=att.layer, shape=(*att.q.shape[:3], att.k.shape[2]), band=band if self.band else None,
            cols=None if cols is None else att.columns(cols), z=z if "z" in self.want else None,
            z_read=z if "z_read" in self.want else None, k=att.k.transpose(1, 2) if "k" in self.want else None,
            v=att.v.transpose(1, 2) if "v" in self.want else None,
            null=att.null_mass if "null" in self.want else None,
            max_attention=att.max_attention(self.max_at(att.layer)) if "max_attention" in self.want else None,
            q=att.q.transpose(1, 2) if "q" in self.want else None,
            scores=att.scores(cols) if "scores" in self.want else None,
            rest_lse=att.rest_lse(cols) if "rest_lse" in self.want else None,
            rotary=att.rotary if "rotary" in self.want else None)
        self._try(att.layer)

    def _read_z(self, z: Tensor, hook: Any, *, layer: int) -> None:
        if layer in self.pending:  # after any gate or sub-norm the attention applies to the kernel's output
            at = self.pending[layer]
            self.pending[layer] = dataclasses.replace(at, z_read=z.detach().reshape(at.z_read.shape))
            self.z_seen.add(layer)
            self._try(layer)

    def _out(self, out: Tensor, hook: Any, *, layer: int) -> None:
        if layer in self.pending:
            self.pending[layer] = dataclasses.replace(self.pending[layer], out=out)
            self._try(layer)

    def _try(self, layer: int, force: bool = False) -> None:
        """Hand ``layer`` over once it has its output (where wanted) and its ``attn.hook_z`` (where
        wanted and served; ``force``: the kernel's output stands in, the hook did not fire)."""
        at = self.pending[layer]
        if "out" in self.want and at.out is None:
            return
        if not force and "z_read" in self.want and self.view.has_hook(layer, "attn.hook_z") \
                and layer not in self.z_seen:
            return
        self._hand(self.pending.pop(layer))

    def flush(self) -> None:
        """Hand over what is still pending once the forward is done."""
        for layer in sorted(self.pending):
            self._try(layer, force=True)

    def _hand(self, at: Any) -> None:
        self.done.add(at.layer)
        if self.on_layer is not None:
            self.on_layer(at)
        if self.trim is None:  # the pattern's batch x query positions, a layer's [.., d_model] float32
            self.trim = LayerTrim(at.shape[0] * at.shape[2], self.view.d_model, TRIM_EVERY)
        self.trim()


def _add_pattern(pattern: Tensor, hook: Any, *, reader: PassReader) -> None:
    reader.band_of(pattern)


def _add_resid(resid: Tensor, hook: Any, *, evidence: SinkEvidence, layer: int) -> None:
    evidence.add_resid(layer, resid)
