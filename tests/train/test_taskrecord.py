"""Sink-task run folders read back: derived fields recomputed from the raw records, stale or edited
records caught, copies never counted as seeds, damaged folders a clear error (issues 54 and 48)."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from massive_lens.cli import main as massive_lens_cli
from massive_lens.core.criterion import SINK_THRESHOLD
from massive_lens.errors import MassiveLensError
from massive_lens.train.taskcli import main as taskcli
from massive_lens.train.taskgrid import run_grid
from massive_lens.train.taskpage import load_runs, mean_cell, write_page
from massive_lens.train.taskrecord import read_run, read_runs, refresh_run
from massive_lens.train.taskrun import DEFINITIONS_VERSION, RESULT
from massive_lens.train.tasksettings import TaskSettings

ROOT = Path(__file__).resolve().parents[2]
ROOTS = [("docs/sinktasks/runs", "docs/sinktasks.md"), ("docs/sinktasks/long", "docs/sinktasks_long.md")]
PAGE = "# t\n\n<!-- gen:answer -->\n<!-- /gen:answer -->\n\n<!-- gen:ends -->\n<!-- /gen:ends -->\n"
# a few committed runs, copied into a test's folder: one setting with several seeds, and one beside it
SAMPLE = [f"trigger_conditional/{s}/seed{k}" for s in ("softmax-pre", "relu-pre") for k in range(3)]


def recompute(folder: Path) -> dict:
    """Every derived field of one run, from its raw records alone, written out independently of the package:
    the largest head per step (first in layer, head order among equals), the first step above the threshold,
    the last evaluation's values."""
    evals = pd.read_parquet(folder / "evals.parquet").sort_values("step")
    heads = pd.read_parquet(folder / "heads.parquet")
    tops = {}
    for step, rows in heads.groupby("step"):
        best = None
        for r in rows.sort_values(["layer", "head"]).itertuples():
            if best is None or r.sink_mass > best.sink_mass:
                best = r
        tops[step] = dict(sink_mass=best.sink_mass, sink_layer=best.layer, sink_head=best.head,
                          value_ratio=best.value_ratio, max_logit=rows["max_logit"].max())
    last = {c: evals[c].iloc[-1] for c in evals}
    last.update(tops[last["step"]])
    crossed = [s for s in evals["step"] if tops[s]["sink_mass"] > SINK_THRESHOLD]
    return dict(last, sink_step=float(crossed[0]) if crossed else math.nan, per_step=tops)


def check_against_raw(root: Path, page: Path) -> int:
    """Assert that every run under ``root`` stores what its raw records give (current definitions) and that
    the page's end table and baseline sentence show those values; the number of runs checked."""
    found: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(root.glob(f"*/*/seed*/{RESULT}")):
        stored, fresh = json.loads(path.read_text()), recompute(path.parent)
        assert stored.get("definitions") == DEFINITIONS_VERSION, f"{path}: written with other definitions"
        evals = pd.read_parquet(path.parent / "evals.parquet").set_index("step")
        for step, top in fresh.pop("per_step").items():
            for column, value in top.items():
                assert evals.loc[step, column] == value, f"{path.parent}: evals.parquet {column} at step {step}"
        for key, value in fresh.items():
            same = stored[key] == value or (math.isnan(value) and math.isnan(stored[key]))
            assert same, f"{path}: {key} stored {stored[key]}, recomputed from the raw records {value}"
        s = stored["settings"]
        found.setdefault((s["task"], f"{s['variant']}-{s['norm']}"), []).append(fresh)
    text = page.read_text()
    ends = text[text.index("<!-- gen:ends -->"):text.index("<!-- /gen:ends -->")]
    for (task, setting), runs in found.items():
        block = ends[ends.index(f"**{task}**"):]
        header, row = block.splitlines()[2], next(x for x in block.splitlines() if x.startswith(f"| {setting} |"))
        cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")], strict=True))
        assert cells["seeds"] == str(len(runs)), (task, setting)
        for column, label in (("sink_mass", "sink mass"), ("sink_step", "sink step"), ("accuracy", "accuracy"),
                              ("resid_ratio", "resid top-1/median"), ("max_logit", "max logit")):
            assert cells[label] == mean_cell(pd.Series([r[column] for r in runs])), (task, setting, label)
        steps = [r["sink_step"] for r in runs if not math.isnan(r["sink_step"])]
        if setting == "softmax-pre" and steps:
            assert f"evaluation step {mean_cell(pd.Series(steps))} ({len(steps)} seeds" in text, task
    return sum(map(len, found.values()))


def sample_grid(tmp_path: Path, runs: list[str] = SAMPLE) -> Path:
    root = tmp_path / "runs"
    for run in runs:
        shutil.copytree(ROOT / "docs/sinktasks/runs" / run, root / run)
    return root


def edit(folder: Path, **fields) -> None:
    stored = json.loads((folder / RESULT).read_text())
    (folder / RESULT).write_text(json.dumps({**stored, **fields}))


@pytest.mark.heavy  # over 5 s on 2 cores (page writes, every committed run read)
@pytest.mark.parametrize("runs, page", ROOTS)
def test_every_committed_run_stores_and_the_page_shows_what_its_raw_records_give(runs, page):
    assert check_against_raw(ROOT / runs, ROOT / page) > 0
    assert write_page(ROOT / runs, ROOT / page, check=True) == 0


@pytest.mark.heavy  # over 5 s on 2 cores (page writes, every committed run read)
def test_the_check_fails_on_a_planted_stale_record_and_the_page_never_reads_it(tmp_path, caplog):
    root, page = sample_grid(tmp_path), tmp_path / "page.md"
    page.write_text(PAGE)
    write_page(root, page)
    assert check_against_raw(root, page) == len(SAMPLE)
    folder = root / SAMPLE[0]
    right = json.loads((folder / RESULT).read_text())["sink_step"]
    edit(folder, sink_step=right + 20, definitions=0)  # what the old threshold left behind
    with pytest.raises(AssertionError, match="definitions"):
        check_against_raw(root, page)
    with pytest.raises(MassiveLensError, match=r"definitions version 0, not the current.*sink_step stored"):
        read_run(folder, stale="refuse")
    with caplog.at_level(logging.WARNING, logger="massive_lens.train.taskrecord"):
        assert read_run(folder).result["sink_step"] == right
    assert "stale derived fields recomputed" in caplog.text
    assert write_page(root, page, check=True) == 0  # the page recomputes: the stale value never reaches it
    edit(folder, sink_step=right + 20, definitions=DEFINITIONS_VERSION)  # claims current definitions
    with pytest.raises(AssertionError, match="sink_step stored"):
        check_against_raw(root, page)
    with pytest.raises(MassiveLensError, match="disagree with its own raw records"):
        write_page(root, page, check=True)
    assert refresh_run(folder) and read_run(folder, stale="refuse").result["sink_step"] == right
    assert check_against_raw(root, page) == len(SAMPLE)


def test_an_edited_evaluation_column_is_caught_against_the_heads(tmp_path):
    folder = sample_grid(tmp_path, SAMPLE[:1]) / SAMPLE[0]
    evals = pd.read_parquet(folder / "evals.parquet")
    evals.loc[1, "sink_mass"] = 0.99
    evals.to_parquet(folder / "evals.parquet", index=False)
    with pytest.raises(MassiveLensError, match="evals.parquet:sink_mass"):
        read_run(folder)


def test_the_resumed_grid_rewrites_a_stale_record_instead_of_skipping_it(tmp_path):
    root = sample_grid(tmp_path, SAMPLE[:1])
    folder = root / SAMPLE[0]
    stored = json.loads((folder / RESULT).read_text())
    edit(folder, sink_step=stored["sink_step"] + 20, definitions=0)
    settings = TaskSettings.from_dict(stored["settings"])
    assert run_grid(root, [settings]) == 0  # nothing retrained ...
    assert json.loads((folder / RESULT).read_text()) == stored  # ... and the record is current again
    with pytest.raises(MassiveLensError, match="other settings than the grid asks for"):
        run_grid(root, [TaskSettings.from_dict({**stored["settings"], "lr": 1e-3})])


def test_copied_run_folders_are_never_counted_as_seeds(tmp_path, caplog):
    root = sample_grid(tmp_path, SAMPLE[:2])
    shutil.copytree(root / SAMPLE[1], root / (SAMPLE[1] + ".bak"))
    with caplog.at_level(logging.WARNING, logger="massive_lens.train.taskrecord"):
        ends, _ = load_runs(root)
    assert len(ends) == 2 and sorted(ends.seed) == [0, 1]
    assert "seed1.bak" in caplog.text and "not seed<int> run folders" in caplog.text
    shutil.copytree(root / SAMPLE[1], root / SAMPLE[1].replace("seed1", "seed7"))
    with pytest.raises(MassiveLensError, match="seed7 holds the run of trigger_conditional softmax-pre seed 1"):
        load_runs(root)
    shutil.rmtree(root / SAMPLE[1].replace("seed1", "seed7"))
    shutil.copytree(root / SAMPLE[0], root / "trigger_conditional/softmax-pre.old/seed0")
    with pytest.raises(MassiveLensError, match="moved or copied run folder"):
        read_runs(root)


def _nested(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("damage, match", [
    (lambda f: (f / RESULT).write_text("{not json"), "JSONDecodeError"),
    (lambda f: _nested(f / RESULT), "nested too deeply"),
    (lambda f: (f / RESULT).write_text(" " * (2 << 20)), "more than the"),
    (lambda f: (f / RESULT).write_text("[1, 2]"), "no \"settings\" object"),
    (lambda f: edit(f, settings=dict(task="trigger_conditional", colour=1)), "unknown fields"),
    (lambda f: edit(f, settings=dict(task="trigger_conditional", steps=0)), "steps=0"),
    (lambda f: edit(f, w4a4_gap="x"), "end-of-run measurements"),
    (lambda f: edit(f, definitions=99), "newer than this"),
    (lambda f: (f / "evals.parquet").unlink(), "result.json without evals.parquet"),
    (lambda f: (f / "heads.parquet").write_bytes(b"PAR1 garbage"), "not a readable record"),
    (lambda f: pd.DataFrame(dict(step=[0])).to_parquet(f / "evals.parquet"), "no numeric columns"),
    (lambda f: pd.read_parquet(f / "evals.parquet").iloc[:0].to_parquet(f / "evals.parquet"), "no rows"),
    (lambda f: pd.read_parquet(f / "evals.parquet").iloc[:-1].to_parquet(f / "evals.parquet"), "not a finished run"),
    (lambda f: pd.read_parquet(f / "heads.parquet").iloc[1:].to_parquet(f / "heads.parquet"), "heads at each"),
])
def test_a_damaged_run_folder_is_a_clear_error(tmp_path, damage, match):
    root = sample_grid(tmp_path, SAMPLE[:1])
    damage(root / SAMPLE[0])
    with pytest.raises(MassiveLensError, match=match):
        read_runs(root)
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    assert taskcli(["page", "--root", str(root), "--page", str(page)]) == 2


def test_a_missing_root_or_an_unfinished_run_folder(tmp_path):
    with pytest.raises(MassiveLensError, match="it does not exist"):
        read_runs(tmp_path / "none")
    (tmp_path / "a/softmax-pre/seed0").mkdir(parents=True)  # empty: never finished, not a run yet
    assert read_runs(tmp_path) == []


def test_the_cli_refuses_unusable_threads_and_root_before_start_and_ctrl_c_is_one_line(tmp_path, monkeypatch,
                                                                                         capsys):
    assert taskcli(["run", "--threads", "-1", "--root", str(tmp_path / "r")]) == 2
    assert "threads must be" in capsys.readouterr().err and not (tmp_path / "r").exists()
    (tmp_path / "file").write_text("")
    assert taskcli(["run", "--root", str(tmp_path / "file"), "--tasks", "trigger_conditional", "--seeds", "0"]) == 2
    assert "cannot use" in capsys.readouterr().err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("massive_lens.train.taskcli.run_grid", interrupted)
    assert taskcli(["run", "--root", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err
    assert re.fullmatch(r"taskcli run: interrupted[^\n]*\n", err)


def test_refresh_rewrites_only_stale_records(tmp_path):
    root = sample_grid(tmp_path, SAMPLE[:2])
    edit(root / SAMPLE[0], definitions=0)
    assert taskcli(["refresh", "--root", str(root)]) == 0
    assert all(read_run(root / s, stale="refuse") for s in SAMPLE[:2])
    assert not refresh_run(root / SAMPLE[0])


@pytest.mark.heavy  # over 5 s on 2 cores (page writes, every committed run read)
def test_massive_lens_tasks_runs_the_same_commands_with_its_conventions(tmp_path, monkeypatch, capsys):
    root, page = sample_grid(tmp_path, SAMPLE[:2]), tmp_path / "page.md"
    page.write_text(PAGE)
    assert massive_lens_cli(["tasks", "page", "--root", str(root), "--page", str(page), "--check"]) == 1
    assert massive_lens_cli(["tasks", "page", "--root", str(root), "--page", str(page)]) == 0
    assert massive_lens_cli(["tasks", "page", "--root", str(root), "--page", str(page), "--check"]) == 0
    assert massive_lens_cli(["tasks", "page", "--root", str(tmp_path / "none"), "--page", str(page)]) == 2
    assert capsys.readouterr().err.startswith("massive-lens tasks: no sink-task runs at")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("massive_lens.train.taskcli.run_grid", interrupted)
    assert massive_lens_cli(["tasks", "run", "--root", str(tmp_path / "r")]) == 130
    assert capsys.readouterr().err == "massive-lens tasks: interrupted\n"
