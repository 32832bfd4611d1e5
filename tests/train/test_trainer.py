"""Trainer: learning, exact resume, data order, schedule, data sources, DDP under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from helpers import TRAIN_TEXT

from massive_lens.errors import MassiveLensError
from massive_lens.models import byte_tokenizer
from massive_lens.train.data import sample_batch, token_stream
from massive_lens.train.loop import lr_at
from massive_lens.train.presets import get_preset
from massive_lens.train.trainer import load_run, train_model

TINY = dict(model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16), data=TRAIN_TEXT, batch_size=4,
            warmup_steps=2, log_every=1, eval_every=3, eval_batches=1, ckpt_every=3)


def test_training_lowers_the_loss_and_writes_logs(tmp_path):
    run = train_model("smoke", out_dir=tmp_path, progress=False, **{**TINY, "steps": 12, "lr": 1e-2})
    frame = run.to_frame()
    assert list(frame.columns) == ["step", "tokens", "loss", "val_loss", "lr", "grad_norm",
                                   "tokens_per_s", "elapsed_s"]
    assert frame["loss"].iloc[-1] < frame["loss"].iloc[0] - 0.5
    assert (tmp_path / "checkpoint.safetensors").is_file() and not (tmp_path / "checkpoint.safetensors.tmp").exists()
    assert len(pd.read_csv(tmp_path / "log.csv")) == 12
    assert json.loads((tmp_path / "run.json").read_text())["step"] == 12
    assert "trained 12 steps" in run.summary()
    reloaded = load_run(tmp_path)
    tokens = reloaded.to_tokens("The cat")
    torch.testing.assert_close(reloaded(tokens), run.model(tokens))


def test_a_resumed_run_reaches_the_same_loss_as_an_uninterrupted_one(tmp_path):
    cfg = {**TINY, "steps": 6}
    straight = train_model("smoke", out_dir=tmp_path / "a", progress=False, **cfg)
    first = train_model("smoke", out_dir=tmp_path / "b", progress=False, until_step=3, **cfg)
    assert first.steps == 3
    resumed = train_model("smoke", out_dir=tmp_path / "b", progress=False, **cfg)
    assert resumed.steps == 6 and len(resumed.history) == len(straight.history)
    assert resumed.final_loss == pytest.approx(straight.final_loss, abs=1e-6)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_resuming_with_another_configuration_raises(tmp_path):
    train_model("smoke", out_dir=tmp_path, progress=False, **{**TINY, "steps": 3})
    with pytest.raises(MassiveLensError, match="another configuration"):
        train_model("smoke", out_dir=tmp_path, progress=False, **{**TINY, "steps": 3, "lr": 1.0})


def test_grad_clip_zero_leaves_the_gradients_unclipped():
    """grad_clip=0 (what the sink tasks' paper setting uses) trains as a clip no gradient reaches, and is
    recorded with the same gradient norms (was refused)."""
    cfg = {**TINY, "steps": 3, "lr": 1e-2}
    off, huge = (train_model("smoke", progress=False, grad_clip=c, **cfg) for c in (0.0, 1e9))
    tight = train_model("smoke", progress=False, grad_clip=1e-3, **cfg)
    pd.testing.assert_series_equal(off.to_frame()["grad_norm"], huge.to_frame()["grad_norm"])
    for (name, a), b in zip(off.model.state_dict().items(), huge.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert not torch.equal(off.model.W_E, tight.model.W_E)  # a clip that bites changes the weights


def test_batches_depend_only_on_seed_and_step_and_start_with_bos():
    stream = torch.arange(1000)
    a = sample_batch(stream, 4, 8, bos=-1, seed=3, step=7)
    assert torch.equal(a, sample_batch(stream, 4, 8, bos=-1, seed=3, step=7))
    assert not torch.equal(a, sample_batch(stream, 4, 8, bos=-1, seed=3, step=8))
    assert (a[:, 0] == -1).all() and (a[:, 2:] - a[:, 1:-1] == 1).all()  # contiguous windows


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = get_preset("smoke", steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 55) < lr_at(cfg, 20) and lr_at(cfg, 100) == pytest.approx(0.1)


def test_data_sources(tmp_path, monkeypatch):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world\n" * 3)
    tok = byte_tokenizer()
    assert len(token_stream(str(path), tok)) == 36
    assert len(token_stream("default", tok, max_chars=100)) == 100
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(MassiveLensError, match="datasets"):
        token_stream("hf:wikitext:wikitext-2-raw-v1", tok)


def test_bad_configurations_raise():
    with pytest.raises(MassiveLensError, match="unknown preset"):
        get_preset("huge")
    with pytest.raises(MassiveLensError, match="divisible"):
        get_preset("smoke", batch_size=6, grad_accum=4)
    with pytest.raises(MassiveLensError, match="too few"):
        train_model("smoke", progress=False, data="tiny", steps=1)
    with pytest.raises(MassiveLensError, match="no checkpoint"):
        load_run("/nonexistent/run")


@pytest.mark.dist
def test_ddp_with_two_cpu_processes_matches_one_process(tmp_path):
    args = ["steps=3", "log_every=1", "eval_every=3", "eval_batches=1", "batch_size=4",
            "model={\"n_layers\": 1, \"d_model\": 16, \"n_heads\": 2, \"n_ctx\": 16}"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TRAIN_TEXT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "massive_lens.cli", "train", "smoke", str(tmp_path / "ddp"), f"data={corpus}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = pd.read_csv(tmp_path / "ddp" / "log.csv")
    single = train_model("smoke", progress=False, data=str(corpus), steps=3, log_every=1,
                         eval_every=3, eval_batches=1, batch_size=4,
                         model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16))
    assert ddp["loss"].tolist() == pytest.approx(single.to_frame()["loss"].tolist(), abs=1e-4)
