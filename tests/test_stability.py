"""Training stability: every step recorded from the training pass (without changing it), the
record kept across a resume, and a spike detector that finds a planted spike and nothing in a
flat series."""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from massive_lens.errors import MassiveLensError
from massive_lens.train import compare, compare_main, train_model, training_stability
from massive_lens.train.checkpoint import STEPS
from massive_lens.train.recorder import STEP_COLUMNS
from massive_lens.train.stability import find_spikes, spike_table

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(data="One. Two, three.\n" * 300, model=dict(n_layers=2, d_model=16, n_ctx=16), progress=False,
            log_every=3, eval_every=4)


def test_every_step_is_recorded_with_its_columns():
    run = train_model("smoke", steps=7, **TINY)
    steps = run.per_step
    assert list(steps.columns) == list(STEP_COLUMNS) and steps["step"].tolist() == list(range(1, 8))
    logged = {h["step"]: h for h in run.history}
    for row in steps.itertuples():  # the per-step loss and gradient norm are the history's at its rows
        if row.step in logged:
            assert row.loss == pytest.approx(logged[row.step]["loss"], rel=1e-6)
            assert row.grad_norm == pytest.approx(logged[row.step]["grad_norm"], rel=1e-6)
    assert (steps["max_act"] >= steps["median_act"]).all() and (steps["act_ratio"] >= 1).all()
    assert (steps["max_act"] >= steps["max_act_first"]).all() and steps["max_act_layer"].isin([0, 1]).all()
    assert steps["first_attn"].between(0, 1).all() and (steps["first_attn_top"] >= steps["first_attn"] - 1e-7).all()
    no = train_model("smoke", steps=2, record=False, **TINY)
    assert no.per_step.empty and not any(h._forward_hooks for h in run.model.modules())  # hooks removed


def test_recorded_first_token_attention_is_what_the_pattern_shows():
    run = train_model("smoke", steps=2, attention="kv_bias", **TINY)
    tokens = torch.randint(0, 200, (3, 16))
    _, cache = run.model.run_with_cache(tokens)
    from massive_lens.train.recorder import StepRecorder

    with StepRecorder(run.model) as rec:
        with rec.watching():
            run.model(tokens)
        row = rec.row(step=0, loss=0.0, grad_norm=0.0, lr=0.0)
    per_layer = [cache[f"blocks.{i}.attn.hook_pattern"][..., 1:, 0].mean() for i in range(2)]
    assert row["first_attn"] == pytest.approx(float(torch.stack(per_layer).mean()), rel=1e-5)
    resid = torch.stack([cache[f"blocks.{i}.hook_resid_post"].abs().amax() for i in range(2)])
    assert row["max_act"] == pytest.approx(float(resid.max()), rel=1e-6) and row["max_act_layer"] == int(resid.argmax())


@pytest.mark.parametrize("variant", ["softmax", "kv_bias"])
def test_recording_does_not_change_the_training_math(variant):
    with_rec = train_model("smoke", steps=6, attention=variant, **TINY)
    without = train_model("smoke", steps=6, attention=variant, record=False, **TINY)
    assert [h["loss"] for h in with_rec.history] == [h["loss"] for h in without.history]
    for (name, a), (_, b) in zip(with_rec.model.state_dict().items(), without.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_resume_keeps_the_per_step_record(tmp_path):
    straight = train_model("smoke", steps=8, **TINY)
    train_model("smoke", steps=8, out_dir=tmp_path, until_step=5, **TINY)
    assert len(pd.read_parquet(tmp_path / STEPS)) == 5
    resumed = train_model("smoke", steps=8, out_dir=tmp_path, **TINY)
    assert resumed.per_step["step"].tolist() == list(range(1, 9))
    pd.testing.assert_frame_equal(resumed.per_step, straight.per_step, check_exact=False, rtol=1e-5)
    assert pd.read_parquet(tmp_path / STEPS)["step"].tolist() == list(range(1, 9))


def test_spike_detector_finds_a_planted_spike_and_nothing_in_a_flat_series():
    rng = np.random.default_rng(0)
    n = 300
    run = pd.DataFrame(dict(step=np.arange(1, n + 1), loss=3 + 0.02 * rng.standard_normal(n),
                            grad_norm=1 + 0.05 * rng.standard_normal(n), max_act=np.full(n, 10.0),
                            act_ratio=np.full(n, 5.0), first_attn=np.full(n, 0.2)))
    assert not find_spikes(run["loss"], window=50, factor=1.2).any()
    assert spike_table(run).empty
    run.loc[199, "loss"] = 5.0  # step 200: a loss spike, with the largest activation growing 4x after it
    run.loc[199:204, "max_act"] = 40.0
    run.loc[249, "grad_norm"] = 9.0  # step 250: a gradient spike alone
    spikes = spike_table(run, window=50, loss_factor=1.2, grad_factor=3.0, around=10)
    assert spikes["step"].tolist() == [200, 250] and spikes["kind"].tolist() == ["loss", "grad"]
    assert spikes["act_growth"].tolist() == pytest.approx([4.0, 1.0])
    assert spikes["loss_jump"][0] == pytest.approx(5.0 / run["loss"][149:199].median())
    frame = run.assign(variant="softmax", seed=0)
    result = training_stability(frame)
    assert result.to_frame()["spikes"].tolist() == [2] and "2 spikes" in result.summary()
    early = training_stability(frame, until_step=230)  # the same steps of runs that went on for different lengths
    assert early.spikes["step"].tolist() == [200] and early.to_frame()["steps"].tolist() == [230]
    flat = training_stability(frame.assign(loss=3.0, grad_norm=1.0))
    assert flat.spikes.empty and "No spikes" in flat.summary()


def test_runs_folder_and_bad_inputs(tmp_path, monkeypatch):
    small = dict(TINY, steps=3, measure_seqs=1)
    monkeypatch.setattr(compare, "compare_variants", functools.partial(compare.compare_variants, **small))
    compare_main(variants="softmax", preset="smoke", seeds="0,1", out_dir=tmp_path, progress=False)
    for name in ("stability.png", "stability_runs.csv", "spikes.csv", "stability/manifest.json"):
        assert (tmp_path / name).is_file(), name
    from_folder = training_stability(tmp_path)
    assert sorted(from_folder.to_frame()["seed"]) == [0, 1] and set(from_folder.per_step["variant"]) == {"softmax"}
    with pytest.raises(MassiveLensError, match="record=True"):
        training_stability(train_model("smoke", steps=2, record=False, **TINY))
    with pytest.raises(MassiveLensError, match="window"):
        find_spikes([1.0, 2.0], window=1)


def _record(n: int = 120, loss: float = 3.0) -> pd.DataFrame:
    """A flat per-step record of ``n`` steps with every recorder column."""
    frame = pd.DataFrame({c: np.full(n, 1.0) for c in STEP_COLUMNS})
    return frame.assign(step=np.arange(1, n + 1), loss=loss, max_act=10.0, act_ratio=5.0, first_attn=0.2)


def _write_run(folder, steps: pd.DataFrame, seed=0, attention="softmax", **config):
    folder.mkdir(parents=True)
    steps.to_parquet(folder / STEPS, index=False)
    config = dict(seed=seed, model=dict(attention=attention), **config)
    (folder / "run.json").write_text(json.dumps(dict(config=config)))


def test_two_experiments_with_one_variant_and_seed_stay_two_runs(tmp_path):
    """Issue 37: runs were keyed by (variant, seed), so two experiments under one folder became one
    series whose 'spikes' were the jumps between their two loss curves."""
    _write_run(tmp_path / "first" / "run", _record(loss=3.0), lr=1e-3)
    _write_run(tmp_path / "second" / "run", _record(loss=6.0), lr=3e-3)
    _write_run(tmp_path / "third", _record(loss=4.0), lr=1e-2)
    result = training_stability(tmp_path)
    runs = result.to_frame()
    assert runs["run"].tolist() == ["first/run", "second/run", "third"]
    assert runs["spikes"].tolist() == [0, 0, 0] and runs["steps"].tolist() == [120] * 3
    assert runs["loss_end"].tolist() == [3.0, 6.0, 4.0]
    assert set(zip(runs.variant, runs.seed, strict=True)) == {("softmax", 0)}
    assert result.per_step.groupby("run").size().tolist() == [120] * 3 and "No spikes in any run" in result.summary()
    # a frame with a run column is read the same way; one without keeps (variant, seed)
    assert training_stability(result.per_step).to_frame()["run"].tolist() == runs["run"].tolist()


def test_a_run_whose_loss_turns_nan_is_a_divergence_not_zero_spikes():
    record = _record().assign(variant="softmax", seed=0)
    record.loc[record.step >= 90, ["loss", "grad_norm"]] = np.nan
    result = training_stability(record)
    row = result.to_frame().iloc[0]
    assert row.diverged_at == 90 and row.spikes == 0
    assert result.table()["diverged"].tolist() == [1]
    summary = result.summary()
    assert "DIVERGED" in summary and "from step 90" in summary and "No spikes in any run" not in summary
    assert math.isnan(training_stability(_record().assign(variant="softmax", seed=0)).to_frame().diverged_at[0])


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / STEPS).write_bytes(b"not a parquet file"), "not a readable per-step record"),
    (lambda d: (d / STEPS).write_bytes((d / STEPS).read_bytes()[:40]), "not a readable per-step record"),
    (lambda d: _record().drop(columns="loss").to_parquet(d / STEPS), r"lacks the columns \['loss'\]"),
    (lambda d: _record().assign(loss="x").to_parquet(d / STEPS), r"columns \['loss'\] are not numbers"),
    (lambda d: (d / "run.json").write_text("{not json"), "JSONDecodeError"),
    (lambda d: (d / "run.json").write_text("[" * 100_000), "nested too deeply"),
    (lambda d: (d / "run.json").write_text("{}"), "no \"config\" object"),
    (lambda d: (d / "run.json").write_text("[1]"), "not a run.json"),
    (lambda d: (d / "run.json").write_text('{"config": {"seed": "x"}}'), "integer seed"),
    (lambda d: (d / "run.json").write_text('{"config": {"model": {"attention": 3}}}'), "attention name"),
    (lambda d: (d / "run.json").write_text('{"config": {"model": []}}'), "attention name"),
])
def test_a_damaged_run_record_is_a_clear_error(tmp_path, damage, match):
    _write_run(tmp_path / "run", _record())
    damage(tmp_path / "run")
    with pytest.raises(MassiveLensError, match=match) as info:
        training_stability(tmp_path)
    assert str(tmp_path / "run") in str(info.value)


def test_two_copies_of_one_run_are_refused_not_counted_as_two_seeds(tmp_path):
    """Issue 48: a copied run folder (or one record given twice) became "2 seeds"."""
    _write_run(tmp_path / "softmax_seed0", _record(loss=3.0))
    _write_run(tmp_path / "softmax_seed1", _record(loss=3.5), seed=1)
    assert training_stability(tmp_path).table()["seeds"].tolist() == [2]
    shutil.copytree(tmp_path / "softmax_seed0", tmp_path / "softmax_seed0.bak")
    with pytest.raises(MassiveLensError, match=r"softmax_seed0 and .*softmax_seed0.bak hold the same run"):
        training_stability(tmp_path)
    shutil.rmtree(tmp_path / "softmax_seed0.bak")
    record = _record().assign(variant="softmax", seed=0)
    with pytest.raises(MassiveLensError, match="copies of one run"):
        training_stability([record, record])
    assert training_stability([record, record.assign(seed=1)]).table()["seeds"].tolist() == [2]


def test_a_record_without_run_json_is_refused_not_labelled_softmax_seed_0(tmp_path):
    _write_run(tmp_path / "kv_bias_seed3", _record(), seed=3, attention="kv_bias")
    (tmp_path / "orphan").mkdir()
    _record(loss=4.0).to_parquet(tmp_path / "orphan" / STEPS, index=False)
    with pytest.raises(MassiveLensError, match=r"orphan has a steps.parquet but no run.json.*not read as softmax"):
        training_stability(tmp_path)


def test_key_columns_inside_a_steps_file_must_agree_with_its_run_json(tmp_path):
    _write_run(tmp_path / "a", _record().assign(variant="kv_bias", seed=3), seed=3, attention="kv_bias")
    runs = training_stability(tmp_path).to_frame()  # agreeing columns: dropped, read as the run.json says
    assert runs[["run", "variant", "seed"]].values.tolist() == [["a", "kv_bias", 3]]
    _write_run(tmp_path / "b", _record().assign(variant=["softmax", "relu"] * 60, seed=0))
    with pytest.raises(MassiveLensError, match=r"carries its own \['variant'\] column.*saved frame of several runs"):
        training_stability(tmp_path)


def test_act_ratio_is_recomputed_from_the_raw_columns_of_a_folder(tmp_path, caplog):
    _write_run(tmp_path / "a", _record().assign(max_act=12.0, median_act=3.0, act_ratio=99.0))
    with caplog.at_level(logging.WARNING, logger="massive_lens.train.steprecords"):
        runs = training_stability(tmp_path).to_frame()
    assert runs["act_ratio_end"].tolist() == [4.0] and "act_ratio differs" in caplog.text


def test_the_committed_runs_read_clean_and_give_the_documented_summary(caplog):
    with caplog.at_level(logging.WARNING):
        result = training_stability(ROOT / "docs/training_stability", until_step=300)
    assert not caplog.text  # no stored act_ratio disagrees with its raw columns
    documented = set((ROOT / "docs/training.md").read_text().splitlines())
    assert set(result.summary().splitlines()) <= documented  # the same lines (variants in folder order)
