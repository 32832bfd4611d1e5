"""compare_variants / compare_main on the smoke preset."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from helpers import TRAIN_TEXT  # noqa: E402

from massive_lens.errors import MassiveLensError  # noqa: E402
from massive_lens.train.compare import METRICS, compare_main, compare_variants  # noqa: E402

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

FAST = dict(steps=3, data=TRAIN_TEXT, batch_size=4, log_every=1, eval_every=3, eval_batches=1,
            model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16))


def test_compare_variants_table_curves_profiles_and_verdict():
    result = compare_variants(["softmax", "kv_bias"], preset="smoke", seeds=[0, 1], progress=False,
                              measure_seqs=2, **FAST)
    assert len(result.runs) == 4 and set(METRICS) <= set(result.runs.columns)
    frame = result.to_frame()
    assert list(frame.index) == ["softmax", "kv_bias"] and (frame["seeds"] == 2).all()
    assert "gap_std" in frame.columns
    assert set(result.curves["step"]) == {1, 2, 3}
    assert set(result.profiles["layer"]) == {0}
    assert result.baseline_massive is False  # three steps cannot grow massive activations
    assert "did NOT develop massive activations" in result.summary()
    ax = result.plot()  # one loss curve per variant: the mean over its seeds at each step
    assert (ax.get_title(), ax.get_xlabel()) == ("preset smoke", "step")
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["softmax loss", "kv_bias loss"]
    for variant in ("softmax", "kv_bias"):
        mean = result.curves[result.curves["variant"] == variant].groupby("step")["loss"].mean()
        assert list(lines[f"{variant} loss"].get_xdata()) == [1, 2, 3]
        assert list(lines[f"{variant} loss"].get_ydata()) == pytest.approx(mean.tolist())
    # same data order: the two seeds differ, the variants share each seed's first batch loss
    first = result.curves[result.curves["step"] == 1].set_index(["variant", "seed"])["loss"]
    assert first["softmax", 0] != first["softmax", 1]


def test_compare_main_writes_its_files(tmp_path, monkeypatch):
    import massive_lens.train.compare as compare

    real = compare.compare_variants
    monkeypatch.setattr(compare, "compare_variants",
                        lambda *a, **k: real(*a, **{**k, **FAST, "measure_seqs": 2}))
    text = compare_main(variants="softmax,softmax1", preset="smoke", seeds="0",
                        out_dir=tmp_path, progress=False)
    assert "softmax1" in text
    for name in ("runs.csv", "summary.csv", "curves.csv", "profiles.csv", "summary.txt",
                 "comparison.png"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "softmax1" / "seed0" / "checkpoint.safetensors").is_file()


def test_unknown_variant_raises():
    with pytest.raises(MassiveLensError, match="unknown variants"):
        compare_variants(["softmax3"], preset="smoke")
