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
from dataclasses import replace
from typing import Any

import pandas as pd
from torch import Tensor

from massive_lens.attention import decompose_attention, sink_attention
from massive_lens.core.fmt import num, short
from massive_lens.core.outliers import OUTLIER_DIM_SHARE
from massive_lens.detect import CorpusScan, MassiveActivations, find_massive, scan_corpus
from massive_lens.detect.scope import layer_span
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import REGISTRY, SETTINGS, InterventionTable, calibrate, run_interventions
from massive_lens.interventions.dependence import sink_dependence
from massive_lens.origin import OriginTrace, trace_origin
from massive_lens.quant import granularity_table, measure_outliers
from massive_lens.report.inputs import Inputs, describe
from massive_lens.report.memory import release_free_memory
from massive_lens.report.offswitch_section import off_switch_part
from massive_lens.report.render import Section
from massive_lens.viz import activation_landscape, attention_maps, attention_view, magnitude_view

log = logging.getLogger(__name__)
SECOND_TEXT = "Another text, on another topic.\nIt has two lines."
# (sequences, tokens of each; None: seq_len) the origin's causal check measures perplexity on, by ``full``:
# every ablation scope costs two perplexity runs, most of the default report's time at 4 x 128
VERIFY_CORPUS = {False: (2, 64), True: (4, None)}


def figure_layer(found: MassiveActivations | None, inputs: Inputs) -> tuple[int, str]:
    """The layer of the one-layer figures and why, in words: the ``layer`` setting; else the
    layer of the headline activation (the text's largest token-specific massive value); else
    the layer of the largest top-1 |value|."""
    if inputs.settings.layer is not None:  # checked against the model by Inputs
        return inputs.settings.layer, "the layer setting"
    if found is None:
        return inputs.view.n_layers // 2, "the middle layer: the text's massive activations are unknown"
    top = found.headline
    if top is None:
        return found.headline_layer, "the layer of the largest |value|; nothing is massive"
    kind = "the headline activation" if top.scope == "token" else "the largest outlier-dimension entry"
    return int(top.peak_layer), f"the layer of {kind}: dim {top.dim} at {short(top.token, 20)!r} = {num(top.value)}"


def model_section(inputs: Inputs, s: Section) -> None:
    view = inputs.view
    n_params = sum(p.numel() for p in inputs.model.parameters())
    rows = [("model", view.name), ("parameters", f"{n_params:,}"), ("layers", view.n_layers),
            ("d_model", view.d_model), ("heads", getattr(view.cfg, "n_heads", "?")),
            ("dtype", str(view.dtype).replace("torch.", "")), ("text", inputs.text)]
    s.table(pd.DataFrame([(k, str(v)) for k, v in rows], columns=["", "value"]))


def massive_section(inputs: Inputs, s: Section) -> MassiveActivations:
    found = find_massive(inputs.model, inputs.text)
    layer, why = figure_layer(found, inputs)
    s.pre(found.summary())
    rows = found.by_dim()
    token = rows[rows.scope == "token"].drop(columns="scope")
    if not token.empty:
        s.table(token, "token-specific massive (position, dim) pairs in the text, largest first")
    outliers = found.outlier_dims()
    if not outliers.empty:
        s.table(outliers.assign(layers=[layer_span(x) for x in outliers.layers]),
                f"outlier dimensions, listed apart: massive at >= {OUTLIER_DIM_SHARE:.0%} of a layer's tokens "
                "(a property of the dim, not of a token)")
    s.figure(activation_landscape(inputs.model, inputs.text, layer, found=found),
             f"activation landscape at layer {layer} ({why}): |value| per token and hidden dimension; "
             "token-specific massive dims labelled in red, outlier dimensions in grey")
    try:
        scan = corpus_scan(inputs)
    except MassiveLensError as exc:  # what the text showed stays: the origin section traces it
        s.note(f"Corpus scan skipped: {exc}")
        return found
    s.pre(scan.summary())
    s.figure(scan.plot(), "layer profile over the corpus: top-1/2/3 and median |activation| (mean ± std)")
    if not scan.frequency.empty:
        s.table(scan.frequency, "how often each (dim, token kind) is massive over the corpus; outlier dimensions "
                "(scope outlier_dim, token kind any) below")
    return found


def corpus_scan(inputs: Inputs) -> CorpusScan:
    """How often each dim is massive over the first ``scan_seqs`` corpus sequences."""
    return scan_corpus(inputs.model, inputs.tokens[: inputs.settings.scan_seqs], seq_len=inputs.settings.seq_len,
                       batch_size=inputs.batch_size, max_tokens=None, progress=False)


def verify_corpus(inputs: Inputs) -> Tensor:
    """The evaluation tokens the origin's causal check measures perplexity on (``VERIFY_CORPUS``)."""
    n, length = VERIFY_CORPUS[inputs.settings.full]
    return inputs.eval_tokens[:n, :length]


def trace_top(inputs: Inputs, found: MassiveActivations | None, verify: bool) -> OriginTrace:
    """The entry of the ``dim``/``pos`` settings traced, else the text's headline activation
    (its largest token-specific massive entry; without one: the largest value at the first
    token), with the causal check on :func:`verify_corpus` when ``verify``."""
    s = inputs.settings
    top = found.headline if found is not None else None
    corpus = verify_corpus(inputs) if verify else None
    if s.dim is not None or s.pos is not None:
        return trace_origin(inputs.model, inputs.text, dim=s.dim, pos=s.pos, verify=verify, corpus=corpus)
    if top is None:
        return trace_origin(inputs.model, inputs.text, pos=0, verify=verify, corpus=corpus)
    return trace_origin(inputs.model, inputs.text, dim=int(top.dim), pos=int(top.pos), verify=verify, corpus=corpus)


def intervention_table(inputs: Inputs, progress: bool = False) -> tuple[InterventionTable, str | None]:
    """Table 3 on the evaluation sequences, calibrated on the calibration sequences, and a note
    when the calibration text has no massive activations (only the sink settings then run)."""
    calib = calibrate(inputs.model, inputs.calib_tokens, seq_len=inputs.settings.seq_len,
                      n_seqs=inputs.settings.calibration_seqs, batch_size=inputs.batch_size, progress=progress)
    settings, note = list(SETTINGS), None
    if not calib.dims:
        settings = [name for name in SETTINGS if not REGISTRY[name].needs_massive]
        note = ("No massive activations in the calibration text: only the sink interventions "
                "(sinks fall back to the first token) are run.")
    table = run_interventions(inputs.model, inputs.eval_tokens, calibration=calib, settings=settings,
                              batch_size=inputs.batch_size, progress=progress)
    # the table names what the report really used: the file, and the calibration count
    return replace(table, corpus=describe(inputs.corpus), calibration_source=inputs.calib_source), note


def origin_section(inputs: Inputs, s: Section, found: MassiveActivations | None) -> None:
    verify, chosen = inputs.settings.verify, inputs.settings.dim is not None or inputs.settings.pos is not None
    if not chosen and found is None:
        s.note("The text's massive activations are unknown (that section failed, see above); tracing the largest "
               "value at the first token instead.")
    elif not chosen and found.headline is None:
        s.note("No massive activation in the text; tracing the largest value at the first token instead.")
    elif not chosen and found.headline.scope != "token":
        s.note("No token-specific massive activation in the text; tracing the largest outlier-dimension entry.")
    trace = trace_top(inputs, found, verify)
    if verify:
        used = verify_corpus(inputs)
        more = "" if inputs.settings.full else " (full=True, `--full`: 4 sequences of seq_len tokens)"
        s.text(f"Causal check: perplexity with and without each ablation on the first {len(used)} evaluation "
               f"sequences, {used.shape[1]} tokens each ({inputs.eval_source}){more}.")
    s.pre(trace.summary())
    s.figure(trace.plot(), "origin ledger: each component's write into the traced dim, layer by layer")
    if not trace.events.empty:
        s.table(trace.events, "births, erasures and rebirths")
    if not trace.super_weights.empty:
        s.table(trace.super_weights, "candidate super weights: W_out[neuron, dim] of the birth neurons")
    if not trace.verification.empty:
        s.table(trace.verification, "causal check: zero-ablating the named neurons or weights")
    elif not verify:
        s.note("Causal verification not run (verify=False; quick mode turns it off).")


def attention_section(inputs: Inputs, s: Section, found: MassiveActivations | None) -> None:
    model, text = inputs.model, inputs.text
    texts = [text, SECOND_TEXT]
    sinks = sink_attention(model, texts)
    s.pre(sinks.summary())
    off_switch_part(model, texts, s)  # a learned sink logit or slot, an output gate: where it has one
    if sinks.sinks is not None:
        s.table(sinks.sinks.to_frame().assign(text=lambda f: f["seq"].map({0: "the text", 1: "second text"})),
                f"positions treated as sinks ({sinks.sinks.describe()}): they draw attention as sinks "
                "(by_attention) or carry a massive activation that persists across layers (by_massive)")
    s.figure(sinks.plot(), "attention mass on the sink tokens per layer")
    layer, why = figure_layer(found, inputs)
    positions = sinks.sinks.mask[0].nonzero().flatten().tolist() if sinks.sinks is not None else None
    s.figure(attention_maps(model, text, layer, max_heads=8, sinks=positions),
             f"attention patterns of layer {layer} ({why}); sink columns outlined in red")
    for view in (attention_view(model, text, layer), magnitude_view(model, text, layer)):
        s.view(replace(view, title=f"{view.title} ({why})"))
    decomposition = decompose_attention(model, texts)
    s.pre(decomposition.summary())
    s.figure(decomposition.plot(), "sink term vs content term: norms and how constant the sink term is")
    if not inputs.settings.full:  # attention to a sink is not dependence on it: measured behind --full
        s.note("Sink dependence not measured (a head's attention to a sink is not its dependence on it): --full "
               "measures, per sink head, the loss change without its sink attention and its no-op / broadcast label.")
        return
    try:
        dependence = sink_dependence(model, inputs.eval_tokens[:8], max_heads=8, progress=inputs.progress)
    except MassiveLensError as err:
        s.note(f"Sink dependence not measured: {err}")
        return
    s.pre(dependence.summary())
    s.table(dependence.to_frame(), "sink heads: attention to the sinks beside the loss change without it (paired "
            "95% interval over sequences) and the no-op / broadcast label (output change with another input's sink "
            "value)")


EVERY_TEXT = ("A setting ending in _every (zero_every, mean_every, bias_surgery_every) applies the same edit at every "
              "layer where the targeted dims are massive in calibration, not only where they first appear; the table "
              "adds it only when the first-layer row was rebuilt by the model downstream.")


def intervention_section(inputs: Inputs, s: Section) -> None:
    table, note = intervention_table(inputs, progress=inputs.progress)
    s.text(f"Evaluation: {inputs.eval_source}. Calibration (the means and sinks the settings use): "
           f"{inputs.calib_source}.")
    if note:
        s.note(note)
    s.pre(table.summary())
    s.figure(table.plot(), f"perplexity ratio to the untouched model per intervention ({table.seq_len}-token "
             "sequences; 95% bootstrap interval; rebuilt rows hatched)")
    frame = table.to_frame()
    for row in frame[frame["rebuilt"]].itertuples():
        s.note(f"{row.check}. The {row.setting} row does not measure a removal; the table adds the setting "
               "applied at every layer where the activation is massive.")
    shown = frame.assign(setting=[f"{r.setting} (rebuilt)" if r.rebuilt else r.setting for r in frame.itertuples()])
    s.table(shown[["setting", "where", "sinks_per_seq", "sink_kinds", "targets_per_seq", "target_dims", "target_kinds",
                   "target_kept", "peak_layer", "target_back", "back_layer", "sink_mass", "sink_mass_original"]],
            f"checked downstream on {len(inputs.eval_tokens)} evaluation sequences of {table.seq_len} tokens: the "
            "sinks each setting used and the targets it edited (positions per sequence, dims, token kinds), the "
            "targeted dims' |value| with / without it at their peak layer and later (target_kept, target_back), "
            "and the attention non-sink queries still pay to the sinks; each row's verdict is in the summary above")
    if frame["setting"].str.endswith("_every").any() or frame["rebuilt"].any():
        s.text(EVERY_TEXT)
    s.table(frame[["setting", "acts_on", "description"]], "what each setting does, and where it acts")


def granularity_lead(inputs: Inputs, s: Section) -> None:
    """The quantization section's first table: the damage by granularity and the sinks' share of it
    (``D_sink``). Light: W8A8 per tensor and per token on 2 sequences of 64 tokens; ``full``: W8A8 and
    W4A4 at every granularity with the asymmetric per-group and rotated W4A4, on 4 sequences."""
    full = inputs.settings.full
    n, length = (4, 64) if full else (2, 64)
    tokens, calib = inputs.eval_tokens[:n, :length], inputs.calib_tokens[:n, :length]
    options = dict(seq_len=tokens.shape[1], n_seqs=len(tokens), calibration=calib)
    table = (granularity_table(inputs.model, tokens, **options) if full else
             granularity_table(inputs.model, tokens, bases=["W8A8"], granularities=["tensor", "token"], extra=[],
                               **options))
    s.text(f"Damage by granularity first ({len(tokens)} sequences of {tokens.shape[1]} tokens"
           f"{'' if full else '; full=True, `--full`: W4A4 and every granularity'}): D_sink is the loss gap minus "
           "the gap with the sink tokens kept in full precision, paired over sequences (95% bootstrap interval); a "
           "setting above 10x the full-precision perplexity is marked destroyed and left out of the ratios "
           "(docs/quantization.md).")
    s.pre(table.summary())
    s.table(table.to_frame()[["setting", "weight_granularity", "activation_granularity", "gap", "ppl_ratio",
                              "destroyed", "d_sink", "d_sink_low", "d_sink_high"]],
            "per setting: weight and activation granularity, loss gap (nats), perplexity ratio, destroyed flag, "
            "D_sink (nats) with its 95% interval over sequences")


def quantize_section(inputs: Inputs, s: Section) -> None:
    granularity_lead(inputs, s)
    report = measure_outliers(inputs.model, inputs.eval_tokens, calibration=inputs.calib_tokens)
    s.text(f"W8A8 here: {'per-channel' if report.per_channel else 'per-tensor'} int8 weights and per-tensor "
           "activations (one static, asymmetric scale per layer input, min-max calibrated on the calibration "
           "sequences), so one massive activation stretches every token's grid; the low-bit section below "
           "quantizes activations per token (a scale per token), a different setting with a different gap.")
    s.pre(report.summary())
    s.figure(report.plot(), "largest and median |activation| of each block output")
    s.table(report.to_frame(), "per-layer outlier statistics: max_inf_norm, the largest |activation| of the "
            "block output; ratio, top-1 over the median; kurtosis, of the block output's values; "
            "first_token_norm_ratio, the first token's residual norm over the median norm of the other tokens; "
            "sink_share, the share of that layer's heads whose mean attention to the first token is above 0.3 "
            "(Gu et al.'s sink metric, per layer)")


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
    release_free_memory()  # what this section freed is not held while the next one runs
    log.info("report section %r took %.1f s", title, section.seconds)
    return section, result
