"""The report on a tiny planted model in quick mode: self-contained HTML, Markdown, figures."""

from __future__ import annotations

import re

import pytest

from massive_lens import MassiveLensError, tiny_model
from massive_lens.interventions import SETTINGS
from massive_lens.report import write as rep

SECTION_TITLES = [title for title, _, _ in rep.SECTIONS]


def test_html_is_self_contained(planted_report):
    html = planted_report.read_text()
    assert planted_report.name == "index.html"
    assert not re.findall(r"<(?:script|img|link|iframe)[^>]*(?:src|href)=['\"]?https?:", html)
    assert not re.findall(r"(?:src|href)=['\"]?https?:", html)
    assert "unpkg.com" not in html and "@import" not in html
    assert html.count("var CircuitsVis") == 1  # the bundle, embedded once
    assert len(re.findall(r"<img src='data:image/png;base64,", html)) >= 6
    for title in SECTION_TITLES:
        assert title in html


def test_report_finds_and_traces_the_planted_activation(planted_report):
    md = (planted_report.parent / "report.md").read_text()
    assert "dim 7" in md and "Skipped" not in md
    # the planted activation reaches calibration, so every intervention runs, "zero" included
    assert "No massive activations in the calibration text" not in md
    assert "| zero | massive activations set to zero where they appear |" in md
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
        ("Model", rep.sec.model_section, ()),
        (rep.MASSIVE, broken, ()),  # skipped: its result is None for the sections that take it
        ("Origin", rep.sec.origin_section, (rep.MASSIVE,)),
        ("Attention", rep.sec.attention_section, (rep.MASSIVE,)),
    ])
    path = rep.write_report(tiny_model("gpt2"), out_dir=tmp_path, quick=True, progress=False)
    md = (path.parent / "report.md").read_text()
    assert "Skipped: this model cannot do that" in md
    assert md.count("Skipped") == 1  # origin and attention ran without the skipped result
    assert "## Origin" in md and "traced entr" in md and "sink metric" in md


def test_a_bug_in_a_section_is_not_hidden(tmp_path, monkeypatch):
    def buggy(inputs, section):
        import massive_lens.not_a_module  # noqa: F401

    monkeypatch.setattr(rep, "SECTIONS", [("Model", rep.sec.model_section, ()), ("Buggy", buggy, ())])
    with pytest.raises(ImportError, match="not_a_module"):
        rep.write_report(tiny_model("gpt2"), out_dir=tmp_path, quick=True, progress=False)


def test_bad_text_is_refused(tmp_path):
    with pytest.raises(MassiveLensError, match="non-empty"):
        rep.write_report(tiny_model("gpt2"), text="   ", out_dir=tmp_path, quick=True, progress=False)
