"""One attention pass: every attention analysis reads its layers here, whichever path ran.

:func:`attention_pass` runs one forward and hands each attention layer one :class:`PassLayer`:
the attention on a few key ``columns``, the sink rule's ``band`` (each key's mean attention from
the queries after it), the heads' outputs ``z`` (the attention applied to the values), what the
output projection reads (``z_read``, ``attn.hook_z`` where it fires), the keys ``k`` and values ``v``,
the attention output ``out``, the attention to a null slot ``null``, each query's largest attention on
one key ``max_attention``, the queries ``q``, the scores on the columns ``scores``, each query's log-sum-exp
over the other keys ``rest_lse`` and the rotary ``cos``/``sin`` (``rotary``): only what the caller asks
for in ``want``. On the eager path they come from the pattern, ``z``/``v``, output and slot hooks;
on the LSE path (:mod:`massive_lens.core.lse`) from the fused kernel's ``q``, ``k`` and log-sum-exp;
an nnsight view takes the LSE path. The
caller picks the path with :func:`choose_path` (``"auto"``: the eager pattern below
:data:`LSE_FROM` tokens, where it is the faster, and whenever an edit is attached, which the
kernel would skip; the LSE path above) and reduces what it is handed: no analysis branches on
the path. With a
:class:`~massive_lens.core.criterion.SinkEvidence` the pass also feeds the sink rule (every
layer's residual stream and key attention) in the same forward. Hooks and the kernel are put
back on exit, exceptions included. :func:`attention_reading` is the same reading of forwards that
someone else runs (an intervention's record, on the user's forward): its hooks go on each of them,
run inside ``with reader:``.

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

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.criterion import SinkEvidence
from massive_lens.core.lse import EAGER, LSE, PATHS, attached_attention_edits, lse_rotary, lse_support
from massive_lens.core.model_view import ModelView
from massive_lens.core.pass_reader import AttentionEdit, PassReader, attention_layers
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError

__all__ = ["LSE_FROM", "PassLayer", "attention_output_hook", "attention_pass", "attention_reading", "choose_path"]

log = logging.getLogger(__name__)

WANTS = ("z", "z_read", "k", "v", "out", "null", "max_attention", "q", "scores", "rest_lse", "rotary")
NULL_FROM = ("pattern", "slot_pattern")  # where the eager path reads a layer's null mass
# "auto" reads the eager pattern below this many positions, the LSE path from it: the measured
# crossover (CPU time, one thread, SmolLM2-135M: every attention analysis is faster on the eager
# path at 128 tokens, even at 512, faster on the LSE path at 768 (re-measured in round 4) and 2.1-2.5x
# faster there at 2,048; docs/benchmarks.md, issue 50, `python -m benchmarks.path_crossover`). Both
# paths' attention costs grow alike with the heads and their width; what differs is the eager
# pattern's O(length^2) per head against the LSE path's band of O(length x 128), so the crossover is
# a length, not a model size.
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
    [batch head query]`` (float32): the attention each query gives to a null slot; on the LSE path to a learned
    sink logit (:attr:`~massive_lens.core.layer_attention.LayerAttention.null_mass`; None without one), on the
    eager path from where ``null_from`` says (None at a layer it leaves out); ``max_attention [batch head query]``
    (float32): each query's largest attention on any one key, at the reading's ``max_queries``; ``q [batch
    query head d_head]``: the queries as the scores use them (after any rotary embedding); ``scores [batch head
    query col]``: the attention scores (logits, the mask's ``-inf`` included) on the ``columns``; ``rest_lse
    [batch head query]`` (float32): each query's log-sum-exp over the keys it sees other than the ``columns``
    (causal; on the LSE path ``LSE + log(1 - p_columns)``, from the other keys' scores where ``p_columns`` is
    within :data:`~massive_lens.core.layer_attention.NEAR_ONE` of one); ``rotary``: the rotary embedding's
    ``(cos, sin)`` (``[batch|1 pos rotary_dim]``) the layer rotates by (on the LSE path: its module's inputs),
    else None."""

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
    max_attention: Tensor | None = None
    q: Tensor | None = None
    scores: Tensor | None = None
    rest_lse: Tensor | None = None
    rotary: tuple[Tensor, Tensor] | None = None


def attention_pass(view: ModelView, batch: Batch, on_layer: Callable[[PassLayer], None] | None, *, path: str,
                   columns: Sequence[int] | Tensor | None = None, band: bool = False, want: Iterable[str] = (),
                   layers: Iterable[int] | None = None, out_hooks: dict[int, str] | None = None,
                   eager_reads: dict[str, Iterable[int]] | None = None, null_from: dict[int, str] | None = None,
                   evidence: SinkEvidence | None = None, evidence_resid: bool = True,
                   hooks: Sequence[tuple[str, Any]] = (),
                   stop_after: str | None = None, check_finite: bool = True) -> None:
    """One forward of ``batch`` handing every attention layer of ``layers`` (None: every layer with an
    attention pattern; a hybrid model's linear-attention layers have none) to
    ``on_layer`` as a :class:`PassLayer` read on ``path`` (``"eager"`` or ``"lse"``, from
    :func:`choose_path`).

    ``columns``: key positions whose attention every query gives (``cols``); ``band``: the sink
    rule's key attention; ``want``: any of ``"z"``, ``"z_read"``, ``"k"``, ``"v"``, ``"out"``, ``"null"`` (``out_hooks``
    names each layer's output hook, e.g. :func:`attention_output_hook`'s); ``eager_reads``: for ``"k"`` and ``"v"``,
    the layers whose eager hooks give them per head (``attn.hook_rot_k`` where the model names it, else
    ``attn.hook_k``; ``attn.hook_v``), a capability the caller knows (e.g. from a probe): elsewhere the
    eager path hands None (and no ``z``) and reads no such hook; the LSE path reads them from the kernel at
    every layer (default: every layer, both); ``null_from``: for ``"null"``, per layer where the eager path reads
    the null mass, a capability the caller knows (the null slot's kind): ``"pattern"``, one minus the keys'
    weights (a sink logit the eager attention drops after the softmax), or ``"slot_pattern"``, the sum of
    ``attn.hook_slot_pattern`` (sink slots); elsewhere the eager path hands None; ``evidence``: fed every layer's
    key attention and (``evidence_resid``) residual stream; ``hooks``: the caller's own, run in the same forward
    (on ``"lse"`` none that the kernel would skip: pass them to :func:`choose_path`).
    The forward stops after ``stop_after`` (None: the last layer the pass reads). It is
    :func:`attention_reading` and one forward."""
    reading = attention_reading(view, on_layer, path=path, batch=batch, columns=columns, band=band, want=want,
                                layers=layers, out_hooks=out_hooks, eager_reads=eager_reads, null_from=null_from,
                                evidence=evidence, evidence_resid=evidence_resid)
    own = reading.hooks
    if path == LSE and hooks and attached_attention_edits(view, hooks):  # the kernel would skip an edit of them
        choose_path(view, LSE, batch, hooks=hooks)  # the MassiveLensError naming them
    if path == LSE and not own and evidence is None:  # hooks that read nothing: the forward checks them for NaN, inf
        own = [(view.hook_name(layer, "resid_post"), _watch) for layer in range(view.n_layers)]
    all_hooks = [*hooks, *own]
    if not all_hooks:
        raise MassiveLensError(f"{view.name}: the attention pass has no layer to read")
    deepest = view.n_layers - 1 if hooks or evidence is not None or on_layer is None else max(reading.layers, default=0)
    last = stop_after or _last(view, all_hooks, deepest)
    with reading:
        # a stop of the pass's own choosing only saves time: where the bridge never fires it
        # (OpenAI GPT's resid_post), the pass runs to the end
        view.forward(batch, all_hooks, stop_after=last, check_finite=check_finite, must_stop=stop_after is not None)
    missed = sorted(reading.layers.intersection(attention_layers(view)) - reading.done)
    if on_layer is not None and missed:
        raise MassiveLensError(f"{view.name}: the attention hooks (pattern, and the values, heads' or attention "
                               f"output asked for) of layer {missed[0]} did not all fire; the attention pass "
                               "cannot read that layer")


def attention_reading(view: ModelView, on_layer: Callable[[PassLayer], None] | None, *, path: str,
                      batch: Batch | None = None, columns: Sequence[int] | Tensor | Callable[[int, int, int], Tensor]
                      | None = None, band: bool = False, want: Iterable[str] = (), layers: Iterable[int] | None = None,
                      out_hooks: dict[int, str] | None = None, eager_reads: dict[str, Iterable[int]] | None = None,
                      null_from: dict[int, str] | None = None, evidence: SinkEvidence | None = None,
                      evidence_resid: bool = True,
                      max_queries: Sequence[int] | Tensor | Callable[[int], Tensor | None] | None = None,
                      edits: dict[int, AttentionEdit] | None = None) -> PassReader:
    """The attention pass's reading of forwards that someone else runs (an intervention's hooks on
    the user's forward; :func:`attention_pass` is this and one forward): a :class:`PassReader` whose
    ``hooks`` go on each forward, run inside ``with reader:`` (on the LSE path the model runs on the
    fused kernel there; what is pending is handed over on exit). The arguments are
    :func:`attention_pass`'s; ``columns`` may also be a function ``(layer, batch, pos) -> positions``,
    asked as each layer is read (columns found during that forward, such as sinks found online);
    ``batch`` (its mask) is needed for ``band`` and ``evidence`` only; ``max_queries``: the query positions
    at which ``want="max_attention"`` is read (None: every query), or a function ``layer -> positions``
    (or None) asked as each layer is read; ``edits``: per layer an
    :class:`~massive_lens.core.pass_reader.AttentionEdit` applied on the eager path before anything of that
    layer is read (the LSE path refuses them, and ``"rotary"`` where :func:`~massive_lens.core.lse.lse_rotary`
    says the kernel misses it). ``path=choose_path(view, "auto",
    None)`` reads a forward of unknown length.

    >>> from massive_lens import tiny_model
    >>> view = ModelView(tiny_model("llama"))
    >>> seen = {}
    >>> reader = attention_reading(view, lambda at: seen.setdefault(at.layer, at.cols.shape), path="eager",
    ...                            columns=lambda layer, batch, pos: torch.tensor([0, pos - 1]))
    >>> with reader:
    ...     _ = view.forward(view.tokenize("Hello there."), reader.hooks)
    >>> len(seen) == view.n_layers and seen[0][-1]
    2
    """
    want = set(want)
    if want - set(WANTS) or path not in (EAGER, LSE) or set(eager_reads or {}) - {"k", "v"}:
        raise MassiveLensError(f"want is a subset of {WANTS}, path 'eager' or 'lse' and eager_reads keyed by 'k' or "
                               f"'v', got {sorted(want)}, {path!r}, {sorted(eager_reads or {})}")
    if set((null_from or {}).values()) - set(NULL_FROM):
        raise MassiveLensError(f"null_from names each layer's null mass source, one of {NULL_FROM}, got "
                               f"{sorted(set(null_from.values()))}")
    if path == LSE and edits:
        raise MassiveLensError(f"{view.name}: edits of the attention are read on the eager path only (the fused "
                               "kernel skips the hooks they need); pass the path choose_path(view, attention, "
                               "batch, want=...) gives")
    if path == LSE and "rotary" in want and (gap := lse_rotary(view)) is not None:
        raise MassiveLensError(f"{view.name}: want='rotary' is read on the eager path only here: {gap}; pass the "
                               "path choose_path(view, attention, batch, want=...) gives")
    if want & {"scores", "rest_lse"} and columns is None:
        raise MassiveLensError("want='scores' and 'rest_lse' are read on the columns: pass columns=")
    if "out" in want and not out_hooks:
        raise MassiveLensError("want='out' needs out_hooks: each layer's output hook (attention_output_hook's "
                               "for the attention output)")
    if batch is None and (band or evidence is not None):
        raise MassiveLensError("the sink rule's band and evidence need the batch (its mask): pass batch=")
    # None: the layers with a pattern; a model with none is refused below, naming the pattern hook it lacks
    layers = set((attention_layers(view) or range(view.n_layers)) if layers is None else layers)
    cols = columns if columns is None or callable(columns) else torch.as_tensor(columns, dtype=torch.long).flatten()
    return PassReader(view, batch, on_layer, layers, cols, band, want, evidence,
                      {key: set(at) for key, at in (eager_reads or {}).items()}, path=path, out_hooks=out_hooks,
                      evidence_resid=evidence_resid, make=PassLayer,
                      null_from=dict(null_from or {}),
                      max_queries=max_queries if max_queries is None or callable(max_queries) else
                      torch.as_tensor(max_queries, dtype=torch.long),
                      edits=edits)


def choose_path(view: ModelView, attention: str, batch: Batch | None, *, want: Iterable[str] = (),
                hooks: Sequence[tuple[Any, Any]] = ()) -> str:
    """``"eager"`` or ``"lse"``, the path that reads ``batch``'s attention as ``attention`` asks:
    ``"auto"`` takes the eager pattern where the view serves one and ``batch`` is shorter than
    :data:`LSE_FROM` positions (the faster path there), else the LSE path where the model supports
    it and no hook the LSE path would skip is attached
    (:func:`~massive_lens.core.lse.attached_attention_edits`), else the eager pattern. An nnsight
    view serves no pattern: the LSE path at every length. ``"lse"`` where it cannot run, or would
    skip an attached edit, and ``"eager"`` on a view without patterns are a :class:`MassiveLensError`
    naming why. ``batch`` None: hooks on a forward of unknown length that the caller runs (an
    intervention's), read from the eager pattern wherever the view serves one. A ``want`` of
    ``"rotary"`` takes the eager path where the kernel misses a rotary the eager hooks show
    (:func:`~massive_lens.core.lse.lse_rotary`). ``hooks``: the caller's own, to run in the same
    forward (:func:`attention_pass`'s ``hooks``), counted as attached.

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
    if attention == EAGER or (attention == "auto" and not refusal and (
            batch is None or batch.mask.shape[-1] < LSE_FROM)):
        if refusal:
            raise MassiveLensError(refusal)
        return EAGER
    reason = lse_support(view)
    if reason is None and "rotary" in set(want):
        reason = lse_rotary(view)  # the kernel's run misses a rotary the eager hooks show
    if reason is None:
        edits = attached_attention_edits(view, hooks)
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


def _last(view: ModelView, hooks: Sequence[tuple[str, Any]], deepest: int) -> str:
    """Where the forward can stop: the residual stream after block ``deepest`` (every hook of a
    block fires before it), or the last of ``hooks`` in a model without one."""
    if view.has_hook(deepest, "resid_post"):
        return view.hook_name(deepest, "resid_post")
    return hooks[-1][0]


def _watch(x: Tensor, hook: Any) -> None:
    """A hook that reads nothing: the forward checks what it sees for NaN and inf."""
