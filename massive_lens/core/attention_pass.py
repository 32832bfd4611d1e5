"""One attention pass: every attention analysis reads its layers here, whichever path ran.

:func:`attention_pass` runs one forward and hands each attention layer one :class:`PassLayer`:
the attention on a few key ``columns``, the sink rule's ``band`` (each key's mean attention from
the queries after it), the heads' outputs ``z`` (the attention applied to the values), what the
output projection reads (``z_read``, ``attn.hook_z`` where it fires), the keys ``k`` and values ``v``
and the attention output ``out``: only what the caller asks for in ``want``. On the eager path they come
from the pattern, ``z``/``v`` and output hooks; on the LSE path (:mod:`massive_lens.core.lse`)
from the fused kernel's ``q``, ``k`` and log-sum-exp; an nnsight view takes the LSE path. The
caller picks the path with :func:`choose_path` (``"auto"``: the eager pattern below
:data:`LSE_FROM` tokens, where it is the faster, and whenever an edit is attached, which the
kernel would skip; the LSE path above) and reduces what it is handed: no analysis branches on
the path. With a
:class:`~massive_lens.core.criterion.SinkEvidence` the pass also feeds the sink rule (every
layer's residual stream and key attention) in the same forward. Hooks and the kernel are put
back on exit, exceptions included.

>>> from massive_lens import tiny_model
>>> from massive_lens.core.model_view import ModelView
>>> view = ModelView(tiny_model("llama"))
>>> batch = view.tokenize("Hello there.")
>>> seen = {}
>>> for path in ("eager", "lse"):
...     attention_pass(view, batch, lambda at: seen.setdefault(path, at.cols), path=path, columns=[0])
>>> torch.allclose(seen["eager"].float(), seen["lse"], atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.criterion import SinkEvidence, key_attention
from massive_lens.core.gather import LayerGather
from massive_lens.core.layer_attention import LayerAttention
from massive_lens.core.lse import EAGER, LSE, PATHS, attached_attention_edits, lse_run, lse_support
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError

__all__ = ["LSE_FROM", "PassLayer", "attention_output_hook", "attention_pass", "choose_path"]

log = logging.getLogger(__name__)

WANTS = ("z", "z_read", "k", "v", "out")
# "auto" reads the eager pattern below this many positions, the LSE path from it: the measured
# crossover (CPU time, one thread, SmolLM2-135M: every attention analysis is faster on the eager
# path at 128 tokens, even at 512, and 2.1-2.5x faster on the LSE path at 2,048; docs/benchmarks.md,
# issue 50, `python -m benchmarks.path_crossover`). Both paths' attention costs grow alike with the
# heads and their width; what differs is the eager pattern's O(length^2) per head against the LSE
# path's band of O(length x 128), so the crossover is a length, not a model size.
LSE_FROM = 512


@dataclass(frozen=True, kw_only=True)
class PassLayer:
    """One attention layer as the pass read it. ``cols [batch head query col]``: the attention on
    the requested key columns (None without ``columns``); ``band``: the sink rule's
    ``(mass [batch head key], count [batch key])`` (:func:`~massive_lens.core.criterion.key_attention`;
    None unless asked); ``z [batch query head d_head]``: the attention applied to the values (the
    eager pattern times ``v``, or the kernel's output); ``z_read``: what the output projection reads
    (``attn.hook_z`` where it fires, else ``z``); ``k``/``v [batch key kv_head d_head]``: the keys as the
    scores use them (after any rotary embedding) and the values (None on the eager path where the
    caller's ``eager_reads`` leaves the layer out); ``out``: the
    output hook's activation; ``shape``: the pattern's ``(batch, head, query, key)``; ``null
    [batch head query]``: on the LSE path, the attention to a learned sink logit
    (:attr:`~massive_lens.core.layer_attention.LayerAttention.null_mass`; None without one, and on the eager
    path, whose null mass :class:`~massive_lens.attention.null_mass.NullReader` reads)."""

    layer: int
    shape: tuple[int, ...]
    cols: Tensor | None = None
    band: tuple[Tensor, Tensor] | None = None
    z: Tensor | None = None
    z_read: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    out: Tensor | None = None
    null: Tensor | None = None


def attention_pass(view: ModelView, batch: Batch, on_layer: Callable[[PassLayer], None] | None, *, path: str,
                   columns: Sequence[int] | Tensor | None = None, band: bool = False, want: Iterable[str] = (),
                   layers: Iterable[int] | None = None, out_hooks: dict[int, str] | None = None,
                   eager_reads: dict[str, Iterable[int]] | None = None,
                   evidence: SinkEvidence | None = None, evidence_resid: bool = True,
                   hooks: Sequence[tuple[str, Any]] = (),
                   stop_after: str | None = None, check_finite: bool = True) -> None:
    """One forward of ``batch`` handing every attention layer of ``layers`` (None: every layer with an
    attention pattern; a hybrid model's linear-attention layers have none) to
    ``on_layer`` as a :class:`PassLayer` read on ``path`` (``"eager"`` or ``"lse"``, from
    :func:`choose_path`).

    ``columns``: key positions whose attention every query gives (``cols``); ``band``: the sink
    rule's key attention; ``want``: any of ``"z"``, ``"z_read"``, ``"k"``, ``"v"``, ``"out"`` (``out_hooks``
    names each layer's output hook, e.g. :func:`attention_output_hook`'s); ``eager_reads``: for ``"k"`` and ``"v"``,
    the layers whose eager hooks give them per head (``attn.hook_rot_k`` where the model names it, else
    ``attn.hook_k``; ``attn.hook_v``), a capability the caller knows (e.g. from a probe): elsewhere the
    eager path hands None (and no ``z``) and reads no such hook; the LSE path reads them from the kernel at
    every layer (default: every layer, both); ``evidence``: fed every layer's
    key attention and (``evidence_resid``) residual stream; ``hooks``: the caller's own, run in the same forward.
    The forward stops after ``stop_after`` (None: the last layer the pass reads)."""
    want = set(want)
    if want - set(WANTS) or path not in (EAGER, LSE) or set(eager_reads or {}) - {"k", "v"}:
        raise MassiveLensError(f"want is a subset of {WANTS}, path 'eager' or 'lse' and eager_reads keyed by 'k' or "
                               f"'v', got {sorted(want)}, {path!r}, {sorted(eager_reads or {})}")
    if "out" in want and not out_hooks:
        raise MassiveLensError("want='out' needs out_hooks: each layer's output hook (attention_output_hook's "
                               "for the attention output)")
    # None: the layers with a pattern; a model with none is refused below, naming the pattern hook it lacks
    layers = set((_attention_layers(view) or range(view.n_layers)) if layers is None else layers)
    cols = None if columns is None else torch.as_tensor(columns, dtype=torch.long).flatten()
    reader = _Reader(view, batch, on_layer, layers, cols, band, want, evidence,
                     {key: set(at) for key, at in (eager_reads or {}).items()})
    own = reader.lse_hooks(out_hooks) if path == LSE else reader.eager_hooks(out_hooks)
    own = [*(reader.resid_hooks() if evidence_resid else []), *own]
    all_hooks = [*hooks, *own]
    if not all_hooks:
        raise MassiveLensError(f"{view.name}: the attention pass has no layer to read")
    deepest = view.n_layers - 1 if hooks or evidence is not None or on_layer is None else max(layers, default=0)
    last = stop_after or _last(view, all_hooks, deepest)
    with lse_run(view, reader.from_kernel) if path == LSE else contextlib.nullcontext():
        # a stop of the pass's own choosing only saves time: where the bridge never fires it
        # (OpenAI GPT's resid_post), the pass runs to the end
        view.forward(batch, all_hooks, stop_after=last, check_finite=check_finite, must_stop=stop_after is not None)
    reader.flush()
    missed = sorted(layers.intersection(reader.attn_layers()) - reader.done)
    if on_layer is not None and missed:
        raise MassiveLensError(f"{view.name}: the attention hooks (pattern, and the values, heads' or attention "
                               f"output asked for) of layer {missed[0]} did not all fire; the attention pass "
                               "cannot read that layer")


def choose_path(view: ModelView, attention: str, batch: Batch) -> str:
    """``"eager"`` or ``"lse"``, the path that reads ``batch``'s attention as ``attention`` asks:
    ``"auto"`` takes the eager pattern where the view serves one and ``batch`` is shorter than
    :data:`LSE_FROM` positions (the faster path there), else the LSE path where the model supports
    it and no hook the LSE path would skip is attached
    (:func:`~massive_lens.core.lse.attached_attention_edits`), else the eager pattern. An nnsight
    view serves no pattern: the LSE path at every length. ``"lse"`` where it cannot run, or would
    skip an attached edit, and ``"eager"`` on a view without patterns are a :class:`MassiveLensError`
    naming why.

    >>> from massive_lens import tiny_model
    >>> view = ModelView(tiny_model("llama"))
    >>> batch = view.tokenize("Hello there.")  # shorter than LSE_FROM
    >>> choose_path(view, "auto", batch), choose_path(view, "lse", batch)
    ('eager', 'lse')
    """
    if attention not in PATHS:
        raise MassiveLensError(f"attention must be one of {PATHS} ('auto': the eager pattern below {LSE_FROM} "
                               "tokens, the fused kernel's log-sum-exp from there where the model supports it), "
                               f"got {attention!r}")
    refusal = view.pattern_refusal()  # a view that serves no pattern (nnsight): the LSE path or nothing
    if attention == EAGER or (attention == "auto" and not refusal and batch.mask.shape[-1] < LSE_FROM):
        if refusal:
            raise MassiveLensError(refusal)
        return EAGER
    reason = lse_support(view)
    if reason is None:
        edits = attached_attention_edits(view)
        if not edits:
            return LSE
        if attention == LSE:
            more = f" and {len(edits) - 3} more" if len(edits) > 3 else ""
            raise MassiveLensError(
                f"{view.name} has hooks attached at {', '.join(edits[:3])}{more}, which the LSE path does not run "
                "(it runs the attention on the fused kernel, where score, pattern and rotary hooks never fire and "
                "the heads' output is read before hook_z), so it would measure the unedited model; use "
                "attention='eager' or 'auto' (which read the edited pattern while such hooks are attached)")
        log.info("%s: hooks at %s edit the attention; reading the eager pattern", view.name, ", ".join(edits))
        return EAGER
    if refusal:
        raise MassiveLensError(f"{view.name} cannot give the attention's log-sum-exp from a fused kernel: {reason}; "
                               f"and the eager pattern does not run either: {refusal.split('; ', 1)[0]}")
    if attention == LSE:
        raise MassiveLensError(f"{view.name} cannot give the attention's log-sum-exp from a fused kernel: {reason}; "
                               "use attention='eager' (the pattern) or 'auto'")
    return EAGER


def attention_output_hook(view: ModelView, layer: int, path: str) -> str:
    """Where the pass reads a layer's attention output on ``path``: the output projection's own hook
    (``attn.o.hook_out``: ``z @ W_O + b_O`` and nothing else) where there is one, else ``attn.hook_out``
    (which on some bridges, e.g. BLOOM's, also holds the residual added inside the HF attention
    module). On the LSE path the Hugging Face attention runs its own code, so ``attn.o`` fires only
    where that code calls the bridge's projection (Llama's ``o_proj``; GPT-2's ``c_proj`` is its own
    module).

    >>> from massive_lens import tiny_model
    >>> attention_output_hook(ModelView(tiny_model("llama")), 0, "lse")
    'attn.o.hook_out'
    """
    if not view.has_hook(layer, "attn.o.hook_out"):
        return "attn.hook_out"
    if path == LSE:
        attn = view.block(layer).attn
        hf = getattr(attn, "original_component", None)
        if hf is not None and not any(child is attn.o for child in hf.children()):
            return "attn.hook_out"
    return "attn.o.hook_out"


def _attention_layers(view: ModelView) -> list[int]:
    """The layers with an attention pattern (not a recurrent or linear-attention layer)."""
    return [layer for layer in range(view.n_layers) if view.has_hook(layer, "attn.hook_pattern")]


def _last(view: ModelView, hooks: Sequence[tuple[str, Any]], deepest: int) -> str:
    """Where the forward can stop: the residual stream after block ``deepest`` (every hook of a
    block fires before it), or the last of ``hooks`` in a model without one."""
    if view.has_hook(deepest, "resid_post"):
        return view.hook_name(deepest, "resid_post")
    return hooks[-1][0]


class _Reader:
    """The pass's per-layer state: the eager path's gathered hooks, the LSE path's layers waiting
    for their ``attn.hook_z`` (``z_read``), and the layers handed over."""

    def __init__(self, view: ModelView, batch: Batch, on_layer: Callable[[PassLayer], None] | None,
                 layers: set[int], cols: Tensor | None, band: bool, want: set[str], evidence: SinkEvidence | None,
                 eager_reads: dict[str, set[int]]):
        self.view, self.batch, self.on_layer, self.layers = view, batch, on_layer, layers
        self.cols, self.band, self.want, self.evidence = cols, band, want, evidence
        self.eager_reads = eager_reads
        self.pending: dict[int, PassLayer] = {}  # LSE: layers waiting for their attn.hook_z or output
        self.z_seen: set[int] = set()
        self.done: set[int] = set()

    def attn_layers(self) -> list[int]:
        return _attention_layers(self.view)

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
                *(["z_read"] if "z_read" in self.want else []), *(["out"] if "out" in self.want else []))

    def eager_hooks(self, out_hooks: dict[int, str] | None) -> list[tuple[str, Any]]:
        names = {"pattern": "attn.hook_pattern", "v": "attn.hook_v", "z_read": "attn.hook_z"}
        names.update({f"out{layer}": name for layer, name in (out_hooks or {}).items()})
        gathers: dict[tuple[str, ...], LayerGather] = {}  # one per set of hooks (layers may give different ones)
        hooks = []
        # every layer read must serve a pattern (an error naming the hook where one does not)
        reads = sorted(self.layers) if self.on_layer is not None else []
        for layer in sorted(set(reads) | set(self.attn_layers())):
            if layer in reads:
                keys = ("pattern", *self.eager_keys(layer))
                # the hooks fire in any order (some bridges: the pattern last)
                gather = gathers.setdefault(keys, LayerGather(keys, partial(self._eager, keys=keys[1:])))
                names["k"] = "attn.hook_rot_k" if self.view.has_hook(layer, "attn.hook_rot_k") else "attn.hook_k"
                hooks += [(self.view.hook_name(layer, names[f"out{layer}" if key == "out" else key]),
                           gather.hook(key, layer)) for key in keys]
            elif self.evidence is not None:
                hooks.append((self.view.hook_name(layer, "attn.hook_pattern"), partial(_add_pattern, reader=self)))
        return hooks

    def _eager(self, layer: int, pattern: Tensor, *acts: Tensor, keys: tuple[str, ...]) -> None:
        got = dict(zip(keys, acts, strict=True))
        band = self.band_of(pattern)
        v, k, z = got.get("v"), got.get("k"), None
        if v is not None and v.shape[1] != pattern.shape[-1] and v.shape[2] == pattern.shape[-1]:
            v = v.transpose(1, 2)  # a bridge whose hook_v is [batch kv_head key d_head] (DeepSeek-V2's)
        if k is not None and k.shape[1] != pattern.shape[-1] and k.shape[2] == pattern.shape[-1]:
            k = k.transpose(1, 2)
        z_read, heads = got.get("z_read"), pattern.shape[1]
        if z_read is not None and z_read.shape[2] != heads and z_read[0, 0].numel() % heads == 0:
            z_read = z_read.reshape(*z_read.shape[:2], heads, -1)  # per query head, as the LSE path reads hook_z
        if "z" in self.want and v is not None:  # the pattern applied to the values: one value head per query head
            z = torch.einsum("bhqk,bkhd->bqhd", pattern, v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2))
        self._hand(PassLayer(layer=layer, shape=tuple(pattern.shape), band=band if self.band else None,
                             cols=None if self.cols is None else pattern[..., self.cols.to(pattern.device)],
                             z=z, z_read=z_read, k=k, v=v if "v" in self.want else None, out=got.get("out")))

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
        if not hooks and self.evidence is None:  # hooks that read nothing: the forward checks them for NaN and inf
            hooks = [(self.view.hook_name(layer, "resid_post"), _watch) for layer in range(self.view.n_layers)]
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
        self.pending[att.layer] = PassLayer(
            layer=att.layer, shape=(*att.q.shape[:3], att.k.shape[2]), band=band if self.band else None,
            cols=None if self.cols is None else att.columns(self.cols), z=z if "z" in self.want else None,
            z_read=z if "z_read" in self.want else None, k=att.k.transpose(1, 2) if "k" in self.want else None,
            v=att.v.transpose(1, 2) if "v" in self.want else None,
            null=att.null_mass)
        self._try(att.layer)

    def _read_z(self, z: Tensor, hook: Any, *, layer: int) -> None:
        if layer in self.pending:  # after any gate or sub-norm the attention applies to the kernel's output
            at = self.pending[layer]
            self.pending[layer] = _replace(at, z_read=z.detach().reshape(at.z_read.shape))
            self.z_seen.add(layer)
            self._try(layer)

    def _out(self, out: Tensor, hook: Any, *, layer: int) -> None:
        if layer in self.pending:
            self.pending[layer] = _replace(self.pending[layer], out=out)
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

    def _hand(self, at: PassLayer) -> None:
        self.done.add(at.layer)
        if self.on_layer is not None:
            self.on_layer(at)


def _replace(at: PassLayer, **changes: Any) -> PassLayer:
    return PassLayer(**{**at.__dict__, **changes})


def _add_pattern(pattern: Tensor, hook: Any, *, reader: _Reader) -> None:
    reader.band_of(pattern)


def _add_resid(resid: Tensor, hook: Any, *, evidence: SinkEvidence, layer: int) -> None:
    evidence.add_resid(layer, resid)


def _watch(x: Tensor, hook: Any) -> None:
    """A hook that reads nothing: the forward checks what it sees for NaN and inf."""
