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
5. the intervention table, judged by perplexity (run_interventions);
6. what the outliers cost under W8A8 quantization (measure_outliers).

Settings are small so the default model finishes in a few minutes on 2 CPU cores;
``quick=True`` shrinks them further for tests on tiny models. A section whose analysis
cannot run (a module missing, or a model without what it needs) is replaced by a note that
says why; nothing is faked.

>>> from massive_lens import tiny_model
>>> import re, tempfile
>>> path = write_report(tiny_model("llama"), out=tempfile.mkdtemp(), quick=True, progress=False)
>>> path.name, re.findall("(?:src|href)=.?https?:", path.read_text())
('index.html', [])
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from massive_lens._report_render import Section, render_figures, to_html, to_markdown
from massive_lens.errors import MassiveLensError

log = logging.getLogger(__name__)
DEFAULT_TEXT = "Summer is warm. Winter is cold.\nThe cat sat on the mat, and the dog slept."


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


class _Context:
    """What later sections reuse from earlier ones (the model, found activations, tokens)."""

    def __init__(self, model: Any, text: str, corpus: Any, settings: Settings):
        self.model, self.text, self.corpus, self.settings = model, text, corpus, settings
        self.found: Any = None
        self._tokens: Any = None

    @property
    def tokens(self) -> Any:
        """Evaluation sequences followed by calibration sequences (disjoint text); the corpus
        scan reads the first ``scan_seqs`` of them (the corpus is tokenized once)."""
        if self._tokens is None:
            from massive_lens.evaluate import sequences

            s = self.settings
            n = max(s.scan_seqs, s.eval_seqs + s.calib_seqs)
            self._tokens = sequences(self.model, self.corpus, s.eval_seq_len, n)
        return self._tokens

    @property
    def eval_tokens(self) -> Any:
        return self.tokens[: self.settings.eval_seqs]

    @property
    def calib_tokens(self) -> Any:
        return self.tokens[self.settings.eval_seqs:]

    @property
    def sinks(self) -> list[int] | None:
        """Positions with massive activations (first token if none; None: not yet known)."""
        return None if self.found is None else (self.found.positions or [0])

    @property
    def massive_layer(self) -> int:
        """First layer with a massive activation, else the layer of the largest top-1/median."""
        if self.found is None:
            return self.model.cfg.n_layers // 2
        if self.found.layers:
            return self.found.layers[0]
        prof = self.found.profile
        return int(prof.loc[(prof["top1"] / prof["median"]).idxmax(), "layer"])


def _model_section(ctx: _Context, s: Section) -> None:
    from massive_lens._model_view import ModelView

    view = ModelView(ctx.model)
    n_params = sum(p.numel() for p in ctx.model.parameters())
    cfg = view.cfg
    s.table(_frame([("model", view.name), ("parameters", f"{n_params:,}"), ("layers", view.n_layers),
                    ("d_model", view.d_model), ("heads", getattr(cfg, "n_heads", "?")),
                    ("dtype", str(view.dtype).replace("torch.", "")), ("text", ctx.text)], ["", "value"]))


def _massive_section(ctx: _Context, s: Section) -> None:
    from massive_lens.detect import find_massive, scan_corpus
    from massive_lens.plots import activation_landscape

    ctx.found = find_massive(ctx.model, ctx.text)
    s.pre(ctx.found.summary())
    s.table(ctx.found.by_dim(), "massive (position, dim) pairs in the text, largest first")
    s.figure(activation_landscape(ctx.model, ctx.text, ctx.massive_layer, found=ctx.found),
             f"activation landscape at layer {ctx.massive_layer}: |value| per token and hidden dimension")
    scan = scan_corpus(ctx.model, ctx.tokens[: ctx.settings.scan_seqs], seq_len=ctx.settings.eval_seq_len,
                       batch_size=4, max_tokens=None, progress=False)
    s.pre(scan.summary())
    s.figure(scan.plot(), "layer profile over the corpus: top-1/2/3 and median |activation| (mean ± std)")
    if not scan.frequency.empty:
        s.table(scan.frequency, "how often each (dim, token kind) is massive over the corpus")


def _origin_section(ctx: _Context, s: Section) -> None:
    from massive_lens.origin import trace_origin

    rows = ctx.found.by_dim()
    if rows.empty:
        s.note("No massive activation in the text; tracing the largest value at the first token instead.")
        trace = trace_origin(ctx.model, ctx.text, pos=0, verify=ctx.settings.verify)
    else:
        top = rows.iloc[0]
        trace = trace_origin(ctx.model, ctx.text, dim=int(top.dim), pos=int(top.pos), verify=ctx.settings.verify)
    s.pre(trace.summary())
    s.figure(trace.plot(), "origin ledger: each component's write into the traced dim, layer by layer")
    if not trace.events.empty:
        s.table(trace.events, "births, erasures and rebirths")
    if not trace.super_weights.empty:
        s.table(trace.super_weights, "candidate super weights: W_out[neuron, dim] of the birth neurons")
    if not trace.verification.empty:
        s.table(trace.verification, "causal check: zero-ablating the named neurons or weights")
    elif not ctx.settings.verify:
        s.note("Causal verification skipped in quick mode.")


def _attention_section(ctx: _Context, s: Section) -> None:
    from massive_lens.attention import decompose_attention, sink_attention
    from massive_lens.plots import attention_maps
    from massive_lens.views import attention_view, magnitude_view

    texts = [ctx.text, "Another text, on another topic.\nIt has two lines."]
    sinks = sink_attention(ctx.model, texts)
    s.pre(sinks.summary())
    s.figure(sinks.plot(), "attention mass on the sink tokens per layer")
    layer = min(ctx.massive_layer + 1, ctx.model.cfg.n_layers - 1)
    s.figure(attention_maps(ctx.model, ctx.text, layer, max_heads=8, sinks=ctx.sinks),
             f"attention patterns of layer {layer}; sink columns outlined in red")
    s.view(attention_view(ctx.model, ctx.text, layer))
    s.view(magnitude_view(ctx.model, ctx.text, ctx.massive_layer))
    decomposition = decompose_attention(ctx.model, texts)
    s.pre(decomposition.summary())
    s.figure(decomposition.plot(), "sink term vs content term: norms and how constant the sink term is")


def _intervention_section(ctx: _Context, s: Section) -> None:
    from massive_lens import interventions as iv
    from massive_lens.evaluate import SETTINGS, run_interventions

    calib = iv.calibrate(ctx.model, ctx.calib_tokens, seq_len=ctx.settings.eval_seq_len,
                         n_seqs=ctx.settings.calib_seqs, progress=False)
    settings = list(SETTINGS)
    if not calib.dims:
        settings = ["original", "sink_term_mean", "sink_term_zero", "sink_attention_removed"]
        s.note("No massive activations in the calibration text: only the sink interventions "
               "(sinks fall back to the first token) are run.")
    table = run_interventions(ctx.model, ctx.eval_tokens, calib, settings=settings, progress=False)
    s.pre(table.summary())
    s.figure(table.plot(), "perplexity ratio to the untouched model per intervention (95% bootstrap interval)")
    s.table(table.to_frame()[["setting", "description"]], "what each setting does")


def _quantize_section(ctx: _Context, s: Section) -> None:
    from massive_lens.quantize import measure_outliers

    report = measure_outliers(ctx.model, ctx.eval_tokens, calibration=ctx.calib_tokens)
    s.pre(report.summary())
    s.figure(report.plot(), "largest and median |activation| of each block output")
    s.table(report.layers, "per-layer outlier statistics")


SECTIONS = [
    ("Model", _model_section),
    ("Massive activations", _massive_section),
    ("Origin", _origin_section),
    ("Attention sinks and the value-update decomposition", _attention_section),
    ("Interventions", _intervention_section),
    ("W8A8 quantization", _quantize_section),
]


def _frame(rows: list[tuple[Any, Any]], columns: list[str]) -> Any:
    import pandas as pd

    return pd.DataFrame([(k, str(v)) for k, v in rows], columns=columns)


def _run_section(ctx: _Context, title: str, fn: Any) -> Section:
    section = Section(title)
    start = time.perf_counter()
    try:
        fn(ctx, section)
    except ImportError as exc:
        section.note(f"Skipped: the module this section needs is not available ({exc}).")
    except MassiveLensError as exc:
        section.note(f"Skipped: {exc}")
    section.seconds = time.perf_counter() - start
    log.info("report section %r took %.1f s", title, section.seconds)
    return section


def write_report(model: Any = None, text: str | None = None, corpus: Any = None, out: str | Path = "report",
                 quick: bool = False, progress: bool = True) -> Path:
    """Run the analyses and write ``out/index.html`` and ``out/report.md``; returns the HTML path.

    ``model``: a loaded model, a name for :func:`~massive_lens.load_model`, or None for the
    offline default. ``text``: the text inspected token by token. ``corpus``: what the
    scan, perplexity and quantization read (a file, text, ``hf:`` name; None: offline text).
    """
    from tqdm.auto import tqdm

    from massive_lens.models import load_model

    if model is None or isinstance(model, (str, Path)):
        model = load_model(None if model is None else str(model))
    text = text or DEFAULT_TEXT
    if not isinstance(text, str) or not text.strip():
        raise MassiveLensError("text must be a non-empty string")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ctx = _Context(model, text, corpus, QUICK if quick else FULL)
    started = time.perf_counter()
    sections = []
    with tqdm(total=len(SECTIONS), desc="report", disable=not progress, unit="section") as bar:
        for title, fn in SECTIONS:
            bar.set_postfix_str(title[:30])
            sections.append(_run_section(ctx, title, fn))
            bar.update()
    render_figures(sections, folder / "figures")
    name = getattr(model.cfg, "model_name", type(model).__name__)
    title = f"massive_lens report: {name}"
    intro = ("Massive activations (Sun et al., 2024): residual values above 100 and about 1,000x the "
             "median of their hidden state. This report finds them, traces where they are born, shows "
             "the attention sinks they create, tests whether they act as a fixed bias, and measures "
             "what they cost under 8-bit quantization.")
    timing = ", ".join(f"{s.title.split()[0].lower()} {s.seconds:.0f} s" for s in sections)
    footer = (f"Generated by massive_lens in {time.perf_counter() - started:.0f} s ({timing}); "
              f"settings: {ctx.settings}.")
    (folder / "report.md").write_text(to_markdown(title, intro, sections, footer, "figures"), encoding="utf-8")
    page = folder / "index.html"
    page.write_text(to_html(title, intro, sections, footer), encoding="utf-8")
    return page
