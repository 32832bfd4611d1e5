"""The sink-task runs, their records, the resumable grid and the generated answer page."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from massive_lens.errors import MassiveLensError
from massive_lens.train.taskcli import main as taskcli
from massive_lens.train.taskgrid import SETTINGS, TASK_SETTINGS, grid_settings, pending, run_grid
from massive_lens.train.taskpage import fill, load_runs, paired, shown, write_page
from massive_lens.train.taskrecord import run_folder
from massive_lens.train.taskrun import RESULT, build_model, evaluate, lowbit_gaps, sink_step, train_task
from massive_lens.train.tasks import make_task
from massive_lens.train.tasksettings import TaskSettings

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(steps=3, eval_every=2, eval_seqs=3, batch_size=2, d_model=16, n_heads=2)
SMALL = ("trigger_conditional", "bigram_backcopy")  # the tasks whose data needs no file
PAGE = "# t\n\n<!-- gen:answer -->\n<!-- /gen:answer -->\n\n<!-- gen:ends -->\n<!-- /gen:ends -->\n"


def tiny(task: str = "trigger_conditional", **fields) -> TaskSettings:
    return TaskSettings.of(task, **{**TINY, "task_options": dict(seq_len=8), **fields})


def test_a_run_records_every_evaluation_step_and_writes_its_result_last(tmp_path):
    run = train_task(tiny(variant="softmax1"), tmp_path)
    assert run.evals["step"].tolist() == [0, 2, 3]
    assert len(run.heads) == 3 * 2 * 2  # steps x layers x heads
    result = json.loads((tmp_path / RESULT).read_text())
    assert {"accuracy", "sink_mass", "resid_ratio", "w8a8_gap", "w4a4_gap", "sink_step"} <= set(result)
    assert result["settings"]["variant"] == "softmax1"
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "evals.parquet"), run.evals)


def test_a_run_takes_the_model_style_and_schedule_of_its_settings(tmp_path):
    run = train_task(tiny(style="gpt2", min_lr_ratio=1.0, beta2=0.99, grad_clip=0.0), tmp_path)
    assert run.model.cfg.style == "gpt2" and run.model.W_pos is not None  # LayerNorm, learned positions
    recorded = json.loads((tmp_path / RESULT).read_text())["settings"]
    assert (recorded["style"], recorded["train"]["min_lr_ratio"], recorded["train"]["grad_clip"]) == ("gpt2", 1.0, 0.0)


def test_torch_init_draws_embeddings_from_a_unit_normal_and_matrices_within_their_fan_in_bound():
    settings = tiny(task="bigram_backcopy", d_model=64, init="torch", task_options=dict(seq_len=8, n_vocab=200))
    model = build_model(settings)
    assert 0.9 < float(model.W_E.std()) < 1.1
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    for weight, fan_in in ((attn.W_Q, 64), (attn.W_O, 64), (mlp.W_in, 64), (mlp.W_out, mlp.W_out.shape[0])):
        assert float(weight.abs().max()) <= fan_in ** -0.5 and float(weight.abs().max()) > 0.9 * fan_in ** -0.5
    default = build_model(replace(settings, init="massive_lm"))
    assert float(default.W_E.std()) < 0.05  # MassiveLM's own N(0, 0.02)
    with pytest.raises(MassiveLensError, match="init=.xavier. .one of massive_lm, torch"):
        build_model(replace(settings, init="xavier"))


def test_evaluate_reads_the_sink_mass_from_the_pattern_and_leaves_the_mode():
    settings = tiny()
    run = train_task(settings)
    task = make_task(settings.task, **settings.task_options)
    batch = task.sample(3, seed=-1, step=0)
    run.model.train()
    row, heads = evaluate(run.model, task, batch)
    assert run.model.training
    _, cache = run.model.run_with_cache(batch.tokens)
    mass = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][:, :, 1:, 0].mean((0, 2)) for layer in range(2)])
    assert row["sink_mass"] == pytest.approx(float(mass.max()), rel=1e-5)
    assert [h["sink_mass"] for h in heads] == pytest.approx(mass.flatten().tolist(), rel=1e-5)
    x = cache["blocks.1.hook_resid_post"]
    assert row["resid_ratio"] >= float(x[:, 0].abs().amax(-1).mean() / x.abs().median()) - 1e-5


def test_lowbit_gaps_leave_the_weights_as_they_were():
    settings = tiny()
    run = train_task(settings)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    task = make_task(settings.task, **settings.task_options)
    gaps = lowbit_gaps(run.model, task, task.sample(2, seed=-1, step=0))
    assert set(gaps) == {"w8a8_gap", "w8a8_acc_gap", "w4a4_gap", "w4a4_acc_gap"}
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_sink_step_is_the_first_evaluation_above_the_threshold():
    evals = pd.DataFrame(dict(step=[0, 10, 20, 30], sink_mass=[0.1, 0.3, 0.31, 0.2]))
    assert sink_step(evals) == 20
    assert math.isnan(sink_step(evals.assign(sink_mass=0.1)))


def test_grid_gives_seeds_0_and_1_to_every_setting_first_and_resumes(tmp_path):
    runs = grid_settings(seeds=[2, 0, 1])
    first_late = next(i for i, s in enumerate(runs) if s.train.seed >= 2)
    assert {(s.task, s.name) for s in runs[:first_late] if s.train.seed == 1} == {(s.task, s.name) for s in runs
                                                                                 if s.train.seed == 2}
    assert all(s.train.seed < 2 for s in runs[:first_late]) and len(runs) == 3 * len(TASK_SETTINGS) * len(SETTINGS)
    small = [s for s in grid_settings(seeds=[0], tasks=SMALL, **TINY) if s.name in ("softmax-pre", "relu-pre")]
    small = [replace(s, task_options=dict(seq_len=8)) for s in small]
    assert run_grid(tmp_path, small[:2]) == 2
    assert [s.name for s in pending(tmp_path, small)] == [s.name for s in small[2:]]
    assert run_grid(tmp_path, small) == len(small) - 2  # the finished ones are skipped
    assert (run_folder(tmp_path, small[0]) / RESULT).is_file()


def test_the_page_states_only_differences_whose_interval_excludes_zero():
    ends = pd.DataFrame(dict(task="t", setting=["a"] * 3 + ["b"] * 3 + ["c"], seed=[0, 1, 2] * 2 + [0],
                             x=[1.0, 2.0, 3.0, 1.5, 2.4, 3.6, 9.0]))
    mean, low, high, n = paired(ends, "t", "b", "a", "x")
    assert n == 3 and mean == pytest.approx(0.5) and shown(low, high, n)
    noisy = ends.assign(x=[1.0, 2.0, 3.0, 1.5, 1.9, 3.0, 9.0])
    assert not shown(*paired(noisy, "t", "b", "a", "x")[1:])
    assert not shown(*paired(ends, "t", "c", "a", "x")[1:])  # one seed: never shown


def test_the_page_is_regenerated_from_the_runs_and_check_sees_a_stale_one(tmp_path):
    for s in grid_settings(seeds=[0, 1], tasks=SMALL, settings=[("softmax", "pre"), ("relu", "pre")], **TINY):
        train_task(replace(s, task_options=dict(seq_len=8)), run_folder(tmp_path / "runs", s))
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    assert write_page(tmp_path / "runs", page, check=True) == 1
    assert write_page(tmp_path / "runs", page) == 0 and write_page(tmp_path / "runs", page, check=True) == 0
    text = page.read_text()
    assert "Finished runs: 4" in text and "relu vs softmax | 2 |" in text
    assert (tmp_path / "page" / "curves.png").stat().st_size > 0
    (run_folder(tmp_path / "runs", grid_settings([0], settings=[("relu", "pre")])[0]) / RESULT).unlink()
    assert write_page(tmp_path / "runs", page, check=True) == 1


def test_fill_and_the_cli_fail_clearly(tmp_path):
    with pytest.raises(MassiveLensError, match="gen:answer"):
        fill("no blocks", {"answer": "x"})
    assert taskcli(["run", "--seeds", "a,b", "--root", str(tmp_path)]) == 2
    assert taskcli(["run", "--settings", "softmax", "--root", str(tmp_path)]) == 2
    assert taskcli(["run", "--tasks", "copy", "--root", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())  # nothing trained before the input was checked
    assert taskcli(["page", "--root", str(tmp_path), "--page", str(tmp_path / "none.md")]) == 2


@pytest.mark.parametrize("runs, page", [("docs/sinktasks/runs", "docs/sinktasks.md"),
                                        ("docs/sinktasks/long", "docs/sinktasks_long.md")])
def test_committed_pages_match_the_committed_run_folders(runs, page):
    if page.endswith("long.md") and not load_runs(ROOT / runs)[0].shape[0]:
        pytest.skip("no long runs committed yet")
    assert len(load_runs(ROOT / runs)[0]) > 0
    assert write_page(ROOT / runs, ROOT / page, check=True) == 0, \
        f"regenerate: python -m massive_lens.train.taskcli page --root {runs} --page {page}"
