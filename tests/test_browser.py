"""The HTML report in a real browser (headless Chromium): every image loads, the interactive
views render, the console stays clean, nothing is fetched from the network; a screenshot is
saved to ``$MASSIVE_LENS_ARTIFACTS`` (default ``out/``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser_cdp import INSTALL, Browser, find_chromium

ARTIFACTS = Path(os.environ.get("MASSIVE_LENS_ARTIFACTS", Path(__file__).resolve().parents[1] / "out"))


@pytest.fixture(scope="module")
def chromium():
    path = find_chromium()
    if path is None:
        pytest.skip(f"headless Chromium not found; install it with `{INSTALL}` (.ci/run does)")
    return path


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
    assert sections == 6
    assert errors == []
    assert [u for u in urls if not u.startswith(("file:", "data:", "about:"))] == []
    assert shot.stat().st_size > 10_000
