"""The HTML report in a real browser (headless Chromium): every image loads, the interactive
views render, the console stays clean, nothing is fetched from the network; a screenshot is
saved to ``$MASSIVE_LENS_ARTIFACTS`` (default ``out/``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser_cdp import INSTALL, Browser, find_chromium

from massive_lens import tiny_model
from massive_lens.report import write_report

ARTIFACTS = Path(os.environ.get("MASSIVE_LENS_ARTIFACTS", Path(__file__).resolve().parents[1] / "out"))


@pytest.fixture(scope="module")
def chromium():
    path = find_chromium()
    if path is None:
        pytest.skip(f"headless Chromium not found; install it with `{INSTALL}` (.ci/run does)")
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory, plant_module):
    model = tiny_model("llama")
    plant_module(model, layer=1, neuron=5, dim=7, value=600.0, trigger=256, trigger_dim=3)
    return write_report(model, out=tmp_path_factory.mktemp("report"), quick=True, progress=False)


@pytest.fixture(scope="module")
def plant_module():
    from conftest import plant_massive

    return plant_massive


def test_report_in_headless_chromium(chromium, report, tmp_path):
    browser = Browser(chromium, tmp_path / "profile")
    try:
        browser.open(report.as_uri())
        images = browser.evaluate(
            "Array.from(document.images).map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}))")
        views = browser.evaluate(
            "Array.from(document.querySelectorAll('.ml-view div[id^=cv-]')).map(d => d.childElementCount)")
        sections = browser.evaluate("document.querySelectorAll('body > section').length")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = browser.screenshot(ARTIFACTS / "report-screenshot.png")
        errors, urls = browser.errors(), browser.requested_urls()
    finally:
        browser.close()
    assert len(images) >= 6, images
    assert [i["alt"] for i in images if not i["ok"]] == []
    assert views and all(n > 0 for n in views), f"circuitsvis views did not render: {views}"
    assert sections == 6
    assert errors == []
    assert [u for u in urls if not u.startswith(("file:", "data:", "about:"))] == []
    assert shot.stat().st_size > 10_000
