"""Checkpoints of a training run, and what makes them safe to resume from.

A checkpoint is only useful if its step count matches the optimizer state it stores: a run
resumed from "step 14" whose weights already took step 15 trains step 15 twice and ends
elsewhere than the uninterrupted run. So the step a checkpoint is labelled with is read
from the optimizer itself (how many updates AdamW has applied), never from a loop counter
that a Ctrl-C can catch before it moves; a Ctrl-C that arrives inside ``optimizer.step()``
is held back until the update is whole (:func:`interrupt_after`).

A checkpoint is one safetensors file, ``checkpoint.safetensors``: the model's and the
optimizer's tensors, with the step, configuration, history, the per-step record (columns of
:data:`~massive_lens.train.recorder.STEP_COLUMNS`, ``per_step``) and the optimizer's plain values
as JSON in its metadata. Next to it, ``log.csv`` (the history) and ``steps.parquet`` (the per-step
record) are for reading. Nothing in it can run code when read (a pickle could). It is written
to a temporary name and renamed into place, so a checkpoint on disk is always a whole one; a
damaged one (truncated, or not a checkpoint) is a clear error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from massive_lens.errors import MassiveLensError

log = logging.getLogger(__name__)
CKPT = "checkpoint.safetensors"
LEGACY = "checkpoint.pt"  # the pickled format of older versions: refused, see convert_checkpoint
META_KEY = "massive_lens_checkpoint"
STEPS = "steps.parquet"  # the per-step record, next to the checkpoint (what the stability analysis reads)


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
    """The checkpoint's contents (model and optimizer state dicts, step, config, model_cfg,
    history); a damaged file is a :class:`MassiveLensError`.

    Only safetensors and JSON are read: a ``checkpoint.pt`` of an older massive_lens is a
    pickle, which can run code when read, so it is refused (see :func:`convert_checkpoint`).
    """
    path = Path(path)
    if path.suffix == ".pt" or (not path.exists() and (path.parent / LEGACY).is_file()):
        raise MassiveLensError(_legacy_message(path.parent))
    try:
        with safe_open(str(path), framework="pt", device=str(map_location)) as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "null"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own, OSError and JSON errors alike
        raise MassiveLensError(f"{path} is not a readable checkpoint ({type(exc).__name__}: "
                               f"{str(exc)[:120]}); delete it to start over, or use another out_dir") from exc
    keys = {"step", "config", "model_cfg", "history", "optimizer"}
    if not isinstance(meta, dict) or not keys <= set(meta):
        raise MassiveLensError(f"{path} is not a massive_lens training checkpoint (its metadata lacks "
                               f"{sorted(keys - set(meta) if isinstance(meta, dict) else keys)}); "
                               "delete it to start over, or use another out_dir")
    return {**meta, "model": {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")},
            "optimizer": _optimizer_from(meta["optimizer"], tensors, path)}


def save_checkpoint(out: Path, model: Any, optimizer: Any, config: dict, step: int, history: list,
                    per_step: list | None = None) -> None:
    """Write the checkpoint (one safetensors file: tensors, plus everything else as JSON in its
    metadata) and the logs to temporary files, then rename them into place. ``per_step``: the
    per-step rows (stored as columns; none for a run that did not record)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    optim = optimizer.state_dict()
    plain_state: dict[str, dict] = {}
    for index, entry in optim["state"].items():
        plain_state[str(index)] = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = value
            else:
                plain_state[str(index)][key] = value
    steps = pd.DataFrame(per_step or [])
    meta = dict(step=step, config=config, model_cfg=model.cfg.to_dict(), history=history,
                per_step={k: steps[k].tolist() for k in steps}, optimizer=dict(state=plain_state,
                                                                             param_groups=optim["param_groups"]))
    # a copy per tensor: safetensors refuses tensors that share memory (tied weights)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    _atomic(out / CKPT, lambda p: save_file(tensors, str(p), metadata={META_KEY: json.dumps(meta)}))
    _atomic(out / "log.csv", lambda p: pd.DataFrame(history).to_csv(p, index=False))
    if len(steps):
        _atomic(out / STEPS, lambda p: steps.to_parquet(p, index=False))
    summary = dict(config=config, step=step, last=history[-1] if history else None)
    _atomic(out / "run.json", lambda p: Path(p).write_text(json.dumps(summary, indent=1)))


def resume_from(path: Path, model: Any, optimizer: Any, config: dict, defaults: dict) -> tuple[int, list, list]:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer``; ``(step, history, per_step)``
    (``per_step`` is empty for a checkpoint written before runs recorded every step).

    ``config`` is the run's configuration as a dict and ``defaults`` the configuration's
    defaults (fields added since the checkpoint was written take them). A checkpoint made with
    another configuration (beyond ``steps``, and the device) is a :class:`MassiveLensError`.
    """
    state = read_checkpoint(path, map_location=next(model.parameters()).device)

    def key(train: dict, model_cfg: dict) -> tuple:
        rest = {k: v for k, v in train.items() if k not in ("steps", "model")}
        return rest, {k: v for k, v in model_cfg.items() if k != "device"}

    if key({**defaults, **state["config"]}, state["model_cfg"]) != key(config, model.cfg.to_dict()):
        raise MassiveLensError(f"the checkpoint in {path.parent} was made with another configuration; use a "
                               "new out_dir or resume=False")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    log.info("resuming from step %d (%s)", state["step"], path)
    columns = state.get("per_step") or {}
    return int(state["step"]), list(state["history"]), pd.DataFrame(columns).to_dict("records")


def save_interrupted(out: Path, model: Any, optimizer: Any, config: dict, start: int,
                     applied_at_start: int | None, history: list, per_step: list | None = None) -> None:
    """On Ctrl-C: save the state labelled with the updates the optimizer really applied
    (history rows of later steps than that are dropped); nothing when no update was applied
    since the start, or when an update stopped half-way (the last checkpoint stays)."""
    applied = updates_applied(optimizer)
    if applied is None or applied_at_start is None:
        log.warning("interrupted inside an optimizer update; keeping the last checkpoint in %s", out)
        return
    done = start + applied - applied_at_start
    if done > start:
        log.warning("interrupted after step %d; saving a checkpoint in %s", done, out)
        save_checkpoint(out, model, optimizer, config, done, [h for h in history if h["step"] <= done],
                        [r for r in per_step or [] if r["step"] <= done])


def convert_checkpoint(out_dir: str | os.PathLike) -> Path:
    """Rewrite an older run's pickled ``checkpoint.pt`` as ``checkpoint.safetensors``.

    Only for a file you trust: it is read with ``torch.load(weights_only=True)`` (torch's
    restricted unpickler, which builds tensors and plain containers and refuses anything else).

    Returns:
        The new checkpoint's path.

    Raises:
        MassiveLensError: if there is no ``checkpoint.pt`` or it holds more than tensors and
            plain values.
    """
    folder = Path(out_dir)
    legacy = folder / LEGACY
    if not legacy.is_file():
        raise MassiveLensError(f"no {LEGACY} in {folder} to convert")
    try:
        state = torch.load(legacy, map_location="cpu", weights_only=True)
        step, config, history = state["step"], state["config"], state["history"]

        class _Held:  # what save_checkpoint needs of a model and an optimizer
            cfg = SimpleNamespace(to_dict=lambda: state["model_cfg"])
            state_dict = staticmethod(lambda: state["model"])

        optim = SimpleNamespace(state_dict=lambda: state["optimizer"])
    except Exception as exc:  # noqa: BLE001 - the restricted unpickler raises many kinds
        raise MassiveLensError(f"{legacy} could not be converted ({type(exc).__name__}: {str(exc)[:160]}); "
                               "train again with a new out_dir") from exc
    save_checkpoint(folder, _Held(), optim, config, step, history)
    legacy.rename(legacy.with_name(LEGACY + ".converted"))
    return folder / CKPT


def _optimizer_from(meta: dict, tensors: dict[str, Tensor], path: Path) -> dict:
    """The optimizer's ``state_dict`` from the JSON part and the ``optim.<index>.<key>`` tensors."""
    state: dict[int, dict] = {int(i): dict(entry) for i, entry in meta.get("state", {}).items()}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    groups = meta.get("param_groups")
    if not isinstance(groups, list):
        raise MassiveLensError(f"{path} is not a massive_lens training checkpoint (no optimizer param_groups)")
    return {"state": state, "param_groups": groups}


def _legacy_message(folder: Path) -> str:
    return (f"{folder / LEGACY} is a pickled checkpoint from an older massive_lens; pickles can run code when "
            f"read, so it is not read. If you trust the file, convert it once with "
            f"massive_lens.train.checkpoint.convert_checkpoint({str(folder)!r}) (torch's weights-only loader), "
            "or delete it to start over")


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
