"""scripts/retrofit_page.py: intervals, paired verdicts, and docs/retrofit.md equal to its result folders."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest

from massive_lens import MassiveLensError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("retrofit_page", ROOT / "scripts/retrofit_page.py")
page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(page)


def test_t_interval():
    mean, low, high, n = page.interval(pd.Series([1.0, 2.0, 3.0, None]))
    half = 4.303 / math.sqrt(3)  # t(0.975, 2) * sd 1 / sqrt(3)
    assert (mean, n) == (2.0, 3) and low == pytest.approx(2 - half) and high == pytest.approx(2 + half)
    assert math.isnan(page.interval(pd.Series([5.0]))[1])


def test_a_difference_is_shown_only_if_its_paired_interval_excludes_zero():
    rows = []
    for seed, (soft, one) in enumerate([(6.0, 4.0), (6.5, 4.4), (5.8, 3.9)]):
        rows += [dict(setting="softmax-removed", seed=seed, val_loss=soft, first_max=100.0 + seed, complete=True),
                 dict(setting="softmax1-removed", seed=seed, val_loss=one, first_max=100.0 + 3 * (seed - 1) ** 2,
                      complete=True)]
    diffs = page.differences(pd.DataFrame(rows)).set_index("quantity")
    loss = diffs.loc["held-out loss at the end (nats)"]
    assert loss.shown and loss["mean"] == pytest.approx(-2.0, abs=1e-9) and loss.high < 0
    assert not diffs.loc["first token's largest absolute value in the traced dims"].shown  # +2, -1, +1: noise
    text = page.diff_table(page.differences(pd.DataFrame(rows)))
    assert "shown: lower" in text and "not shown" in text


def test_fill_replaces_only_the_named_blocks():
    text = "a\n<!-- gen:x -->\nold\n<!-- /gen:x -->\nb\n"
    assert page.fill(text, {"x": "new"}) == "a\n<!-- gen:x -->\n\nnew\n\n<!-- /gen:x -->\nb\n"
    with pytest.raises(MassiveLensError, match="no <!-- gen:y -->"):
        page.fill(text, {"y": "new"})


def test_the_page_equals_what_the_result_folders_hold():
    assert page.main(["--check"]) == 0, "docs/retrofit.md is stale: run .venv/bin/python scripts/retrofit_page.py"
