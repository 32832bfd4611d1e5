"""The report on a tiny planted model in quick mode: self-contained HTML, Markdown, figures."""

from __future__ import annotations

import html as html_text
import re

import pytest
from helpers import plant_massive

from massive_lens import MassiveLensError, tiny_model
from massive_lens.interventions import SETTINGS
from massive_lens.report import write as rep

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

SECTION_TITLES = [title for _, title, _, _ in rep.SECTIONS]


def test_html_is_self_contained(planted_report):
    html = planted_report.read_text()
    assert planted_report.name == "index.html"
    assert not re.findall(r"<(?:script|img|link|iframe)[^>]*(?:src|href)=['\"]?https?:", html)
    assert not re.findall(r"(?:src|href)=['\"]?https?:", html)
    assert "unpkg.com" not in html and "@import" not in html
    assert html.count("var CircuitsVis") == 1  # the bundle, embedded once
    assert len(re.findall(r"<img src='data:image/png;base64,", html)) >= 6
    for title in SECTION_TITLES:
        assert html_text.escape(title) in html  # as the page escapes it ("sink&#x27;s")


def test_report_finds_and_traces_the_planted_activation(planted_report):
    md = (planted_report.parent / "report.md").read_text()
    assert "dim 7" in md and "Skipped" not in md
    # the planted activation reaches calibration, so every intervention runs, "zero" included
    assert "No massive activations in the calibration text" not in md
    assert re.search(r"\| zero \| [^|]+ \| massive activations set to zero where they appear \|", md)
    for setting in SETTINGS:
        assert f"| {setting} |" in md, setting
    figures = sorted((planted_report.parent / "figures").glob("*.png"))
    assert len(figures) >= 6 and all(f.stat().st_size > 1000 for f in figures)
    for f in figures:
        assert f"figures/{f.name}" in md


def test_failing_section_becomes_a_note_and_later_sections_still_run(tmp_path, monkeypatch):
    def broken(inputs, section):
        raise MassiveLensError("this model cannot do that")

    monkeypatch.setattr(rep, "SECTIONS", [
        ("model", "Model", rep.sec.model_section, ()),
        ("massive", rep.MASSIVE, broken, ()),  # skipped: its result is None for the sections that take it
        ("origin", "Origin", rep.sec.origin_section, (rep.MASSIVE,)),
        ("attention", "Attention", rep.sec.attention_section, (rep.MASSIVE,)),
    ])
    path = rep.write_report(tiny_model("gpt2"), out_dir=tmp_path, quick=True, progress=False)
    md = (path.parent / "report.md").read_text()
    assert "Skipped: this model cannot do that" in md
    assert md.count("Skipped") == 1  # origin and attention ran without the skipped result
    assert "## Origin" in md and "traced entr" in md and "sink metric" in md


def test_a_bug_in_a_section_is_not_hidden(tmp_path, monkeypatch):
    def buggy(inputs, section):
        import massive_lens.not_a_module  # noqa: F401

    monkeypatch.setattr(rep, "SECTIONS", [("model", "Model", rep.sec.model_section, ()),
                                              ("buggy", "Buggy", buggy, ())])
    with pytest.raises(ImportError, match="not_a_module"):
        rep.write_report(tiny_model("gpt2"), out_dir=tmp_path, quick=True, progress=False)


def test_bad_text_is_refused(tmp_path):
    with pytest.raises(MassiveLensError, match="non-empty"):
        rep.write_report(tiny_model("gpt2"), text="   ", out_dir=tmp_path, quick=True, progress=False)


# --------------------------------------------------------------------------- options (issue #14)


def test_the_cli_and_compare_models_take_every_write_report_option():
    """Same names, same defaults: ``massive-lens report`` and ``compare_models`` pass them all on."""
    import inspect

    from massive_lens.cli import build_parser, report_options
    from massive_lens.report import compare_models

    params = inspect.signature(rep.write_report).parameters
    options = report_options()
    assert set(options) == set(params) - {"model"}
    assert {"corpus", "seq_len", "n_seqs", "calibration_seqs", "dim", "pos", "layer", "device", "dtype"} <= set(options)
    args = build_parser().parse_args(["report"])
    assert args.model is None  # --model, repeated for the comparison page
    for name in options:
        assert getattr(args, name) == params[name].default, name
    compare = inspect.signature(compare_models).parameters
    for name in options:
        assert name in compare and compare[name].default == params[name].default, name


def test_every_option_steers_the_report_and_the_report_names_what_it_used(tmp_path):
    corpus, calibration = tmp_path / "eval.txt", tmp_path / "calib.txt"
    corpus.write_text("The first corpus line. It has words.\n" * 60)
    calibration.write_text("Calibration prose, another text.\n" * 60)
    path = rep.write_report(tiny_model("llama"), corpus=corpus, calibration=calibration, out_dir=tmp_path / "out",
                            seq_len=24, n_seqs=3, scan_seqs=5, calibration_seqs=2, verify=True, dim=4, pos=1, layer=1,
                            quick=True, progress=False, tables=False)
    md = (path.parent / "report.md").read_text()
    assert f"Evaluation: 3 sequences of 24 tokens from {corpus}" in md
    assert f"calibration: 2 sequences from {calibration}" in md  # the table's own header
    assert "5 sequences, 120 tokens" in md  # the corpus scan
    assert "dim 4" in md and "pos 1" in md and "layer 1" in md
    assert "Causal check: perplexity with and without each ablation on the first 2 evaluation sequences, 24 tokens " \
           "each" in md
    assert "without a corpus" not in md and "Skipped" not in md
    assert re.search(r"Peak memory [\d.]+ [GM]iB resident while the report ran, model included", md)
    assert re.search(r"the model's weights: \d+ MiB, so the peak is [\d.]+x the weights", md)
    assert re.search(r"the analyses added \d+ MiB, [\d.]+x the weights", md)  # a loaded model was given
    assert "seq_len=24, n_seqs=3, scan_seqs=5, calibration_seqs=2, verify=True, dim=4, pos=1, layer=1" in md
    assert not (path.parent / "tables").exists()


def test_the_new_sections_say_which_sinks_and_what_half_precision_does(planted_report):
    md = (planted_report.parent / "report.md").read_text()
    census = md.split("## Sink census, keys, values and dormant heads")[1].split("## ")[0]
    assert "primary sink" in census and "sink key norm" in census and "dormant = sink mass >" in census
    assert "census level primary; secondary sinks not included" in md  # every sink table names its level
    assert "float16: SAFE" in md and "Not run in float16 (confirm=False)" in md


def test_the_lowbit_section_shows_the_grid(planted_report):
    from massive_lens.report.lowbit_section import LOWBIT

    md = (planted_report.parent / "report.md").read_text()
    section = md.split("## Low-bit settings")[1].split("\n## ")[0]
    assert all(f"  {name}: loss" in section for name in LOWBIT[False][0]) and "no GPTQ" in section
    assert "| W4A4+hadamard+kvsink |" in section and ".png" in section  # its table and figure


def test_skip_leaves_sections_out_and_says_so(tmp_path):
    path = rep.write_report(tiny_model("llama"), out_dir=tmp_path / "out", quick=True, progress=False, tables=False,
                            skip="origin, sinks,interventions,lowbit")
    md = (path.parent / "report.md").read_text()
    for key in ("origin", "sinks", "interventions", "lowbit"):
        assert f"Skipped: skip={key!r} was asked for." in md
    assert "sink key norm" not in md and "perplexity ratio to the untouched model" not in md
    assert "W4A4+hadamard" not in md
    assert "Attention sinks and the value-update decomposition" in md and "sinks = positions" in md
    with pytest.raises(MassiveLensError, match="unknown section key.*'census'.*the keys are massive, origin"):
        rep.write_report(tiny_model("llama"), out_dir=tmp_path / "bad", quick=True, progress=False, skip=["census"])
    assert not (tmp_path / "bad").exists()


def test_the_calibration_count_is_the_one_used(planted_report):
    md = (planted_report.parent / "report.md").read_text()
    assert "Calibration (the means and sinks the settings use): 2 sequences from the offline default text, the " \
           "ones after the evaluation sequences" in md
    assert "calibration: 2 sequences from the offline default text" in md


def test_summaries_wrap_and_carry_no_notebook_hints(planted_report):
    html = planted_report.read_text()
    assert "white-space: pre-wrap" in html and "overflow-x: auto" not in html.split("pre {")[1].split("}")[0]
    assert ".by_dim()" not in html and "(see ." not in html


@pytest.mark.parametrize(("options", "expected"), [
    (dict(seq_len=1), "seq_len >= 2"), (dict(n_seqs=0), ">= 1"), (dict(calibration_seqs=-2), ">= 1"),
    (dict(layer=-1), "layer must be >= 0"), (dict(corpus="missing.txt"), "no such corpus file"),
    (dict(calibration="calib/missing.txt"), "no such corpus file"),
])
def test_bad_options_fail_before_any_work(tmp_path, options, expected):
    with pytest.raises(MassiveLensError, match=re.escape(expected)):
        rep.write_report(tiny_model("gpt2"), out_dir=tmp_path / "out", quick=True, progress=False, **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["onto a file", "under a file"])
def test_an_unwritable_out_dir_fails_before_any_work(tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" if where == "onto a file" else tmp_path / "file" / "report"
    expected = "is a file, not a folder" if where == "onto a file" else "under the file"
    with pytest.raises(MassiveLensError, match=expected):
        rep.write_report(tiny_model("gpt2"), out_dir=out, quick=True, progress=False)


@pytest.mark.slow
def test_the_default_models_report_peaks_within_1_5x_its_weights_and_1_4x_with_a_pinned_allocator():
    """The goal of issues 14 and 28, measured as docs/benchmarks.md does: the full default report
    in a fresh interpreter; its peak resident memory less the interpreter's own (libraries
    loaded, no model yet), against the weights: at most 1.5x with glibc's own heuristics (which
    move it by 0.1x from run to run), and at most 1.4x with its mmap threshold pinned, where the
    peak is what the analyses hold."""
    from benchmarks.report import GOAL, PINNED_GOAL, rows

    (row,) = rows("default", runs=1)
    if row.ratio > GOAL:  # the benchmark's own rule: the lowest of two fresh interpreters (a concurrent
        # job, here the other test worker, moves one run's peak by up to 0.15x; benchmarks.report.rows)
        row = min(row, *rows("default", runs=1), key=lambda r: r.ratio)
    assert row.ratio <= GOAL, row.detail
    (pinned,) = rows("default", runs=1, pinned=True)
    assert pinned.ratio <= PINNED_GOAL, pinned.detail


@pytest.mark.parametrize("loaded_inside, start", [
    (True, "the interpreter and its libraries; loading the model and the analyses added"),
    (False, "the model loaded; the analyses added"),
    (None, "some models loaded; loading the others and the analyses added"),
])
def test_the_memory_statement_says_what_the_start_held(loaded_inside, start):
    from massive_lens.report.memory import PeakMemory

    with PeakMemory() as peak:
        pass
    text = peak.describe(2**20, loaded_inside)
    assert f"at the start: {start} " in text and text.endswith("x the weights")


# --------------------------------------------------------------------------- settings that cannot run (issue 21)


@pytest.mark.parametrize(("options", "expected"), [
    (dict(seq_len=10_000), "beyond"), (dict(pos=500), "pos=500 is out of range"),
    (dict(corpus="two words"), "not enough for one sequence"), (dict(corpus=["x"]), "the report cannot run"),
])
def test_settings_that_cannot_run_stop_before_any_analysis(tmp_path, options, expected):
    with pytest.raises(MassiveLensError, match=re.escape(expected)):
        rep.write_report(tiny_model("gpt2"), out_dir=tmp_path / "out", quick=True, progress=False, **options)
    assert not (tmp_path / "out" / "index.html").exists() and not (tmp_path / "out" / "report.md").exists()


def test_verify_no_is_not_read_as_true(tmp_path):
    """What a caller without the test-time type checker gets (a subprocess: no import hook)."""
    import subprocess
    import sys

    code = ("from massive_lens import tiny_model, write_report, MassiveLensError\n"
            "try:\n    write_report(tiny_model('gpt2'), out_dir={!r}, quick=True, progress=False, verify='no')\n"
            "except MassiveLensError as exc:\n    print('refused:', exc)\n").format(str(tmp_path / "out"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "refused: verify must be True or False, got 'no'" in out.stdout, out.stderr[-2000:]


def test_a_failed_corpus_scan_keeps_what_the_text_showed(tmp_path, monkeypatch):
    """The scan fails (an overflow, say): the origin section still traces the text's massive entry."""
    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=model.tokenizer.bos_token_id, trigger_dim=3)

    def failing(inputs):
        raise MassiveLensError("overflow in the scan")

    monkeypatch.setattr(rep.sec, "corpus_scan", failing)
    path = rep.write_report(model, out_dir=tmp_path, quick=True, progress=False, tables=False,
                            skip="attention,sinks,circuit,interventions,quantization,lowbit")  # checked: before them
    md = (path.parent / "report.md").read_text()
    assert "Corpus scan skipped: overflow in the scan" in md
    origin = md.split("## Origin")[1].split("## ")[0]
    assert "No massive activation" not in origin and "dim 7 at" in origin


def test_report_md_escapes_raw_html(tmp_path):
    model = tiny_model("gpt2")
    model.cfg.model_name = "<u>named</u>"
    text = "A <script>alert(1)</script> and <img src=x onerror=alert(2)> here."
    path = rep.write_report(model, text=text, out_dir=tmp_path, quick=True, progress=False, tables=False)
    md = (path.parent / "report.md").read_text()
    html = path.read_text()
    outside_fences = re.sub(r"(?ms)^(`{3,})\n.*?^\1$", "", md)  # fenced blocks are inert text
    for raw in ("<script>alert(1)</script>", "<img src=x", "<u>named</u>"):
        assert raw not in outside_fences and raw not in html
    assert "&lt;script>" in outside_fences and "&lt;u>named&lt;/u>" in outside_fences  # the text, the name
    fences = re.findall(r"(?m)^`{3,}$", md)
    assert len(fences) % 2 == 0
