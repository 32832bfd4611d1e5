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
``quick=True`` shrinks them further for tests on tiny models. A section that cannot run on
a model is replaced by a note that says why; nothing is faked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from massive_lens.core.corpora import Corpus
from massive_lens.errors import MassiveLensError
from massive_lens.models import load_model
from massive_lens.report import sections as sec
from massive_lens.report.render import render_figures, to_html, to_markdown, write_tables

DEFAULT_TEXT = "Summer is warm. Winter is cold.\nThe cat sat on the mat, and the dog slept."
MASSIVE = "Massive activations"
# (title, section function, titles of the earlier sections whose results it takes)
SECTIONS: list[tuple[str, Any, tuple[str, ...]]] = [
    ("Model", sec.model_section, ()),
    (MASSIVE, sec.massive_section, ()),
    ("Origin", sec.origin_section, (MASSIVE,)),
    ("Attention sinks and the value-update decomposition", sec.attention_section, (MASSIVE,)),
    ("Interventions", sec.intervention_section, ()),
    ("W8A8 quantization", sec.quantize_section, ()),
]
INTRO = ("Massive activations (Sun et al., 2024): residual values above 100 and about 1,000x the "
         "median of their hidden state. This report finds them, traces where they are born, shows "
         "the attention sinks they create, tests whether they act as a fixed bias, and measures "
         "what they cost under 8-bit quantization.")


def write_report(model: Any = None, text: str | None = None, *, corpus: Corpus = None,
                 out_dir: str | Path = "report", quick: bool = False, progress: bool = True,
                 tables: bool = True) -> Path:
    """Run the analyses and write ``out_dir/index.html`` and ``out_dir/report.md``.

    Args:
        model: a loaded model, a name or path (``str`` or ``Path``) for
            :func:`~massive_lens.load_model`, or None for the offline default.
        text: the text inspected token by token (None: two short sentences).
        corpus: what the scan, perplexity and quantization read (a file, text, ``hf:`` name;
            None: the offline default text).
        out_dir: the output folder (default ``"report"``, created if missing); existing
            files of the same names are overwritten.
        quick: tiny settings (seconds on a tiny model), for tests.
        progress: show a progress bar over the sections.
        tables: also write every table, whole, as CSV under ``out_dir/tables/`` (named
            ``NN-<section>-<caption>.csv``).

    Returns:
        The path of ``index.html``.

    Raises:
        MassiveLensError: if ``text`` is empty or not a string, or ``model`` is not a
            TransformerLens model or names one :func:`~massive_lens.load_model` cannot load.
            A section that raises ``MassiveLensError`` is replaced by a note saying why.

    >>> from massive_lens import tiny_model
    >>> import re, tempfile
    >>> path = write_report(tiny_model("llama"), out_dir=tempfile.mkdtemp(), quick=True, progress=False)
    >>> path.name, re.findall("(?:src|href)=.?https?:", path.read_text())
    ('index.html', [])
    """
    if model is None or isinstance(model, (str, Path)):
        model = load_model(None if model is None else str(model))
    text = DEFAULT_TEXT if text is None else text
    if not isinstance(text, str) or not text.strip():
        raise MassiveLensError("text must be a non-empty string")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    inputs = sec.Inputs(model, text, corpus, sec.QUICK if quick else sec.FULL)
    started = time.perf_counter()
    sections, results = [], {}
    with tqdm(total=len(SECTIONS), desc="report", disable=not progress, unit="section") as bar:
        for title, fn, takes in SECTIONS:
            bar.set_postfix_str(title[:30])
            section, results[title] = sec.run_section(title, fn, inputs, *(results.get(t) for t in takes))
            sections.append(section)
            bar.update()
    render_figures(sections, folder / "figures")
    if tables:
        write_tables(sections, folder / "tables")
    title = f"massive_lens report: {inputs.view.name}"
    timing = ", ".join(f"{s.title.split()[0].lower()} {s.seconds:.0f} s" for s in sections)
    footer = (f"Generated by massive_lens in {time.perf_counter() - started:.0f} s ({timing}); "
              f"settings: {inputs.settings}.")
    (folder / "report.md").write_text(to_markdown(title, INTRO, sections, footer, "figures"), encoding="utf-8")
    page = folder / "index.html"
    page.write_text(to_html(title, INTRO, sections, footer), encoding="utf-8")
    return page
