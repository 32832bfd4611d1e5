"""The main job: one report a person opens in a browser.

:func:`write_report` runs the library's analyses in the order a researcher would tell the
story, and writes ``DIR/index.html`` (self-contained: figures embedded as base64 PNGs, the
circuitsvis script embedded, nothing fetched from the network) and ``DIR/report.md`` with
its figures under ``DIR/figures/``:

1. the model;
2. its massive activations: in one text (find_massive, the activation landscape) and how
   often over a corpus (scan_corpus, the layer profile);
3. where the largest one is born (trace_origin: ledger, neurons, super weights) and the
   causal check of that story;
4. sink attention and the value-update decomposition (sink term vs content term), with
   interactive attention and magnitude views;
5. the sink census (levels and lifetimes), the sink's key and value, dormant heads
   (sink_census, sink_kv, dormant_heads);
6. the intervention table, judged by perplexity (run_interventions);
7. what the outliers cost under W8A8 quantization (measure_outliers), and whether float16 and
   bfloat16 hold the activations (precision_check, from the float32 measurement);
8. a small low-bit grid: W8A8, W4A16, W4A4, W4A4 with a Hadamard rotation, and with the sinks
   kept in full precision (quantize_grid, on a few short sequences).

Any section but the model's can be left out with ``skip=`` (``--skip`` on the command line).

ReportOptions are small so the default model finishes in a few minutes on 2 CPU cores;
``full=True`` (``--full``) runs the costly steps at full size (more sequences, the whole low-bit
grid, a confirmed half-precision fix), ``quick=True`` shrinks them further for tests on tiny
models, and every size, the traced entry and the layer shown can be set (the options are those
of :class:`ReportOptions`, and the same flags of ``massive-lens report``). The report states what
it used (corpus and calibration files, sequence counts) and its own peak memory next to the
model's weights.
A section that cannot run on a model is replaced by a note that says why; nothing is faked.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from massive_lens.core.budget import weight_bytes
from massive_lens.core.corpora import Corpus, iter_texts
from massive_lens.core.outputs import check_out_dir
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import load_model
from massive_lens.report import sections as sec
from massive_lens.report.circuit_section import circuit_section
from massive_lens.report.inputs import DEFAULT, FULL, QUICK, Inputs, ReportOptions, describe
from massive_lens.report.lowbit_section import lowbit_section
from massive_lens.report.memory import PeakMemory, SectionPeaks, release_free_memory
from massive_lens.report.render import Section, render_figures, to_html, to_markdown, write_tables
from massive_lens.report.sink_section import quantize_and_precision, sinks_section

log = logging.getLogger(__name__)
PEAKS_CAPTION = ("where the memory goes: each step's peak resident memory (exact: the step raised the run's "
                 "high-water mark, so that is its peak; else the largest size sampled every 20 ms), what it adds "
                 "above the start (the interpreter and its libraries, or the model when it was passed in) and over "
                 "the weights, and the largest tensors alive besides the weights as the size grew")
DEFAULT_TEXT = "Summer is warm. Winter is cold.\nThe cat sat on the mat, and the dog slept."
MASSIVE = "Massive activations"
# (key for skip=, title, section function, titles of the earlier sections whose results it takes)
SECTIONS: list[tuple[str, str, Any, tuple[str, ...]]] = [
    ("model", "Model", sec.model_section, ()),
    ("massive", MASSIVE, sec.massive_section, ()),
    ("origin", "Origin", sec.origin_section, (MASSIVE,)),
    ("attention", "Attention sinks and the value-update decomposition", sec.attention_section, (MASSIVE,)),
    ("sinks", "Sink census, keys, values and dormant heads", sinks_section, ()),
    ("circuit", "Why the first token: the sink's circuit", circuit_section, ()),
    ("interventions", "Interventions", sec.intervention_section, ()),
    ("quantization", "W8A8 quantization and half precision", quantize_and_precision, ()),
    ("lowbit", "Low-bit settings: W4A4, a rotation and kept sinks", lowbit_section, ()),
]
INTRO = ("Massive activations (Sun et al., 2024): residual values above 100 and about 1,000x the "
         "median of their hidden state. This report finds them, traces where they are born, shows "
         "the attention sinks they create, tests whether they act as a fixed bias, and measures "
         "what they cost under 8-bit and 4-bit quantization.")


def write_report(model: Any = None, text: str | None = None, *, corpus: Corpus = None, calibration: Corpus = None,
                 out_dir: str | Path = "report", seq_len: int | None = None, n_seqs: int | None = None,
                 scan_seqs: int | None = None, calibration_seqs: int | None = None, verify: bool | None = None,
                 dim: int | None = None, pos: int | None = None, layer: int | None = None,
                 skip: str | Sequence[str] | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None, quick: bool = False, full: bool = False,
                 progress: bool = True, tables: bool = True) -> Path:
    """Run the analyses and write ``out_dir/index.html`` and ``out_dir/report.md``.

    ``massive-lens report`` takes the same options, as flags of the same names
    (``--seq-len``, ``--n-seqs``, ...).

    Args:
        model: a loaded model, a name or path (``str`` or ``Path``) for
            :func:`~massive_lens.load_model`, or None for the offline default.
        text: the text inspected token by token (None: two short sentences).
        corpus: what the scan, the intervention table, quantization and the causal check
            read (a file, text, ``hf:`` name, token tensor; None: the offline default text).
        calibration: where intervention means, sinks and quantization scales are measured
            (None: the corpus sequences after the evaluation ones, disjoint text).
        out_dir: the output folder (default ``"report"``, created if missing; checked before
            any work); existing files of the same names are overwritten.
        seq_len: tokens per corpus sequence (None: 128; 32 with ``quick``).
        n_seqs: evaluation sequences (None: 4; 8 with ``full``; 2 with ``quick``).
        scan_seqs: corpus sequences the scan reads (None: 4; 8 with ``full``).
        calibration_seqs: calibration sequences (None: 4; 2 with ``quick``).
        verify: check the origin story causally (None: True; False with ``quick``).
        dim: the hidden dimension to trace (None: that of the text's largest massive entry).
        pos: the token position to trace (None: that of the largest massive entry).
        layer: the layer of the landscape, attention and magnitude figures (None: the layer
            of the headline activation, the text's largest token-specific massive value).
        skip: sections to leave out, by key: ``"massive"``, ``"origin"``, ``"attention"``,
            ``"sinks"``, ``"circuit"``, ``"interventions"``, ``"quantization"``, ``"lowbit"`` (a comma-separated
            string or a tuple); each shows one line saying it was skipped.
        device: where to load a model given by name (None: the loader's choice); for a
            loaded model it must match (:func:`~massive_lens.load_model` never moves one).
        dtype: the dtype of a model given by name (None: float32); for a loaded model
            None, or its own dtype.
        quick: tiny defaults (seconds on a tiny model), for tests.
        full: the full settings (:data:`~massive_lens.report.FULL`): 8 evaluation and scan
            sequences, the causal check's perplexity on 4 sequences of ``seq_len`` tokens, the
            5-setting low-bit grid on 4 sequences, and a half-precision fix searched by running
            the model in each dtype. The default is lighter, for a first run in minutes on 2 cores.
        progress: show a progress bar over the sections.
        tables: also write every table, whole, as CSV under ``out_dir/tables/`` (named
            ``NN-<section>-<caption>.csv``).

    Returns:
        The path of ``index.html``.

    Raises:
        MassiveLensError: if ``text`` is empty or not a string, a size is below 1, ``verify``
            is not a bool, ``out_dir`` cannot be written, the corpus or calibration file does
            not exist, or ``model`` is not a TransformerLens model or names one
            :func:`~massive_lens.load_model` cannot load; and, before any analysis, if the
            settings cannot run (see :func:`check_runnable`). A section that raises
            ``MassiveLensError`` later is replaced by a note saying why.

    >>> from massive_lens import tiny_model
    >>> import re, tempfile
    >>> path = write_report(tiny_model("llama"), out_dir=tempfile.mkdtemp(), quick=True, progress=False)
    >>> path.name, re.findall("(?:src|href)=.?https?:", path.read_text())
    ('index.html', [])
    """
    settings = settings_for(quick, full=full, seq_len=seq_len, n_seqs=n_seqs, scan_seqs=scan_seqs,
                            calibration_seqs=calibration_seqs, verify=verify, dim=dim, pos=pos, layer=layer,
                            skip=skip)
    text = check_inputs(text, corpus, calibration)
    folder = check_out_dir(out_dir)
    given = model
    with PeakMemory() as peak:
        peaks = SectionPeaks(peak.start_bytes)
        with peaks.track("loading the model and the corpus"):
            model = load_model(None if model is None else model, device=device, dtype=dtype)
            inputs = Inputs(model, text, corpus, settings, calibration, progress=progress)
            check_runnable(inputs)
            release_free_memory()  # what loading left (a GGUF file's parse, the conversion's buffers)
        peaks.weights_of(model)
        _log(None, progress, peaks.line())
        started = time.perf_counter()
        sections, results = [], {}
        with tqdm(total=len(SECTIONS), desc="report", disable=not progress, unit="section") as bar:
            for key, title, fn, takes in SECTIONS:
                bar.set_postfix_str(title[:30])
                if key in settings.skip:
                    section, results[title] = Section(title), None
                    section.note(f"Skipped: skip={key!r} was asked for.")
                else:
                    with peaks.track(title):
                        section, results[title] = sec.run_section(title, fn, inputs, *(results.get(t) for t in takes))
                    _log(bar, progress, peaks.line())
                sections.append(section)
                bar.update()
        del results
        with peaks.track("figures written"):
            render_figures(sections, folder / "figures")
    title = f"massive_lens report: {inputs.view.name}"
    timing = ", ".join(f"{s.title.split()[0].lower()} {s.seconds:.0f} s" for s in sections)
    memory = peak.describe(weight_bytes(model), loaded_inside=given is not model)
    footer = (f"Generated by massive_lens in {time.perf_counter() - started:.0f} s ({timing}); "
              f"{memory}; settings: {settings}; corpus: {describe(corpus)}; "
              f"calibration: {describe(calibration) if calibration is not None else 'from the corpus'}.")
    sections[0].text(memory[0].upper() + memory[1:] + ".")
    sections[0].table(peaks.to_frame(), PEAKS_CAPTION)
    if tables:
        write_tables(sections, folder / "tables")
    (folder / "report.md").write_text(to_markdown(title, INTRO, sections, footer, "figures"), encoding="utf-8")
    page = folder / "index.html"
    page.write_text(to_html(title, INTRO, sections, footer), encoding="utf-8")
    return page


def _log(bar: Any, progress: bool, line: str) -> None:
    """A section's time and memory in the run's log: above the progress bar when it is shown."""
    log.info("report section %s", line)
    if progress:
        tqdm.write(f"report section {line}", file=sys.stderr)


def settings_for(quick: bool, full: bool = False, **options: Any) -> ReportOptions:
    """The report's :class:`ReportOptions`: the quick, default or full presets, with every option
    that is not None in its place.

    >>> settings_for(True, seq_len=64).seq_len, settings_for(False).n_seqs, settings_for(False, full=True).n_seqs
    (64, 4, 8)
    """
    unknown = set(options) - {f.name for f in fields(ReportOptions)} - {"full"}
    if unknown:
        raise MassiveLensError(f"unknown report options {sorted(unknown)}")
    for name, value in (("quick", quick), ("full", full)):
        if not isinstance(value, bool):
            raise MassiveLensError(f"{name} must be True or False, got {value!r}")
    if quick and full:
        raise MassiveLensError("quick and full ask for opposite settings; pass one of them")
    preset = QUICK if quick else FULL if full else DEFAULT
    return replace(preset, **{k: v for k, v in options.items() if v is not None})


def check_runnable(inputs: Inputs) -> None:
    """Stop before any analysis when the requested settings cannot run on this model: a
    ``seq_len`` beyond its context, a ``pos`` outside the text, a corpus (or calibration
    corpus) too short for one sequence or with none left for calibration. The corpus is
    tokenized here once (the sections reuse it).

    Raises:
        MassiveLensError: naming the setting, the model and what to do.
    """
    view, s = inputs.view, inputs.settings
    view.require_text()  # a vision model reads images: say so before any size check
    if view.n_ctx is not None and s.seq_len > view.n_ctx:
        raise MassiveLensError(f"seq_len={s.seq_len} is beyond {view.name}'s context of {view.n_ctx} tokens; "
                               f"pass seq_len <= {view.n_ctx}")
    n_tokens = view.tokenize(inputs.text, None).tokens.shape[1]
    if s.pos is not None and not -n_tokens <= s.pos < n_tokens:
        raise MassiveLensError(f"pos={s.pos} is out of range: the text has {n_tokens} tokens on {view.name} "
                               "(BOS included)")
    try:
        inputs.tokens, inputs.calib_tokens  # noqa: B018 - tokenize now: a corpus too short fails here
    except MassiveLensError as exc:
        raise MassiveLensError(f"the report cannot run on this corpus: {exc}") from None


def check_inputs(text: Any, corpus: Corpus, calibration: Corpus) -> str:
    """The text to inspect (the default for None), after checking that it is a non-empty string
    and that a corpus or calibration file exists (read lazily, it would fail sections later)."""
    text = DEFAULT_TEXT if text is None else text
    if not isinstance(text, str) or not text.strip():
        raise MassiveLensError("text must be a non-empty string")
    for source in (corpus, calibration):
        if isinstance(source, (str, Path)) and not str(source).startswith("hf:"):
            next(iter(iter_texts(source)), None)  # a missing, folder or binary file raises here
    return text
