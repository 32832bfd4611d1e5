"""The HTML report in a real browser (headless Chromium): every image loads, the interactive
views render, the console stays clean, nothing is fetched from the network, and the page
reads well at 1400 px (no table wider than the page, no element past its right edge, names on
one line, no table row taller than ``MAX_ROW_PX``); a screenshot is saved to
``$MASSIVE_LENS_ARTIFACTS`` (default: ``massive_lens_artifacts`` in the temporary folder, so that
nothing is written into the checkout while other test files run beside this one)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from browser_cdp import INSTALL, Browser, find_chromium
from helpers import untouched

from massive_lens import tiny_model
from massive_lens.report.write import SECTIONS

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

ARTIFACTS = Path(os.environ.get("MASSIVE_LENS_ARTIFACTS", Path(tempfile.gettempdir()) / "massive_lens_artifacts"))
WIDTH = 1400  # the window the layout checks use
MAX_ROW_PX = 160  # a table row taller than this means cells wrap where they should not

LAYOUT = """(() => {
  const W = document.documentElement.clientWidth;
  const inView = e => !e.closest('.ml-view') || e.classList.contains('ml-view');
  const name = e => e.tagName.toLowerCase() + (e.className ? '.' + e.className : '')
                    + ' ' + (e.textContent || '').trim().slice(0, 40);
  const past = Array.from(document.querySelectorAll('body *')).filter(inView)
    .filter(e => e.getBoundingClientRect().right > W + 1).map(name);
  const tables = Array.from(document.querySelectorAll('table'));
  const clipped = tables.filter(t => t.scrollWidth > t.clientWidth + 1
                                     || t.getBoundingClientRect().width > W).map(name);
  const rows = Array.from(document.querySelectorAll('tr')).map(r => [r.getBoundingClientRect().height, name(r)]);
  const tallest = rows.reduce((a, b) => (b[0] > a[0] ? b : a), [0, '']);
  const lines = e => {
    const r = document.createRange(); r.selectNodeContents(e);
    return new Set(Array.from(r.getClientRects()).map(c => Math.round(c.top))).size;
  };
  const broken = Array.from(document.querySelectorAll('td.name')).filter(e => lines(e) > 1).map(name);
  return {W, window: window.innerWidth, page: document.documentElement.scrollWidth, past: past.slice(0, 10),
          clipped, tallest, broken, tables: tables.length};
})()"""


@pytest.fixture(scope="module")
def chromium():
    path = find_chromium()
    if path is None:
        pytest.skip(f"headless Chromium not found; install it with `{INSTALL}` (.ci/run does)")
    return path


def _layout(chromium: str, page: Path, profile: Path, shot: str) -> dict:
    browser = Browser(chromium, profile)
    try:
        browser.open(page.as_uri())
        browser.send("Emulation.setDeviceMetricsOverride", width=WIDTH, height=900, deviceScaleFactor=1, mobile=False)
        layout = browser.evaluate(LAYOUT)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.screenshot(ARTIFACTS / shot)
    finally:
        browser.close()
    return layout


def _check(layout: dict) -> None:
    assert layout["window"] == WIDTH and layout["tables"] > 3, layout  # W: the page's width, less the scrollbar
    assert layout["page"] <= layout["W"], f"the page scrolls sideways: {layout}"
    assert layout["past"] == [], f"elements past the right edge: {layout['past']}"
    assert layout["clipped"] == [], f"tables wider than their box or the page: {layout['clipped']}"
    assert layout["broken"] == [], f"names broken over lines: {layout['broken']}"
    assert layout["tallest"][0] <= MAX_ROW_PX, f"tallest table row: {layout['tallest']}"


def test_report_in_headless_chromium(chromium, planted_report, tmp_path):
    browser = Browser(chromium, tmp_path / "profile")
    try:
        browser.open(planted_report.as_uri())
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
    assert sections == len(SECTIONS)  # every section of the report, none lost in the page
    assert errors == []
    assert [u for u in urls if not u.startswith(("file:", "data:", "about:"))] == []
    assert shot.stat().st_size > 10_000


def test_layout_at_1400_px_planted(chromium, planted_report, tmp_path):
    _check(_layout(chromium, planted_report, tmp_path / "profile", "report-layout-planted.png"))


def test_layout_at_1400_px_both_phenomena(chromium, tmp_path):
    """The planted model with a token-specific massive activation and an outlier dimension."""
    from planting import plant_story
    from test_scope import STORY_TEXT

    from massive_lens.report import write_report

    model = plant_story(tiny_model("llama"))
    with untouched(model):
        page = write_report(model, text=STORY_TEXT, out_dir=tmp_path / "story", quick=True, progress=False,
                            tables=False)
    _check(_layout(chromium, page, tmp_path / "profile", "report-layout-story.png"))


@pytest.mark.slow
def test_layout_at_1400_px_default_model(chromium, default_model, tmp_path):
    from massive_lens.report import write_report

    page = write_report(default_model, out_dir=tmp_path / "default", quick=True, progress=False, tables=False)
    _check(_layout(chromium, page, tmp_path / "profile", "report-layout-default.png"))
