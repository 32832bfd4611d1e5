"""A folder of training runs' per-step records read back, checked (what :func:`~massive_lens.train.training_stability`
reads from a folder).

Every ``steps.parquet`` under the folder (:data:`~massive_lens.train.checkpoint.STEPS`, written by
:func:`~massive_lens.train.train_model`) is one run, labelled by its folder; its variant and seed come from
the ``run.json`` beside it. So that no run is counted twice or under another name:

* a ``steps.parquet`` without its ``run.json`` is refused (its variant and seed are unknown, and guessing
  ``softmax`` / seed 0 would put it among the wrong runs);
* two folders whose ``run.json`` holds the same configuration are one run copied (a backup, a rerun of the
  same settings) and are refused: counted twice, one seed would become two;
* a ``steps.parquet`` that carries its own ``run``, ``variant`` or ``seed`` column (a saved frame of several
  runs, not a training record) is refused unless those columns agree with its ``run.json``, when they are
  dropped;
* the derived column ``act_ratio`` is recomputed from ``max_act`` and ``median_act`` with the recorder's
  definition (:mod:`massive_lens.train.recorder`); a stored value that differs is logged, never used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from massive_lens.core.store import read_json
from massive_lens.errors import MassiveLensError
from massive_lens.train.checkpoint import STEPS

log = logging.getLogger(__name__)
KEYS = ("run", "variant", "seed")  # ``run`` tells runs apart; variant and seed describe them
NEEDED = ("step", "loss", "grad_norm")  # the per-step columns spikes are found in
MAX_RUN_JSON = 64 << 20  # bytes: a run.json is kilobytes (more only when its config holds the text)
RUN_JSON = "run.json"


def read_step_folder(folder: Path) -> pd.DataFrame:
    """Every run's per-step record under ``folder``, with ``run`` (the run's folder relative to ``folder``),
    ``variant`` and ``seed`` first (module docstring for the checks).

    Raises:
        MassiveLensError: for a missing folder, a record without ``run.json``, two copies of one run, a
            damaged or foreign record, or key columns that disagree with ``run.json``.
    """
    if not folder.is_dir():
        raise MassiveLensError(f"{folder} is not a folder of training runs")
    frames, configs = [], {}
    for path in sorted(folder.rglob(STEPS)):
        label = path.parent.relative_to(folder).as_posix()
        config, variant, seed = run_config(path.parent / RUN_JSON)
        key = json.dumps(config, sort_keys=True)
        if key in configs:
            raise MassiveLensError(f"{folder / configs[key]} and {path.parent} hold the same run (their run.json "
                                   f"configurations are identical: {variant}, seed {seed}): counting both would count "
                                   "one seed twice; delete the copy or move it out of the folder")
        configs[key] = label
        frame = read_steps(path, variant, seed)
        frames.append(frame.assign(run=label, variant=variant, seed=seed)[[*KEYS, *frame.columns]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def read_steps(path: Path, variant: str, seed: int) -> pd.DataFrame:
    """One run's ``steps.parquet``, checked: readable, with numeric ``step``, ``loss`` and ``grad_norm``, key
    columns (if any) equal to its ``run.json``'s and dropped, ``act_ratio`` recomputed."""
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors share no base class with ours: say which file
        raise MassiveLensError(f"{path} is not a readable per-step record ({type(exc).__name__}: {exc}); "
                               "delete it, or re-run the training with record=True to write it again") from exc
    missing = [c for c in NEEDED if c not in frame]
    wrong = [c for c in NEEDED if c in frame and not pd.api.types.is_numeric_dtype(frame[c])]
    if missing or wrong:
        raise MassiveLensError(f"{path} is not a per-step record of massive_lens.train: "
                               + (f"it lacks the columns {missing}" if missing else f"the columns {wrong} are not "
                                  "numbers") + "; delete it, or re-run the training to write it again")
    own = {"variant": variant, "seed": seed}
    clash = {c: sorted(map(str, frame[c].unique()))[:4] for c in KEYS if c in frame and
             (c == "run" or (frame[c] != own[c]).any())}
    if clash:
        raise MassiveLensError(f"{path} carries its own {sorted(clash)} column(s) ({clash}) that its run.json "
                               f"({variant}, seed {seed}) does not match: a training record never has them, so this "
                               "looks like a saved frame of several runs; pass that frame to training_stability "
                               "itself, or drop those columns from the file")
    frame = frame.drop(columns=[c for c in KEYS if c in frame])
    if {"max_act", "median_act"} <= set(frame):
        ratio = frame["max_act"] / frame["median_act"].clip(lower=1e-12)  # the recorder's act_ratio
        stored = frame.get("act_ratio")
        if stored is not None and not np.allclose(stored, ratio, rtol=1e-12, atol=0, equal_nan=True):
            log.warning("%s: act_ratio differs from max_act / median_act at %d steps; recomputed", path,
                        int((~np.isclose(stored, ratio, rtol=1e-12, atol=0, equal_nan=True)).sum()))
        frame = frame.assign(act_ratio=ratio)
    return frame


def run_config(path: Path) -> tuple[dict, str, int]:
    """The configuration, variant and seed in a run's ``run.json`` (required)."""
    if not path.is_file() and not path.exists():
        raise MassiveLensError(f"{path.parent} has a {STEPS} but no {RUN_JSON}, so its variant and seed are unknown "
                               f"(it is not read as softmax / seed 0); restore its {RUN_JSON} or move the folder out")
    problem = f"{path} is not a run.json written by massive_lens.train"
    data = read_json(path, max_bytes=MAX_RUN_JSON, what="a run.json", fix="delete or replace it")
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise MassiveLensError(f"{problem}: it holds no \"config\" object; delete or replace it")
    model = config.get("model", {})
    attention = model.get("attention", "softmax") if isinstance(model, dict) else None
    attention = attention.get("name", "softmax") if isinstance(attention, dict) else attention
    seed = config.get("seed", 0)
    if not isinstance(attention, str) or isinstance(seed, bool) or not isinstance(seed, int):
        raise MassiveLensError(f"{problem}: its config needs an attention name and an integer seed, got "
                               f"attention={attention!r}, seed={seed!r}; delete or replace it")
    return config, attention, seed
