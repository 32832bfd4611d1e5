"""One check of a sink-task run's settings, used by every entry (issue 48): each bad value is refused
with a message naming the field, by check_settings, train_task, build_model and the grid alike."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest

from massive_lens.errors import MassiveLensError
from massive_lens.train.presets import TrainConfig
from massive_lens.train.taskgrid import run_grid
from massive_lens.train.taskrun import build_model, train_task
from massive_lens.train.tasks import make_task
from massive_lens.train.tasksettings import SETTINGS_FORMAT, TASK_TRAIN, TRAIN_KNOBS, TaskSettings, check_settings

TINY = dict(steps=2, eval_every=1, eval_seqs=2, batch_size=2, d_model=16, n_heads=2)
OPTIONS = dict(seq_len=8)

# (field overrides, what the message must name)
BAD = [
    (dict(n_layers=0), r"n_layers=0 \(a whole number >= 1"),
    (dict(n_heads=0), r"n_heads=0 \(a whole number >= 1"),
    (dict(d_model=0), r"d_model=0 \(a whole number >= 1"),
    (dict(d_model=15), "not divisible by n_heads"),
    (dict(lr=0.0), r"lr=0.0 \(a finite number > 0"),
    (dict(lr=-1e-3), "lr=-0.001"),
    (dict(lr=math.nan), "lr=nan"),
    (dict(lr=math.inf), "lr=inf"),
    (dict(lr="3e-3"), "lr='3e-3'"),
    (dict(beta2=1.0), r"beta2=1.0 \(a finite number in \[0, 1\)"),
    (dict(beta2=-0.1), "beta2=-0.1"),
    (dict(warmup_steps=-1), r"warmup_steps=-1 \(a whole number >= 0"),
    (dict(grad_clip=-1.0), r"grad_clip=-1.0 \(a finite number >= 0"),
    (dict(grad_clip=math.nan), "grad_clip=nan"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(min_lr_ratio=1.5), r"min_lr_ratio=1.5 \(a finite number in \[0, 1\]"),
    (dict(min_lr_ratio=-0.1), "min_lr_ratio=-0.1"),
    (dict(seed=-1), r"seed=-1 \(a whole number >= 0"),
    (dict(seed=True), "seed=True"),
    (dict(steps=2.5), r"steps=2.5 \(a whole number >= 1"),
    (dict(steps=0), "steps=0"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(eval_every=0), "eval_every=0"),
    (dict(eval_seqs=-2), "eval_seqs=-2"),
    (dict(variant="softmax2"), "variant='softmax2'"),
    (dict(norm="middle"), "norm='middle'"),
    (dict(style="t5"), "style='t5'"),
    (dict(init="xavier"), "init='xavier'"),
    (dict(task="copy"), "unknown task 'copy'"),
    (dict(task_options=[1]), "task_options=\\[1\\]"),
    (dict(task_options=dict(seq_len=0)), r"seq_len=0 \(a whole number >= 2"),
    (dict(task_options=dict(seq_len=8, n_values=0)), r"n_values=0 \(a whole number >= 1"),
    (dict(task_options=dict(seq_len=8, trigger_prob=2.0)), r"trigger_prob=2.0 \(a finite number in \[0, 1\]"),
    (dict(task_options=dict(seq_len=8, alpha=0.0)), r"alpha=0.0 \(a finite number > 0"),
    (dict(task_options=dict(seq_len=8, colour=1)), "bad option for task"),
    (dict(task="bigram_backcopy", task_options=dict(seq_len=8, n_vocab=0)), "n_vocab=0"),
    (dict(task="bigram_backcopy", task_options=dict(seq_len=8, language_seed=-1)), "language_seed=-1"),
    (dict(task="bigram_backcopy", task_options=dict(seq_len=8, n_triggers=0)), "n_triggers=0"),
]


def settings(**fields) -> TaskSettings:
    """Settings with ``fields`` set as a caller could hold them (the test suite's type checking of the
    constructor, and TaskSettings.of's and TrainConfig's own checks, left out: a user's Python has none);
    TrainConfig's knobs (TRAIN_KNOBS) are set on its ``train``."""
    out = TaskSettings.of("trigger_conditional", **{**TINY, "task_options": OPTIONS})
    for name, value in fields.items():
        object.__setattr__(out.train if name in TRAIN_KNOBS else out, name, value)
    return out


@pytest.mark.parametrize("fields, match", BAD, ids=[str(f) for f, _ in BAD])
def test_every_entry_refuses_a_bad_setting(fields, match, tmp_path):
    bad = settings(**fields)
    for entry in (check_settings, build_model, train_task):
        with pytest.raises(MassiveLensError, match=match):
            entry(bad)
    with pytest.raises(MassiveLensError, match=match):
        run_grid(tmp_path, [settings(), bad])
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_good_settings_pass_and_give_their_task():
    task = check_settings(settings(lr=1.0, beta2=0.0, warmup_steps=0, grad_clip=0.0, min_lr_ratio=1.0, seed=0))
    assert task == make_task("trigger_conditional", **OPTIONS)


def test_each_knob_is_defined_once_and_the_schedule_is_a_train_config():
    """TaskSettings holds its own fields and a TrainConfig, repeating none of TrainConfig's (issue 50)."""
    own, train = {f.name for f in fields(TaskSettings)}, {f.name for f in fields(TrainConfig)}
    assert not own & train and set(TRAIN_KNOBS) <= train
    s = TaskSettings.of("bigram_backcopy", steps=7, beta1=0.8, d_model=16)
    assert isinstance(s.train, TrainConfig) and (s.train.steps, s.train.beta1, s.d_model) == (7, 0.8, 16)
    assert replace(s.train, steps=TASK_TRAIN.steps, beta1=TASK_TRAIN.beta1) == TASK_TRAIN


def test_the_stored_form_round_trips_and_the_old_flat_form_still_reads():
    s = settings(lr=1e-3, seed=3, grad_clip=0.0, n_heads=4)
    stored = s.to_dict()
    assert stored["format"] == SETTINGS_FORMAT and set(stored["train"]) == set(TRAIN_KNOBS)
    assert not set(TRAIN_KNOBS) & (set(stored) - {"train"})
    assert TaskSettings.from_dict(stored) == s
    flat = {**{k: v for k, v in stored.items() if k not in ("format", "train")}, **stored["train"]}
    flat.pop("beta1")  # records before format 2 did not store it: AdamW's 0.9 then and now
    assert TaskSettings.from_dict(flat) == s


@pytest.mark.parametrize("stored, match", [
    (dict(task="trigger_conditional", format=3), "unknown settings format 3"),
    (dict(task="trigger_conditional", format=2, train=dict(data="x")), "a dict of"),
    (dict(task="trigger_conditional", colour=1), r"unknown fields \['colour'\]"),
    (dict(task="trigger_conditional", train=dict(steps=5)), r"unknown fields \['train'\]"),
    (dict(task="trigger_conditional", steps=0), r"steps=0 \(a whole number >= 1"),  # not TrainConfig's words
    (dict(task="trigger_conditional", lr=0.0), r"lr=0.0 \(a finite number > 0"),
    (dict(variant="softmax"), "naming a task"),
])
def test_bad_stored_settings_are_refused_naming_the_field(stored, match):
    with pytest.raises(MassiveLensError, match=match):
        TaskSettings.from_dict(stored)


def test_a_train_config_knob_a_task_run_does_not_read_is_refused():
    s = settings()
    with pytest.raises(MassiveLensError, match=r"train.data='x'.*a task run reads only seed"):
        check_settings(replace(s, train=replace(s.train, data="x")))
    object.__setattr__(s, "train", dict(steps=2))  # as a caller without type checking could
    with pytest.raises(MassiveLensError, match=r"train=\{'steps': 2\} \(a TrainConfig"):
        check_settings(s)
