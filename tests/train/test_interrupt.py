"""Ctrl-C at every point of a training step: the checkpoint it leaves is labelled with the
updates the optimizer really applied, and the run resumed from it ends bit-identical to an
uninterrupted one (issue #12: a Ctrl-C after ``optimizer.step()`` but before the counter moved
saved a checkpoint one step early, and the resumed run ended elsewhere)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from helpers import TRAIN_TEXT
from safetensors.torch import save_file

from massive_lens.errors import MassiveLensError
from massive_lens.train import checkpoint, loop, trainer
from massive_lens.train.model import MassiveLM
from massive_lens.train.trainer import load_run, train_model

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

CFG = dict(model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16), data=TRAIN_TEXT, batch_size=4, steps=6,
           warmup_steps=2, log_every=1, eval_every=2, eval_batches=1, ckpt_every=2)


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Python's own Ctrl-C handler, as in a terminal: a shell starts background jobs with SIGINT
    ignored, and the interrupt tests would then see no KeyboardInterrupt at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def straight() -> dict[str, torch.Tensor]:
    return train_model("smoke", progress=False, **CFG).model.state_dict()


def _tripwire(kind: str, at_call: int) -> Any:
    """A callback that interrupts on its ``at_call``-th call: by raising KeyboardInterrupt, or
    as a real Ctrl-C (SIGINT to this process, raised wherever Python next checks signals)."""
    calls = [0]

    def trip(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == at_call:
            if kind == "raise":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)

    return trip


def _wrap(monkeypatch, owner: Any, name: str, trip: Any, after: bool = False) -> None:
    real = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not after:
            trip()
        out = real(*args, **kwargs)
        if after:
            trip()
        return out

    monkeypatch.setattr(owner, name, wrapped)


def _optimizer_hook(monkeypatch, trip: Any, post: bool) -> None:
    real = trainer.make_optimizer

    def make(model: Any, cfg: Any) -> Any:
        optimizer = real(model, cfg)
        register = optimizer.register_step_post_hook if post else optimizer.register_step_pre_hook
        register(lambda *args: trip())
        return optimizer

    monkeypatch.setattr(trainer, "make_optimizer", make)


class _Bar(trainer.tqdm):
    trip: Any = None

    def update(self, n: float = 1) -> Any:
        out = super().update(n)
        type(self).trip()
        return out


# Where in step 3 (0-based) the interrupt lands: (name, how to install the tripwire at call k)
POINTS = {
    "sampling the batch": lambda mp, trip: _wrap(mp, loop, "sample_batch", trip),
    "forward pass": lambda mp, trip: _wrap(mp, MassiveLM, "forward", trip),
    "gradient clipping": lambda mp, trip: _wrap(mp, torch.nn.utils, "clip_grad_norm_", trip, after=True),
    "inside optimizer.step, before the update": lambda mp, trip: _optimizer_hook(mp, trip, post=False),
    "inside optimizer.step, after the update": lambda mp, trip: _optimizer_hook(mp, trip, post=True),
    "progress bar": lambda mp, trip: (setattr(_Bar, "trip", staticmethod(trip)), mp.setattr(trainer, "tqdm", _Bar)),
    "logging (lr_at for the history row)": lambda mp, trip: _wrap(mp, loop, "lr_at", trip),
    "evaluation": lambda mp, trip: _wrap(mp, loop, "evaluate_held_out", trip),
    "periodic checkpoint": lambda mp, trip: _wrap(mp, trainer, "save_checkpoint", trip),
}
# the call of each tripwire that falls in step 3: once per step; the forward pass also runs in
# evaluations (steps 2); lr_at twice per step; evaluation and checkpoints every 2nd step
AT_CALL = {"forward pass": 6, "logging (lr_at for the history row)": 8, "evaluation": 2, "periodic checkpoint": 2}


@pytest.mark.parametrize("kind", ["raise", "signal"])
@pytest.mark.parametrize("point", list(POINTS))
def test_ctrl_c_anywhere_in_a_step_leaves_a_checkpoint_that_resumes_exactly(tmp_path, monkeypatch, straight,
                                                                            point, kind):
    with monkeypatch.context() as mp:
        POINTS[point](mp, _tripwire(kind, AT_CALL.get(point, 4)))
        with pytest.raises(KeyboardInterrupt):
            train_model("smoke", out_dir=tmp_path, progress=point == "progress bar", **CFG)
    state = checkpoint.read_checkpoint(tmp_path / checkpoint.CKPT)
    optimizer_steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert optimizer_steps == {state["step"]}, (point, state["step"], optimizer_steps)
    assert all(row["step"] <= state["step"] for row in state["history"])
    resumed = train_model("smoke", out_dir=tmp_path, progress=False, **CFG)
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, straight[name]), (point, name)


def test_an_update_stopped_half_way_keeps_the_last_checkpoint(tmp_path):
    """Parameters that disagree on their step count: no consistent state, nothing saved."""
    param_a, param_b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param_a, param_b])
    (param_a.sum() + param_b.sum()).backward()
    optimizer.step()
    optimizer.state[param_b]["step"] += 1
    assert checkpoint.updates_applied(optimizer) is None


@pytest.mark.parametrize("content", [b"garbage" * 10, b"", "truncated"])
def test_a_damaged_checkpoint_is_a_clear_error(tmp_path, content):
    train_model("smoke", out_dir=tmp_path, progress=False, **{**CFG, "steps": 2})
    path = tmp_path / checkpoint.CKPT
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content == "truncated" else content)
    with pytest.raises(MassiveLensError, match="not a readable checkpoint"):
        load_run(tmp_path)
    with pytest.raises(MassiveLensError, match="not a readable checkpoint"):
        train_model("smoke", out_dir=tmp_path, progress=False, **{**CFG, "steps": 3})


def test_a_safetensors_file_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    save_file({"weights": torch.zeros(2)}, str(tmp_path / checkpoint.CKPT))
    with pytest.raises(MassiveLensError, match="not a massive_lens training checkpoint"):
        load_run(tmp_path)
