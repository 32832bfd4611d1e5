"""Quantization has one home (issue 38): results saved by the old modules load, the old names
forward with a deprecation warning, and kurtosis and top-1/median have one definition each."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import massive_lens
from massive_lens import load
from massive_lens.core.stats import kurtosis, top1_median
from massive_lens.quant import LowBitGrid, OutlierReport, Quantization, lowbit_grid, measure_outliers
from massive_lens.quant.fake import fake_quant_activation, rtn
from massive_lens.quant.settings import ROUND_TO_NEAREST, parse_bits
from massive_lens.quant.simulate import Seen

OLD = Path(__file__).parent / "data" / "old_quant"  # saved by massive_lens.quantize / quant before the move
PACKAGE = Path(massive_lens.__file__).parent


@pytest.mark.parametrize(("folder", "cls"), [("lowbit", LowBitGrid), ("outliers", OutlierReport),
                                             ("quant", Quantization)])
def test_results_saved_by_the_old_modules_load_as_the_new_classes(folder, cls, tmp_path):
    manifest = json.loads((OLD / folder / "manifest.json").read_text())
    assert manifest["module"] in ("massive_lens.quantize", "massive_lens.quant.result")  # the old homes
    result = load(OLD / folder)
    assert type(result) is cls and result.summary() == manifest["summary"]
    frame = pd.read_parquet(OLD / folder / "frames" / "frame.parquet")
    pd.testing.assert_frame_equal(result.to_frame(), frame)
    again = load(result.save(tmp_path / folder))  # and saves again under the new name
    assert type(again) is cls and again.summary() == result.summary()
    broken = tmp_path / "broken"
    shutil.copytree(OLD / folder, broken)
    (broken / "manifest.json").write_text(json.dumps({**manifest, "type": "GoneGrid"}))
    with pytest.raises(massive_lens.MassiveLensError, match="GoneGrid"):
        load(broken)


def test_the_old_names_forward_with_a_deprecation_warning():
    import massive_lens.lowbit as old_lowbit
    import massive_lens.quantize as old_quantize

    for module, name, new in [(old_quantize, "measure_outliers", measure_outliers),
                              (old_quantize, "lowbit_grid", lowbit_grid), (old_quantize, "LowBitGrid", LowBitGrid),
                              (old_quantize, "GRID", ROUND_TO_NEAREST), (old_quantize, "parse_bits", parse_bits),
                              (old_lowbit, "rtn", rtn), (old_lowbit, "fake_quant_activation", fake_quant_activation)]:
        with pytest.warns(DeprecationWarning, match=f"{module.__name__}.{name} is deprecated: use massive_lens.quant"):
            assert getattr(module, name) is new
    assert old_quantize.GRID == ("W8A8", "W4A16", "W4A4")  # what the old GRID was
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            old_quantize.nothing  # noqa: B018


def test_kurtosis_is_the_non_excess_fourth_moment():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    c = x.numpy() - x.numpy().mean(-1, keepdims=True)
    want = (c**4).mean(-1) / (c**2).mean(-1) ** 2
    assert np.allclose(kurtosis(x).numpy(), want, rtol=1e-12)
    n = 64
    one_hot = torch.zeros(n, dtype=torch.float64)
    one_hot[7] = 5.0
    assert float(kurtosis(one_hot)) == pytest.approx((n * n - 3 * n + 3) / (n - 1))  # about n: one massive entry
    gaussian = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    assert float(kurtosis(gaussian)) == pytest.approx(3, abs=0.05)


def test_top1_median_is_per_sequence_and_honours_the_valid_positions():
    mag = torch.rand(2, 5, 4, generator=torch.Generator().manual_seed(0)) + 0.1
    mag[0, 0, 3] = 900.0
    valid = torch.tensor([[False, True, True, True, True], [True] * 5])
    top, median, ratio = top1_median(mag, valid)
    for b in range(2):
        kept = mag[b][valid[b]].flatten().numpy()
        lower = np.sort(kept)[(len(kept) - 1) // 2]  # the lower median, as the massive criterion takes it
        assert float(top[b]) == kept.max() and float(median[b]) == pytest.approx(lower)
        assert float(ratio[b]) == pytest.approx(kept.max() / lower)
    assert float(top1_median(mag)[0][0]) == 900.0  # every position counts without a mask
    assert bool(top1_median(mag, torch.zeros(2, 5, dtype=torch.bool))[2].isnan().all())


def test_the_quantizer_reports_the_same_top1_median_as_the_outlier_statistics():
    x = torch.rand(2, 6, 8, generator=torch.Generator().manual_seed(2)) - 0.5
    x[1, 2, 5] = 400.0  # one sequence with a massive value: the largest per-sequence ratio is its own
    seen = Seen()
    seen.add(x, None)
    assert seen.top1_median == pytest.approx(float(top1_median(x.abs())[2].max()))
    assert seen.kurtosis_sum == pytest.approx(float(kurtosis(x).sum()))
    keep = torch.zeros(2, 6, dtype=torch.bool)
    keep[1, 2] = True  # a kept (full-precision) position is not what the quantizer sees
    kept = Seen()
    kept.add(x, keep)
    assert kept.top1_median == pytest.approx(float(top1_median(x.abs(), ~keep)[2].max()))
    assert kept.top1_median < seen.top1_median / 10


def test_one_definition_of_each_outlier_statistic_in_the_package():
    """The fourth moment and a top-1 over a median are written once, in core/stats.py."""
    fourth = re.compile(r"\.pow\(4\)|\*\* ?4\b")
    found = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if fourth.search(p.read_text())]
    assert found == ["core/stats.py"], found
