"""Where a massive activation comes from: born, erased, reborn, down to neurons and weights.

The residual stream is a sum. At position ``pos`` and dimension ``dim`` the value after
layer ``L`` is exactly

    embed[pos, dim] (+ pos_embed) + sum_{l <= L} (attn_out_l[pos, dim] + mlp_out_l[pos, dim])

so a *ledger* of these terms says which components wrote a massive activation. On models
with post-sublayer ("sandwich") norms, such as Gemma 2/3 and OLMo 2, a component's term is
what it adds *after* its post-norm. The ledger need not tell a simple story: a dimension can
be written by one MLP, cut back by a later one and written again (a *rebirth*), so
:func:`trace_origin` names every large write (birth) and removal (erasure), not only the
first spike.

For each MLP event it goes one level down (Yu et al., 2024, *The Super Weight*): an MLP's
output in ``dim`` is ``sum_n post[n] * W_out[n, dim]``, so the neurons with the largest terms
are the ones responsible, and their ``W_out[n, dim]`` entries (Hugging Face
``down_proj.weight[dim, n]``) are candidate *super weights*, ranked against the rest of the
matrix. Why the neuron fires on *this* token: its pre-activation is linear in the normed
residual, so it splits exactly into what the embedding and each earlier attention and MLP
output contributed (through ``ln2`` at its measured scale).

Stories are hypotheses; ``verify=True`` tests them causally: zero the named neurons (and,
separately, only their weights) and measure how much of the massive value is left, and
with a ``corpus`` how perplexity changes. Everything is read from one forward pass that
slices each hook at the traced positions (no full cache).

>>> from massive_lens import tiny_model
>>> trace = trace_origin(tiny_model("llama"), "Hi.", dim=3, pos=0)
>>> list(trace.ledger.columns[:6])
['pos', 'dim', 'token', 'layer', 'component', 'contribution']
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch

from massive_lens.core.charts import waterfall_axes
from massive_lens.core.corpora import Corpus
from massive_lens.core.criterion import Criterion, as_criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.results import Result
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError
from massive_lens.origin import neurons as neu
from massive_lens.origin.attribution import ATTRIBUTION_COLUMNS, attribution_rows
from massive_lens.origin.capture import Capture, capture, refill
from massive_lens.origin.heads import HEAD_COLUMNS, head_rows
from massive_lens.origin.ledger import (
    BIRTH_KINDS,
    EVENT_COLUMNS,
    LEDGER_COLUMNS,
    events,
    ledger_rows,
    reconstruction_error,
)
from massive_lens.origin.story import birth_key, story, together
from massive_lens.origin.targets import capture_found, capture_positions, check_index, trace_targets
from massive_lens.origin.verify import VERIFY_COLUMNS, verify_targets

log = logging.getLogger(__name__)
_MAX_STORIES = 4  # entries told in summary(), largest peak first
VERIFY_TOP = 3  # verify=True without dim/pos verifies this many entries, largest |peak| first
VERIFY_WARN_S = 60.0  # the time estimate is a warning (else INFO) above this many seconds


@dataclass(frozen=True, kw_only=True)
class OriginTrace(Result):
    """The traced story of one or more massive (pos, dim) entries of one text.

    - ``targets``: ``pos``, ``dim``, ``token``, ``token_kind``, ``massive`` (met the criterion),
      ``scope`` (``"token"``, or ``"outlier_dim"`` for an entry that is massive only where its
      dim is an outlier dimension), ``peak``, ``peak_layer``, ``final``; largest ``|peak|`` first;
    - ``ledger`` (also ``to_frame()``): per component, in forward order, its ``contribution``
      and the measured residual ``resid`` right after it (``layer`` is 0 for embeddings);
    - ``events``: ``kind`` ``write``, ``birth``, ``raise``, ``rebirth`` or ``erasure`` (one rule, in
      :func:`~massive_lens.origin.ledger.event_kinds`, which the summary's verbs follow) with the
      value ``before``/``after``;
    - ``attribution``: the runs of writes that account for each entry's ``peak`` and for its
      ``change`` from the peak to the final value (``label`` such as ``MLPs 6-11``,
      ``contribution``, ``share`` of that target; a ``the rest`` row counts what is left);
    - ``heads``: the ledger's attention rows split by head (``head``, -1 for ``b_O``;
      ``contribution`` and ``share`` of that layer's attention term, which they sum to; the
      head's ``first_token_attention`` and ``max_attention`` from ``pos``);
    - ``neurons``: top neurons of each MLP event (``contribution``, ``share`` of the MLP's term,
      ``post`` activation, ``pre`` (gate) pre-activation, ``up`` value, ``w_out``); in a mixture
      of experts a neuron is (``expert``, ``neuron``) and ``route`` is the router's weight on
      that expert at this position (``expert`` is -1 and ``route`` 1 in a dense MLP);
    - ``super_weights``: the ``W_out[neuron, dim]`` of each birth's named neurons with ``zscore``
      and ``rank`` within that matrix and the Hugging Face ``hf_param[hf_row, hf_col]`` (the
      expert's own ``down_proj`` in a mixture of experts);
    - ``why``: each top birth neuron's pre-activation split over upstream ``source``s;
    - ``verification``: zero-ablation results (empty unless ``verify=True``).
    """

    targets: pd.DataFrame
    ledger: pd.DataFrame
    events: pd.DataFrame
    attribution: pd.DataFrame
    heads: pd.DataFrame
    neurons: pd.DataFrame
    super_weights: pd.DataFrame
    why: pd.DataFrame
    verification: pd.DataFrame
    reconstruction_error: float
    notes: tuple[str, ...]
    model_name: str
    n_tokens: int

    @property
    def births(self) -> pd.DataFrame:
        return self.events[self.events.kind.isin(BIRTH_KINDS)].reset_index(drop=True)

    @property
    def erasures(self) -> pd.DataFrame:
        return self.events[self.events.kind == "erasure"].reset_index(drop=True)

    def to_frame(self) -> pd.DataFrame:
        return self.ledger.copy()

    def summary(self) -> str:
        head = (f"{self.model_name}: {len(self.targets)} traced entr{'y' if len(self.targets) == 1 else 'ies'} "
                f"in {self.n_tokens} tokens; the ledger reconstructs the residual to "
                f"{self.reconstruction_error:.1e} (relative)")
        groups: dict[tuple, list[Any]] = {}  # entries born together are told once
        for t in self.targets.itertuples():
            key = birth_key(self, t)
            groups.setdefault(key if key[1] else (t.pos, t.dim), []).append(t)
        stories = []
        for g in list(groups.values())[:_MAX_STORIES]:
            stories.append(story(self, g[0]))
            if len(g) > 1:
                stories.append("  " + together(self, g[1:]) if len(g) > 2 else story(self, g[1]))
        if len(groups) > _MAX_STORIES:
            rest = sum(len(g) for g in list(groups.values())[_MAX_STORIES:])
            stories.append(f"... and {rest} smaller entries (see .targets, .events)")
        return "\n".join([head, *stories, *self.notes])

    def plot(self, ax: Any = None, target: int = 0) -> Any:
        """Waterfall of the ledger of ``targets.iloc[target]`` across layers.

        Args:
            ax: the matplotlib Axes to draw on (None: a new figure).
            target: which row of :attr:`targets` to draw (default 0, the largest ``|peak|``).

        Returns:
            The matplotlib Axes.
        """
        t = self.targets.iloc[target]
        rows = self.ledger[(self.ledger.pos == t.pos) & (self.ledger.dim == t.dim)]
        return waterfall_axes(rows, ax=ax, title=f"{self.model_name}: dim {t.dim} at {t.token!r} (pos {t.pos})")


def trace_origin(
    model: Any,
    text: str | torch.Tensor,
    *,
    dim: int | None = None,
    pos: int | None = None,
    criterion: Criterion | None = None,
    top_neurons: int = 5,
    verify: bool = False,
    corpus: Corpus = None,
    prepend_bos: bool | None = None,
) -> OriginTrace:
    """Trace where the massive activations of ``text`` are born, erased and reborn.

    Without ``dim``/``pos`` every token-specific massive (pos, dim) that :func:`~massive_lens.find_massive`
    finds under ``criterion`` is traced (entries of outlier dimensions, massive at most tokens of
    a layer, only when there is no token-specific one; see ``docs/detection.md``); with both,
    that entry is traced even if it is not massive; with one of them, the massive entries there
    (or the largest one if none is massive). ``verify=True`` adds zero-ablation checks (and
    perplexity on ``corpus`` if given): of the given entry, or without ``dim``/``pos`` of the
    ``VERIFY_TOP`` (3) entries of largest ``|peak|``; the summary says how many were skipped,
    and the time the rest will take is logged, estimated from measured passes (a warning above
    ``VERIFY_WARN_S``, 60 s).

    Args:
        model: a TransformerLens-style model.
        text: one string, or the token ids of one text (``[pos]`` or ``[1, pos]``); for a
            vision model, the ``pixel_values`` of one image.
        dim: the hidden dimension to trace, ``0 <= dim < d_model`` (None: any).
        pos: the position to trace, BOS included; negative counts from the end (None: any).
        criterion: when a value is massive (None: ``Criterion()``).
        top_neurons: how many neurons to name per MLP event (default 5).
        verify: also zero the named neurons (and, separately, their ``W_out`` weights) and
            measure what is left of each traced value (at most ``VERIFY_TOP`` entries without
            ``dim``/``pos``). Must be a bool.
        corpus: with ``verify``, also measure perplexity with and without the ablation on
            this corpus (see :func:`~massive_lens.perplexity`); ignored otherwise.
        prepend_bos: whether to prepend BOS to text input (None: the model's default).

    Returns:
        An :class:`OriginTrace`: the targets, the ledger, events, neurons, super weights,
        the neurons' upstream sources and, with ``verify``, the ablation results.

    Raises:
        MassiveLensError: if ``top_neurons`` is below 1, ``text`` is a batch of several
            texts, neither a string nor a tensor, empty or too long, ``dim`` or ``pos`` is out
            of range, nothing is massive and neither ``dim`` nor ``pos`` is given, or a block
            does not add an attention and an MLP output to the residual stream (state-space,
            recurrent and linear-attention blocks) or its hooks do not fire.

    >>> from massive_lens import tiny_model
    >>> trace = trace_origin(tiny_model("gpt2"), "Hi.", dim=0, pos=0)
    >>> trace.targets[["pos", "dim", "massive"]].values.tolist()
    [[0, 0, False]]
    """
    view, batch = _prepare(model, text, top_neurons=top_neurons, verify=verify, prepend_bos=prepend_bos)
    seq = batch.tokens.shape[1]
    dim, pos = check_index(view, dim, pos, seq)
    criterion = as_criterion(criterion)
    positions = capture_positions(view, batch, pos, dim, criterion)
    started = time.perf_counter()
    cap = capture(view, batch, positions, criterion) if positions is not None else \
        capture_found(view, batch, dim, criterion)
    pass_seconds = time.perf_counter() - started
    tokens = view.str_tokens(batch)[0]
    targets, scope_note = trace_targets(view, batch, cap, dim, pos, tokens, criterion)
    per_target, ledger, found_events = _ledger(cap, targets, tokens, criterion)
    error = reconstruction_error(per_target)
    refill(view, batch, cap, [(e.layer, e.pos) for e in found_events.itertuples() if e.component == "mlp"])
    neurons, births, supers, why = _neurons(view, cap, found_events, top_neurons)
    verified, verify_note = _bounded(targets, dim is None and pos is None) if verify else ([], "")
    estimate = partial(_log_estimate, view, verified, births, pass_seconds)
    verification = verify_targets(view, batch, cap, verified, births, neurons, corpus, estimate) if verified else []
    heads, head_notes = head_rows(view, cap, targets)
    notes = (*_notes(cap, error, verify, corpus), *dict.fromkeys(cap.notes), *head_notes, scope_note, verify_note)
    attribution = pd.DataFrame(
        [r for t, rows in zip(targets, per_target, strict=True)
         for r in attribution_rows(rows, t["pos"], t["dim"], t["peak_layer"])],
        columns=ATTRIBUTION_COLUMNS)
    return OriginTrace(
        targets=pd.DataFrame(targets), ledger=ledger, events=found_events, attribution=attribution,
        heads=pd.DataFrame(heads, columns=HEAD_COLUMNS), neurons=neurons,
        super_weights=pd.DataFrame(supers, columns=neu.SUPER_COLUMNS), why=pd.DataFrame(why, columns=neu.WHY_COLUMNS),
        verification=pd.DataFrame(verification, columns=VERIFY_COLUMNS), reconstruction_error=error,
        notes=tuple(n for n in notes if n), model_name=view.name, n_tokens=seq)


# --------------------------------------------------------------------------- steps


def _prepare(model: Any, text: str | torch.Tensor, *, top_neurons: int, verify: Any,
             prepend_bos: bool | None) -> tuple[ModelView, Batch]:
    """The view and the one-text batch, after the argument checks."""
    view = ModelView(model)
    if not isinstance(verify, bool):
        raise MassiveLensError(f"verify must be True or False, got {verify!r}")
    if top_neurons < 1:
        raise MassiveLensError(f"top_neurons must be >= 1, got {top_neurons}")
    if not isinstance(text, (str, torch.Tensor)):
        raise MassiveLensError(f"text must be one string or a token tensor, got {type(text).__name__}")
    batch = view.tokenize(text, prepend_bos)
    if verify and batch.pixel_values is not None:
        raise MassiveLensError(f"{view.name}: trace_origin(verify=True) is not supported for images yet (the "
                               "ablation passes are built from token ids); trace without verify")
    if len(batch.tokens) != 1:
        raise MassiveLensError(f"trace_origin traces one text (or image); got a batch of {len(batch.tokens)} for "
                               f"{view.name}")
    return view, batch


def _ledger(cap: Capture, targets: list[dict[str, Any]], tokens: list[str],
            criterion: Criterion) -> tuple[list[list[dict[str, Any]]], pd.DataFrame, pd.DataFrame]:
    """Every target's ledger rows, the ledger and the events (births, erasures, rebirths)."""
    rows = [ledger_rows(cap, t["pos"], t["dim"], tokens) for t in targets]
    found = [e for r in rows for e in events(r, criterion.abs_threshold)]
    return (rows, pd.DataFrame([r for per in rows for r in per], columns=LEDGER_COLUMNS),
            pd.DataFrame(found, columns=EVENT_COLUMNS))


def _neurons(view: ModelView, cap: Capture, found_events: pd.DataFrame, top_neurons: int,
             ) -> tuple[pd.DataFrame, list[dict[str, Any]], list[Any], list[Any]]:
    """The top neurons of each MLP event, the MLP births, and the births' super weights and
    upstream sources (``why``) of their first three named neurons."""
    mlp_events = [e for e in found_events.to_dict("records") if e["component"] == "mlp"]
    per_event = [neu.neuron_rows(view, cap, e, top_neurons) for e in mlp_events]
    neurons = pd.DataFrame([r for rows in per_event for r in rows], columns=neu.NEURON_COLUMNS)
    writes = [(e, rows) for e, rows in zip(mlp_events, per_event, strict=True) if e["kind"] != "erasure"]
    supers, why, seen = [], [], {}
    for e, rows in writes:  # every MLP write names its super weights (retrofit removes them all)
        names = neu.named(rows, e)
        supers += neu.super_weight_rows(view, e["pos"], e["dim"], e["layer"], names, seen)
        why += neu.why_rows(view, cap, e, names[:3]) if names else []
    return neurons, [e for e, _ in writes if e["kind"] in BIRTH_KINDS], supers, why


# --------------------------------------------------------------------------- verification and notes


def _bounded(targets: list[dict[str, Any]], default: bool) -> tuple[list[dict[str, Any]], str]:
    """The targets to verify: all when the caller chose the entry, else the ``VERIFY_TOP`` of
    largest ``|peak|`` (targets come sorted), with a note naming how many were skipped."""
    if not default or len(targets) <= VERIFY_TOP:
        return targets, ""
    skipped = len(targets) - VERIFY_TOP
    return targets[:VERIFY_TOP], (f"verified the {VERIFY_TOP} largest of {len(targets)} traced entries; {skipped} "
                                  "skipped (pass dim= and pos= to verify one of them)")


def _log_estimate(view: ModelView, targets: list[dict[str, Any]], births: list[dict[str, Any]],
                  pass_seconds: float, ppl_seconds: float, tokens: torch.Tensor | None) -> None:
    """Log how long verification will take, from measured passes: per target one batched pass
    and per ablation scope one pass over the text, each as long as the capture pass
    (``pass_seconds``); with a corpus two perplexity runs per scope, each as long as the
    untouched run just measured (``ppl_seconds``, already spent)."""
    passes, ppl_runs = 0, 0
    for t in targets:
        scopes = sum(b["pos"] == t["pos"] and b["dim"] == t["dim"] for b in births)
        scopes += scopes > 1
        passes += 1 + scopes
        ppl_runs += 2 * scopes if tokens is not None else 0
    seconds = passes * pass_seconds + ppl_runs * ppl_seconds
    level = logging.WARNING if seconds > VERIFY_WARN_S else logging.INFO
    runs = (f"{ppl_runs} perplexity runs of {tokens.shape[0]} x {tokens.shape[1]} tokens (one took {ppl_seconds:.1f} s)"
            if tokens is not None else "no perplexity runs (no corpus)")
    log.log(level, "%s: verifying %d traced entr%s: %d passes over the text (one took %.1f s) and %s; estimated "
             "%.0f s more", view.name, len(targets), "y" if len(targets) == 1 else "ies", passes, pass_seconds, runs,
             seconds)


def _notes(cap: Capture, error: float, verify: bool, corpus: Corpus) -> tuple[str, ...]:
    notes = []
    if cap.post_norm:
        notes.append("note: post-norm model; MLP terms are read after ln2_post, and neuron terms are "
                     "linearised through ln2_post at its measured scale (they sum to the MLP's term)")
    if error > 1e-4:
        notes.append(f"warning: the ledger misses the residual by {error:.1e} (relative); "
                     "the model may write the residual outside its attention and MLP hooks")
    if verify and corpus is None:
        notes.append("verification without a corpus: pass corpus= to also measure perplexity")
    return tuple(notes)

