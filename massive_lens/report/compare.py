"""Several models on one page, side by side.

Do two models carry their massive activations the same way? :func:`compare_models` runs the
report's analyses on each model in turn (a model given by name is loaded, analysed and
released before the next one is loaded) and writes one page whose tables have one column
per model:

1. the models (architecture, size, whether texts start with a BOS token);
2. their massive activations: which dims, at which kinds of token, in which layers, how
   large, and how often over a corpus, with the layer profiles of all models overlaid on a
   relative-depth axis (layer / last layer), so models of different depths line up;
3. where the largest one of the text is born: birth layers and neurons, the candidate super
   weights, and the writes that account for its peak;
4. the intervention table (the paper's Table 3) as perplexity ratios.

Every model sees the same text and corpus, each through its own tokenizer. An analysis that
cannot run on a model leaves its cells empty and says why; nothing is faked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from massive_lens.core.budget import weight_bytes
from massive_lens.core.corpora import Corpus
from massive_lens.core.fmt import pct, short
from massive_lens.core.outputs import check_out_dir
from massive_lens.detect import CorpusScan, MassiveActivations, find_massive
from massive_lens.detect.scope import layer_span
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import REGISTRY, InterventionTable
from massive_lens.models.load import load_model
from massive_lens.origin import OriginTrace
from massive_lens.report import compare_cells as cells
from massive_lens.report import sections as sec
from massive_lens.report.compare_cells import MISSING as _MISSING
from massive_lens.report.compare_cells import REBUILT_MARK, side_by_side
from massive_lens.report.inputs import Inputs, ReportOptions, describe
from massive_lens.report.memory import PeakMemory
from massive_lens.report.render import Section, render_figures, to_html, to_markdown, write_tables
from massive_lens.report.write import check_inputs, settings_for
from massive_lens.viz import overlay_profiles

INTRO = ("Massive activations (Sun et al., 2024): residual values above 100 and about 1,000x the "
         "median of their hidden state. This page runs the same analyses on several models and puts "
         "them side by side, one column per model: where the massive activations sit, where the "
         "largest one is born, and what removing them costs.")


@dataclass
class ModelResults:
    """What :func:`compare_models` measured on one model (None where an analysis could not run)."""

    name: str
    facts: dict[str, str]
    n_layers: int
    found: MassiveActivations | None = None
    scan: CorpusScan | None = None
    trace: OriginTrace | None = None
    table: InterventionTable | None = None
    notes: list[tuple[str, str]] = field(default_factory=list)  # (analysis, why it is missing or partial)
    seconds: float = 0.0
    weight_bytes: int = 0


def compare_models(models: Sequence[Any], text: str | None = None, *, corpus: Corpus = None,
                   calibration: Corpus = None, out_dir: str | Path = "report", seq_len: int | None = None,
                   n_seqs: int | None = None, scan_seqs: int | None = None, calibration_seqs: int | None = None,
                   verify: bool | None = None, dim: int | None = None, pos: int | None = None,
                   layer: int | None = None, skip: str | Sequence[str] | None = None,
                   device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                   quick: bool = False, full: bool = False, progress: bool = True, tables: bool = True) -> Path:
    """Run the report's analyses on each model and write one page comparing them side by side.

    The options are :func:`~massive_lens.write_report`'s, with the same names and defaults
    (``massive-lens report --model A --model B`` passes its flags here).

    Args:
        models: two or more models: loaded TransformerLens models, or names and paths for
            :func:`~massive_lens.load_model` (``None`` or ``"default"`` for the offline
            default, ``"qwen2.5-coder-1.5b"`` for the offline Qwen2 model, hub ids, folders,
            ``.gguf`` files). A name is loaded only when its turn comes and released after.
        text: the text inspected token by token (None: two short sentences).
        corpus: what the scan and the intervention table read (a file, text, ``hf:`` name;
            None: the offline default text).
        calibration: where the intervention means and sinks are measured (None: the corpus
            sequences after the evaluation ones).
        out_dir: the output folder (default ``"report"``, created if missing and checked
            before any work); its ``index.html``, ``report.md``, ``figures/`` and ``tables/``
            are overwritten.
        seq_len: tokens per corpus sequence (None: 128; 32 with ``quick``).
        n_seqs: evaluation sequences (None: 4; 8 with ``full``; 2 with ``quick``).
        scan_seqs: corpus sequences the scan reads (None: 4; 8 with ``full``).
        calibration_seqs: calibration sequences (None: 4; 2 with ``quick``).
        verify: must be None or False: the page compares the traces, it does not verify them.
        dim: the hidden dimension to trace in every model (None: each one's largest entry's).
        pos: the token position to trace (None: each model's largest massive entry's).
        layer: must be None: the page draws no per-layer figures.
        skip: must be None or empty: the page runs its own set of analyses.
        device: where to load models given by name (None: the loader's choice).
        dtype: the dtype of models given by name (None: float32).
        quick: tiny settings (seconds on a tiny model), for tests.
        full: the full settings of the costly steps (see :func:`~massive_lens.write_report`).
        progress: show a progress bar over the models.
        tables: also write every table as CSV under ``out_dir/tables/``.

    Returns:
        The path of ``index.html``.

    Raises:
        MassiveLensError: if fewer than two models are given, ``text`` is empty or not a
            string, an option is out of range or does not apply (``verify``, ``layer``),
            ``out_dir`` or a corpus file is unusable, or a model cannot be loaded. An analysis that raises
            ``MassiveLensError`` on one model leaves that model's cells empty, with a note.

    >>> from massive_lens import tiny_model
    >>> import tempfile
    >>> page = compare_models([tiny_model("llama"), tiny_model("qwen2")], out_dir=tempfile.mkdtemp(),
    ...                       quick=True, progress=False)
    >>> "tiny-llama" in page.read_text() and "tiny-qwen2" in page.read_text()
    True
    """
    if isinstance(models, (str, Path)) or not isinstance(models, Sequence) or len(models) < 2:
        raise MassiveLensError("compare_models needs a list of two or more models or names; for one model "
                               "use write_report")
    if verify or layer is not None or skip:
        raise MassiveLensError("verify, layer and skip apply to the one-model report (write_report), not to the "
                               "comparison page; leave them unset")
    settings = settings_for(quick, full=full, seq_len=seq_len, n_seqs=n_seqs, scan_seqs=scan_seqs,
                            calibration_seqs=calibration_seqs,
                            verify=False, dim=dim, pos=pos)
    text = check_inputs(text, corpus, calibration)
    folder = check_out_dir(out_dir)
    started = time.perf_counter()
    named = [isinstance(item, (str, Path)) or item is None for item in models]  # loaded below
    loaded_inside = True if all(named) else False if not any(named) else None
    results: list[ModelResults] = []
    with PeakMemory() as peak:
        for item in tqdm(models, desc="compare", disable=not progress, unit="model"):
            model = load_model(item, device=device, dtype=dtype)
            results.append(analyse(model, text, corpus, settings, calibration, progress=progress))
            del model  # a model loaded here is released before the next one is loaded
        cells.unique_names(results)
        sections = [_models(results, text), _massive(results), _origin(results), _interventions(results),
                    _summaries(results)]
        render_figures(sections, folder / "figures")
    if tables:
        write_tables(sections, folder / "tables")
    title = "massive_lens comparison: " + " vs ".join(r.name for r in results)
    timing = ", ".join(f"{r.name} {r.seconds:.0f} s" for r in results)
    weights = ", ".join(f"{r.name} {r.facts['weights']}" for r in results)
    footer = (f"Generated by massive_lens in {time.perf_counter() - started:.0f} s ({timing}); "
              f"{peak.describe(max(r.weight_bytes for r in results), loaded_inside)} "
              f"(the largest model's; weights: {weights}); "
              f"settings: {settings}; corpus: {describe(corpus)}; "
              f"calibration: {describe(calibration) if calibration is not None else 'from the corpus'}.")
    (folder / "report.md").write_text(to_markdown(title, INTRO, sections, footer, "figures"), encoding="utf-8")
    page = folder / "index.html"
    page.write_text(to_html(title, INTRO, sections, footer), encoding="utf-8")
    return page


def analyse(model: Any, text: str, corpus: Corpus, settings: ReportOptions, calibration: Corpus = None,
            progress: bool = False) -> ModelResults:
    """The analyses behind one column of the comparison, each through the report's own helpers
    (the trace is not verified: the page compares stories, the single-model report checks them),
    with a progress bar over them (and the intervention table's own bar inside it)."""
    start = time.perf_counter()
    inputs = Inputs(model, text, corpus, settings, calibration)
    view = inputs.view
    cfg = view.cfg
    architecture = getattr(cfg, "architecture", None) or type(getattr(model, "original_model", model)).__name__
    facts = {
        "architecture": str(architecture),
        "parameters": f"{sum(p.numel() for p in model.parameters()):,}",
        "layers": str(view.n_layers),
        "d_model": str(view.d_model),
        "heads (key/value heads)": f"{getattr(cfg, 'n_heads', '?')} ({getattr(cfg, 'n_key_value_heads', None) or '='})",
        "first token": "BOS" if view.tokenize(text).has_bos else "the text's own",
        "dtype": str(view.dtype).replace("torch.", ""),
        "weights": f"{weight_bytes(model) / 2**30:.2f} GiB",
    }
    r = ModelResults(view.name, facts, view.n_layers, weight_bytes=weight_bytes(model))

    bar = tqdm(total=4, desc=r.name, disable=not progress, unit="analysis", leave=False)

    def attempt(what: str, fn: Any) -> Any:
        bar.set_postfix_str(what)
        try:
            return fn()
        except MassiveLensError as exc:
            r.notes.append((what, f"{r.name}: {what} did not run: {exc}"))
            return None
        finally:
            bar.update()

    r.found = attempt("find_massive", lambda: find_massive(model, text))
    r.scan = attempt("scan_corpus", lambda: sec.corpus_scan(inputs))
    r.trace = attempt("trace_origin", lambda: sec.trace_top(inputs, r.found, verify=False))
    table = attempt("interventions", lambda: sec.intervention_table(inputs, progress=progress))
    bar.close()
    if table is not None:
        r.table, note = table
        if note:
            r.notes.append(("interventions", f"{r.name}: {note}"))
    r.seconds = time.perf_counter() - start
    return r


# --------------------------------------------------------------------------- the sections


def _notes(s: Section, results: list[ModelResults], *whats: str) -> None:
    for r in results:
        for what, note in r.notes:
            if what in whats:
                s.note(note)


def _models(results: list[ModelResults], text: str) -> Section:
    s = Section("Models")
    labels = list(dict.fromkeys(k for r in results for k in r.facts))
    s.table(side_by_side(results, [(k, None, lambda r, k=k: r.facts.get(k)) for k in labels]))
    s.text(f"Text inspected token by token: {text!r}")
    return s


def _massive(results: list[ModelResults]) -> Section:
    s = Section("Massive activations")
    rows = [
        ("token-specific massive (position, dim) pairs in the text", "found", lambda r: len(cells.token_pairs(r))),
        ("their dims, largest first", "found",
         lambda r: cells.listed(cells.token_pairs(r).dim.drop_duplicates().tolist())),
        ("token kinds (pairs)", "found", lambda r: cells.counts(cells.token_pairs(r).token_kind)),
        ("tokens", "found",
         lambda r: cells.listed([repr(short(t, 20)) for t in cells.token_pairs(r).token.drop_duplicates()], 4)),
        ("largest |value| (x median), at layer", "found", lambda r: cells.largest(cells.token_pairs(r))),
        ("layers where massive (any scope)", "found", lambda r: cells.layer_range(r.found.layers, r.n_layers)),
        ("outlier dimensions (massive at most tokens of a layer), listed apart", "found",
         lambda r: "; ".join(f"dim {o.dim} at {pct(o.share)} of tokens in {layer_span(o.layers)}"
                             for o in r.found.outlier_dims().head(3).itertuples()) or "none"),
        ("over the corpus: dim at token kind, share of sequences", "scan",
         lambda r: "; ".join(f"dim {f.dim} at {f.token_kind}: {pct(f.frequency)}"
                             for f in r.scan.frequency[r.scan.frequency.scope == "token"].head(4).itertuples())
         or "none"),
        ("corpus: sequences, tokens", "scan", lambda r: f"{r.scan.n_sequences}, {r.scan.n_tokens:,}"),
    ]
    s.table(side_by_side(results, rows), "one column per model (from find_massive on the text and scan_corpus)")
    scans = {r.name: r.scan for r in results if r.scan is not None}
    if scans:
        s.figure(overlay_profiles(scans, relative_depth=True, title="layer profiles, relative depth"),
                 "top-1 (solid) and median (dashed) |activation| per layer over the corpus, one colour per "
                 "model; the x axis is layer / last layer so models of different depths line up")
    _notes(s, results, "find_massive", "scan_corpus")
    return s


def _origin(results: list[ModelResults]) -> Section:
    s = Section("Origin of the largest massive activation")
    rows = [
        ("traced entry", "trace", lambda r: cells.entry(r.trace.targets.iloc[0])),
        ("peak (layer), final value", "trace", lambda r: cells.peak(r.trace.targets.iloc[0])),
        ("births", "trace", lambda r: cells.births(r.trace)),
        ("birth neurons (share of their MLP's write)", "trace", lambda r: cells.neurons(r.trace)),
        ("candidate super weights", "trace", lambda r: cells.super_weights(r.trace)),
        ("what accounts for the peak", "trace", lambda r: cells.attribution(r.trace)),
    ]
    s.table(side_by_side(results, rows), "trace_origin of each model's largest massive entry in the text "
            "(without one: the largest value at the first token); not verified here")
    _notes(s, results, "trace_origin")
    return s


def _interventions(results: list[ModelResults]) -> Section:
    s = Section("Interventions (Table 3)")
    tables = {r.name: r.table.to_frame() for r in results if r.table is not None}
    if tables:
        settings = list(dict.fromkeys(name for frame in tables.values() for name in frame.setting))
        rows: list[tuple[str, str | None, Any]] = [("perplexity of the untouched model", "table",
                                                    lambda r: cells.original_perplexity(r.table.to_frame()))]
        rows += [(name, "table", lambda r, name=name: cells.setting_ratio(r.table.to_frame(), name))
                 for name in settings if name != "original"]
        s.table(side_by_side(results, rows), "perplexity ratio to the untouched model [95% bootstrap interval] "
                f"per setting (run_interventions on each model's own tokens of the same corpus); {REBUILT_MARK}: the "
                "model rebuilt the removed activation downstream, so the ratio does not measure a removal",
                max_rows=60)
        s.table(pd.DataFrame([(name, REGISTRY[name].description) for name in settings if name in REGISTRY],
                             columns=["setting", "description"]), "what each setting does", max_rows=60)
        s.text(sec.EVERY_TEXT + f" A {_MISSING} in its row means that model's first-layer removal held, so the "
               "every-layer row was not needed.")
    _notes(s, results, "interventions")
    return s


def _summaries(results: list[ModelResults]) -> Section:
    s = Section("Each model's own summaries")
    for r in results:
        s.text(r.name)
        for result in (r.found, r.scan, r.trace, r.table):
            if result is not None:
                s.pre(result.summary())
    return s
