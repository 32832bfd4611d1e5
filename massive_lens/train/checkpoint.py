"""Checkpoints of a training run, and what makes them safe to resume from.

A checkpoint is only useful if its step count matches the optimizer state it stores: a run
resumed from "step 14" whose weights already took step 15 trains step 15 twice and ends
elsewhere than the uninterrupted run. So the step a checkpoint is labelled with is read
from the optimizer itself (how many updates AdamW has applied), never from a loop counter
that a Ctrl-C can catch before it moves; a Ctrl-C that arrives inside ``optimizer.step()``
is held back until the update is whole (:func:`interrupt_after`).

Files are written to a temporary name and renamed into place, so a checkpoint on disk is
always a whole one; a damaged one (truncated, or not a checkpoint) is a clear error.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from massive_lens.errors import MassiveLensError

CKPT = "checkpoint.pt"


def updates_applied(optimizer: torch.optim.Optimizer) -> int | None:
    """How many updates the optimizer has applied (its per-parameter ``step``), or None when
    its parameters disagree (an update stopped half-way: no consistent state to save).

    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.AdamW([p])
    >>> updates_applied(opt)
    0
    >>> p.sum().backward(); opt.step()
    >>> updates_applied(opt)
    1
    """
    counts = {int(state["step"]) for state in optimizer.state.values() if "step" in state}
    if len(counts) > 1:
        return None
    return counts.pop() if counts else 0


@contextlib.contextmanager
def interrupt_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block is done.

    Only the main thread receives signals; elsewhere (or where SIGINT is not Python's to
    handle) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def read_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """The checkpoint's contents; a damaged file is a :class:`MassiveLensError`."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - torch raises pickle, zip and runtime errors alike
        raise MassiveLensError(f"{path} is not a readable checkpoint ({type(exc).__name__}: "
                               f"{str(exc)[:120]}); delete it to start over, or use another out_dir") from exc
    keys = {"model", "optimizer", "step", "config", "model_cfg", "history"}
    if not isinstance(state, dict) or not keys <= set(state):
        raise MassiveLensError(f"{path} is not a massive_lens training checkpoint (it lacks "
                               f"{sorted(keys - set(state) if isinstance(state, dict) else keys)}); "
                               "delete it to start over, or use another out_dir")
    return state


def save_checkpoint(out: Path, model: Any, optimizer: Any, config: dict, step: int, history: list) -> None:
    """Write the checkpoint and logs to temporary files, then rename them into place."""
    out.mkdir(parents=True, exist_ok=True)
    state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                 config=config, model_cfg=model.cfg.to_dict(), history=history)
    _atomic(out / CKPT, lambda p: torch.save(state, p))
    _atomic(out / "log.csv", lambda p: pd.DataFrame(history).to_csv(p, index=False))
    summary = dict(config=config, step=step, last=history[-1] if history else None)
    _atomic(out / "run.json", lambda p: Path(p).write_text(json.dumps(summary, indent=1)))


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
