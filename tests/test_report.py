"""The report on a tiny planted model in quick mode: self-contained HTML, Markdown, figures."""

from __future__ import annotations

import re

import pytest

from massive_lens import MassiveLensError, tiny_model
from massive_lens.report import write as rep

SECTION_TITLES = [title for title, _, _ in rep.SECTIONS]


@pytest.fixture(scope="module")
def planted():
    from conftest import plant_massive

    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=256, trigger_dim=3)
    return model


@pytest.fixture(scope="module")
def written(planted, tmp_path_factory):
    from conftest import _untouched

    out = tmp_path_factory.mktemp("report")
    with _untouched(planted):
        path = rep.write_report(planted, out_dir=out, quick=True, progress=False)
    return path


def test_html_is_self_contained(written):
    html = written.read_text()
    assert written.name == "index.html"
    assert not re.findall(r"<(?:script|img|link|iframe)[^>]*(?:src|href)=['\"]?https?:", html)
    assert not re.findall(r"(?:src|href)=['\"]?https?:", html)
    assert "unpkg.com" not in html and "@import" not in html
    assert html.count("var CircuitsVis") == 1  # the bundle, embedded once
    assert len(re.findall(r"<img src='data:image/png;base64,", html)) >= 6
    for title in SECTION_TITLES:
        assert title in html


def test_report_finds_and_traces_the_planted_activation(written):
    md = (written.parent / "report.md").read_text()
    assert "dim 7" in md and "Skipped" not in md
    assert "| setting |" not in md or "zero" in md
    figures = sorted((written.parent / "figures").glob("*.png"))
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
