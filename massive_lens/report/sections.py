"""The sections of the report, in the order a researcher would tell the story.

Each section is a function ``(inputs, section, *earlier results) -> its result``: it adds
blocks to its :class:`~massive_lens.report.render.Section` and returns what later sections
reuse (the text's massive activations), so results pass between sections explicitly. A
section that cannot run on a model raises :class:`~massive_lens.MassiveLensError`; the
report then shows why and later sections fall back to what they can do without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pandas as pd
from torch import Tensor

from massive_lens.attention import decompose_attention, sink_attention
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.detect import CorpusScan, MassiveActivations, find_massive, scan_corpus
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import REGISTRY, SETTINGS, InterventionTable, calibrate, run_interventions
from massive_lens.origin import OriginTrace, trace_origin
from massive_lens.quantize import measure_outliers
from massive_lens.report.render import Section
from massive_lens.viz import activation_landscape, attention_maps, attention_view, magnitude_view

log = logging.getLogger(__name__)
SECOND_TEXT = "Another text, on another topic.\nIt has two lines."


@dataclass(frozen=True)
class Settings:
    """Sizes of every analysis (tokens per sequence, sequences, ...)."""

    scan_seqs: int = 8
    eval_seq_len: int = 128
    eval_seqs: int = 8
    calib_seqs: int = 4
    verify: bool = True


FULL = Settings()
QUICK = Settings(scan_seqs=4, eval_seq_len=32, eval_seqs=2, calib_seqs=2, verify=False)


class Inputs:
    """What every section reads: the model, the text, the corpus and the settings."""

    def __init__(self, model: Any, text: str, corpus: Any, settings: Settings):
        self.model, self.text, self.corpus, self.settings = model, text, corpus, settings
        self.view = ModelView(model)

    @cached_property
    def tokens(self) -> Tensor:
        """Evaluation sequences followed by calibration sequences (disjoint text); the corpus
        scan reads the first ``scan_seqs`` of them (the corpus is tokenized once)."""
        s = self.settings
        return sequences(self.view, self.corpus, s.eval_seq_len, max(s.scan_seqs, s.eval_seqs + s.calib_seqs))

    @property
    def eval_tokens(self) -> Tensor:
        return self.tokens[: self.settings.eval_seqs]

    @property
    def calib_tokens(self) -> Tensor:
        return self.tokens[self.settings.eval_seqs:]


def _massive_layer(found: MassiveActivations | None, inputs: Inputs) -> int:
    """First layer with a massive activation, else the layer of the largest top-1/median."""
    if found is None:
        return inputs.view.n_layers // 2
    return found.layers[0] if found.layers else found.peak_layer


def model_section(inputs: Inputs, s: Section) -> None:
    view = inputs.view
    n_params = sum(p.numel() for p in inputs.model.parameters())
    rows = [("model", view.name), ("parameters", f"{n_params:,}"), ("layers", view.n_layers),
            ("d_model", view.d_model), ("heads", getattr(view.cfg, "n_heads", "?")),
            ("dtype", str(view.dtype).replace("torch.", "")), ("text", inputs.text)]
    s.table(pd.DataFrame([(k, str(v)) for k, v in rows], columns=["", "value"]))


def massive_section(inputs: Inputs, s: Section) -> MassiveActivations:
    found = find_massive(inputs.model, inputs.text)
    layer = _massive_layer(found, inputs)
    s.pre(found.summary())
    s.table(found.by_dim(), "massive (position, dim) pairs in the text, largest first")
    s.figure(activation_landscape(inputs.model, inputs.text, layer, found=found),
             f"activation landscape at layer {layer}: |value| per token and hidden dimension")
    scan = corpus_scan(inputs)
    s.pre(scan.summary())
    s.figure(scan.plot(), "layer profile over the corpus: top-1/2/3 and median |activation| (mean ± std)")
    if not scan.frequency.empty:
        s.table(scan.frequency, "how often each (dim, token kind) is massive over the corpus")
    return found


def corpus_scan(inputs: Inputs) -> CorpusScan:
    """How often each dim is massive over the first ``scan_seqs`` corpus sequences."""
    return scan_corpus(inputs.model, inputs.tokens[: inputs.settings.scan_seqs], seq_len=inputs.settings.eval_seq_len,
                       batch_size=4, max_tokens=None, progress=False)


def trace_top(inputs: Inputs, found: MassiveActivations | None, verify: bool) -> OriginTrace:
    """The largest massive entry of the text traced (without one: the largest value at the
    first token), with the causal check on a few evaluation sequences when ``verify``."""
    rows = found.by_dim() if found is not None else pd.DataFrame()
    corpus = inputs.eval_tokens[: 4] if verify else None
    if rows.empty:
        return trace_origin(inputs.model, inputs.text, pos=0, verify=verify, corpus=corpus)
    top = rows.iloc[0]
    return trace_origin(inputs.model, inputs.text, dim=int(top.dim), pos=int(top.pos), verify=verify, corpus=corpus)


def intervention_table(inputs: Inputs) -> tuple[InterventionTable, str | None]:
    """Table 3 on the evaluation sequences, calibrated on the calibration sequences, and a note
    when the calibration text has no massive activations (only the sink settings then run)."""
    calib = calibrate(inputs.model, inputs.calib_tokens, seq_len=inputs.settings.eval_seq_len,
                      n_seqs=inputs.settings.calib_seqs, progress=False)
    settings, note = list(SETTINGS), None
    if not calib.dims:
        settings = [name for name in SETTINGS if not REGISTRY[name].needs_massive]
        note = ("No massive activations in the calibration text: only the sink interventions "
                "(sinks fall back to the first token) are run.")
    table = run_interventions(inputs.model, inputs.eval_tokens, calibration=calib, settings=settings, progress=False)
    return table, note


def origin_section(inputs: Inputs, s: Section, found: MassiveActivations | None) -> None:
    verify = inputs.settings.verify
    if found is None or found.by_dim().empty:
        s.note("No massive activation in the text; tracing the largest value at the first token instead.")
    trace = trace_top(inputs, found, verify)
    s.pre(trace.summary())
    s.figure(trace.plot(), "origin ledger: each component's write into the traced dim, layer by layer")
    if not trace.events.empty:
        s.table(trace.events, "births, erasures and rebirths")
    if not trace.super_weights.empty:
        s.table(trace.super_weights, "candidate super weights: W_out[neuron, dim] of the birth neurons")
    if not trace.verification.empty:
        s.table(trace.verification, "causal check: zero-ablating the named neurons or weights")
    elif not verify:
        s.note("Causal verification skipped in quick mode.")


def attention_section(inputs: Inputs, s: Section, found: MassiveActivations | None) -> None:
    model, text = inputs.model, inputs.text
    texts = [text, SECOND_TEXT]
    sinks = sink_attention(model, texts)
    s.pre(sinks.summary())
    if sinks.sinks is not None:
        s.table(sinks.sinks.to_frame().assign(text=lambda f: f["seq"].map({0: "the text", 1: "second text"})),
                f"positions treated as sinks ({sinks.sinks.describe()}): they draw attention as sinks "
                "(by_attention) or carry a massive activation that persists across layers (by_massive)")
    s.figure(sinks.plot(), "attention mass on the sink tokens per layer")
    massive_layer = _massive_layer(found, inputs)
    layer = min(massive_layer + 1, inputs.view.n_layers - 1)
    positions = sinks.sinks.mask[0].nonzero().flatten().tolist() if sinks.sinks is not None else None
    s.figure(attention_maps(model, text, layer, max_heads=8, sinks=positions),
             f"attention patterns of layer {layer}; sink columns outlined in red")
    s.view(attention_view(model, text, layer))
    s.view(magnitude_view(model, text, massive_layer))
    decomposition = decompose_attention(model, texts)
    s.pre(decomposition.summary())
    s.figure(decomposition.plot(), "sink term vs content term: norms and how constant the sink term is")


def intervention_section(inputs: Inputs, s: Section) -> None:
    table, note = intervention_table(inputs)
    if note:
        s.note(note)
    s.pre(table.summary())
    s.figure(table.plot(), "perplexity ratio to the untouched model per intervention (95% bootstrap interval)")
    frame = table.to_frame()
    for row in frame[frame["rebuilt"]].itertuples():
        s.note(f"{row.check}. The {row.setting} row does not measure a removal; the table adds the setting "
               "applied at every layer where the activation is massive.")
    s.table(frame[["setting", "where", "sinks_per_seq", "sink_kinds", "targets_per_seq", "target_kept", "peak_layer",
                   "target_back", "back_layer", "sink_mass", "sink_mass_original", "rebuilt", "check"]],
            "checked downstream on the evaluation text: the sinks each setting used (per sequence, token kinds), "
            "the targeted massive dims' |value| with / without it at their peak layer and at later layers "
            "(target_kept, target_back), and the attention non-sink queries still pay to the sinks")
    s.table(frame[["setting", "description", "acts_on"]], "what each setting does, and where it acts")


def quantize_section(inputs: Inputs, s: Section) -> None:
    report = measure_outliers(inputs.model, inputs.eval_tokens, calibration=inputs.calib_tokens)
    s.pre(report.summary())
    s.figure(report.plot(), "largest and median |activation| of each block output")
    s.table(report.to_frame(), "per-layer outlier statistics")


def run_section(title: str, fn: Any, inputs: Inputs, *earlier: Any) -> tuple[Section, Any]:
    """Run one section; a :class:`MassiveLensError` becomes a note saying why it was skipped."""
    section = Section(title)
    start = time.perf_counter()
    try:
        result = fn(inputs, section, *earlier)
    except MassiveLensError as exc:
        section.note(f"Skipped: {exc}")
        result = None
    section.seconds = time.perf_counter() - start
    log.info("report section %r took %.1f s", title, section.seconds)
    return section, result
