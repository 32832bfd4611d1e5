"""A sink-task run folder read back: raw records are the truth, stored summaries a checked cache.

A run folder ``<root>/<task>/<variant>-<norm>/seed<s>/`` (:mod:`massive_lens.train.taskrun`) holds

* raw records: ``evals.parquet`` (per evaluation step: loss, accuracies, residual ratios),
  ``heads.parquet`` (per step, layer and head) and, in ``result.json``, the end-of-run measurements
  (the W8A8 / W4A4 gaps), ``seconds`` and ``settings``;
* derived fields, written for convenience: the evaluation columns read off the heads
  (:data:`~massive_lens.train.taskrun.DERIVED_EVALS`), and in ``result.json`` the last evaluation's
  values, ``sink_step`` and ``definitions``, the
  :data:`~massive_lens.train.taskrun.DEFINITIONS_VERSION` they were computed with.

:func:`read_run` recomputes every derived field from the raw records with the current definitions and
checks the stored ones against them. A record written with older definitions (or before records carried
one) is *stale*: its derived fields are recomputed (``stale="recompute"``, logged) or it is refused
(``stale="refuse"``). A record that claims the current definitions but disagrees with its own raw records
was edited or pieced together, and is always refused. :func:`refresh_run` rewrites a folder's derived
fields from its raw records. :func:`read_runs` reads a grid: only ``seed<int>`` folders, each of which must
sit where its settings put it, never two holding the same (task, setting, seed).

    python -m massive_lens.train.taskcli refresh --root docs/sinktasks/runs   # rewrite stale records
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from massive_lens.core.store import read_json
from massive_lens.errors import MassiveLensError
from massive_lens.train.taskrun import (
    DEFINITIONS_VERSION,
    DERIVED_EVALS,
    RESULT,
    derive_evals,
    derived_fields,
)
from massive_lens.train.tasksettings import TaskSettings, check_settings

log = logging.getLogger(__name__)
MAX_RESULT_BYTES = 1 << 20  # a result.json is about 1 kB
MAX_PARQUET_BYTES = 256 << 20  # the largest evals / heads record read (the grid's are kilobytes)
EVALS, HEADS = "evals.parquet", "heads.parquet"
RAW_EVALS = ("step", "loss", "accuracy", "resid_ratio", "resid_norm_ratio")
RAW_HEADS = ("step", "layer", "head", "sink_mass", "max_logit", "value_ratio")
RAW_RESULT = ("w8a8_gap", "w8a8_acc_gap", "w4a4_gap", "w4a4_acc_gap", "seconds")
SEED_FOLDER = re.compile(r"seed(\d+)")
STALE = ("recompute", "refuse")
REFRESH = "python -m massive_lens.train.taskcli refresh --root {root}"


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One finished run as read back: ``evals`` and ``result`` hold the derived fields recomputed from the
    raw records (``result`` without ``settings``); ``stale`` names the stored derived fields that
    disagreed (empty when the record is current); ``version`` is the definitions it was written with."""

    folder: Path
    settings: TaskSettings
    evals: pd.DataFrame
    heads: pd.DataFrame
    result: dict[str, Any]
    stale: tuple[str, ...]
    version: int


def run_folder(root: str | Path, settings: TaskSettings) -> Path:
    """Where one run's records go.

    Args:
        root: the grid's folder.
        settings: the run.

    Returns:
        ``<root>/<task>/<variant>-<norm>/seed<s>``.
    """
    return Path(root) / settings.task / settings.name / f"seed{settings.train.seed}"


def read_run(folder: str | Path, *, stale: str = "recompute") -> RunRecord:
    """One finished run folder, its derived fields recomputed from its raw records and checked.

    Args:
        folder: the run's folder (``result.json``, ``evals.parquet``, ``heads.parquet``).
        stale: what to do with a record written with older definitions: ``"recompute"`` its derived
            fields (logged) or ``"refuse"`` it.

    Returns:
        A :class:`RunRecord`.

    Raises:
        MassiveLensError: for a missing, damaged or oversized file, settings that are not a run's, a
            record whose stored derived fields disagree with its raw records under the current
            definitions, a record from newer definitions, or (``stale="refuse"``) a stale record.
    """
    return _read(Path(folder), stale, edited_ok=False)


def _read(folder: Path, stale: str, edited_ok: bool) -> RunRecord:
    if stale not in STALE:
        raise MassiveLensError(f"stale must be one of {', '.join(STALE)}, got {stale!r}")
    fix = "delete the run folder and run the grid again to retrain it"
    stored = read_json(folder / RESULT, max_bytes=MAX_RESULT_BYTES, what="a sink-task result.json", fix=fix)
    settings = _settings(stored, folder, fix)
    evals = _read_parquet(folder / EVALS, RAW_EVALS + DERIVED_EVALS, fix)
    heads = _read_parquet(folder / HEADS, RAW_HEADS, fix)
    _check_raw(folder, settings, evals, heads, fix)
    version = stored.get("definitions", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise MassiveLensError(f"{folder / RESULT}: \"definitions\" must be a whole number, got {version!r}; {fix}")
    if version > DEFINITIONS_VERSION:
        raise MassiveLensError(f"{folder} was written with definitions version {version}, newer than this "
                               f"massive_lens's {DEFINITIONS_VERSION}: upgrade massive_lens to read it")
    fresh = derive_evals(evals, heads)
    derived = derived_fields(fresh)
    differ = [f"{EVALS}:{c}" for c in DERIVED_EVALS if not _same(evals[c].tolist(), fresh[c].tolist())]
    differ += [k for k in derived if k != "definitions" and not _same(stored.get(k), derived[k])]
    if differ and version == DEFINITIONS_VERSION and not edited_ok:
        raise MassiveLensError(f"{folder}: its stored derived fields disagree with its own raw records under the "
                               f"definitions it claims (version {version}): {_diff(differ, stored, derived)}. The "
                               f"record was edited or pieced together from different runs; rewrite them from the "
                               f"raw records ({REFRESH.format(root='ROOT')}) or {fix}")
    if version < DEFINITIONS_VERSION and stale == "refuse":
        what = f"stale fields: {_diff(differ, stored, derived)}" if differ else "no field differs yet"
        raise MassiveLensError(f"{folder} was written with definitions version {version}, not the current "
                               f"{DEFINITIONS_VERSION} ({what}); recompute its derived fields from the raw "
                               f"records: {REFRESH.format(root='ROOT')}")
    if differ:
        log.warning("%s: stale derived fields recomputed from the raw records (definitions %d, now %d): %s",
                    folder, version, DEFINITIONS_VERSION, _diff(differ, stored, derived))
    raw = {k: stored[k] for k in RAW_RESULT}
    return RunRecord(folder=folder, settings=settings, evals=fresh, heads=heads, result={**derived, **raw},
                     stale=tuple(differ), version=version)


def read_runs(root: str | Path, *, stale: str = "recompute") -> list[RunRecord]:
    """Every finished run of a grid (folders holding ``result.json``), each read with :func:`read_run`.

    Only ``<task>/<setting>/seed<int>`` folders are runs: others (a ``seed1.bak`` copy) are skipped with a
    warning. A run must sit where its settings put it (:func:`run_folder`), so no two folders hold the
    same (task, setting, seed).

    Args:
        root: the grid's folder.
        stale: as in :func:`read_run`.

    Returns:
        The runs, in folder order.

    Raises:
        MassiveLensError: if ``root`` is not a folder, a run sits elsewhere than its settings say, two
            folders hold one run, or a run cannot be read (:func:`read_run`).
    """
    root = Path(root)
    if not root.is_dir():
        state = "does not exist" if not root.exists() else "is not a folder"
        raise MassiveLensError(f"no sink-task runs at {root}: it {state}; pass the --root the grid ran into")
    records: dict[tuple[str, str, int], RunRecord] = {}
    skipped = []
    for folder in sorted(p for p in root.glob("*/*/*") if p.is_dir()):
        if not (folder / RESULT).exists():
            continue  # still training, or never started
        if not SEED_FOLDER.fullmatch(folder.name):
            skipped.append(folder.relative_to(root).as_posix())
            continue
        record = read_run(folder, stale=stale)
        s, expected = record.settings, run_folder(root, record.settings)
        if folder != expected:
            raise MassiveLensError(f"{folder} holds the run of {s.task} {s.name} seed {s.train.seed}, which belongs in "
                                   f"{expected}: a moved or copied run folder would count twice or under another "
                                   "seed; move it back or delete it")
        key = (s.task, s.name, s.train.seed)
        if key in records:  # unreachable while folders sit where they belong: kept as the rule's guard
            raise MassiveLensError(f"{records[key].folder} and {folder} hold the same run "
                                   f"({', '.join(map(str, key))}); delete the copy")
        records[key] = record
    if skipped:
        log.warning("%s: skipped %d folder(s) that are not seed<int> run folders (copies?): %s", root, len(skipped),
                    ", ".join(skipped))
    return list(records.values())


def refresh_run(folder: str | Path) -> bool:
    """Rewrite a run folder's derived fields (``result.json``'s and ``evals.parquet``'s) from its raw
    records with the current definitions; True if anything changed."""
    folder = Path(folder)
    record = _read(folder, "recompute", edited_ok=True)
    if not record.stale and record.version == DEFINITIONS_VERSION:
        return False
    stored = read_json(folder / RESULT, max_bytes=MAX_RESULT_BYTES, what="a sink-task result.json", fix="")
    if any(c.startswith(EVALS) for c in record.stale):
        _replace(folder / EVALS, lambda p: record.evals.to_parquet(p, index=False))
    new = {**record.result, **{k: v for k, v in stored.items() if k not in record.result and k != "settings"},
           "settings": stored["settings"]}
    _replace(folder / RESULT, lambda p: Path(p).write_text(json.dumps(new, indent=1, default=float)))
    return True


def refresh_runs(root: str | Path) -> int:
    """:func:`refresh_run` on every run of ``root`` (:func:`read_runs`); the number rewritten."""
    return sum(refresh_run(r.folder) for r in read_runs(root, stale="recompute"))


def _replace(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _settings(stored: Any, folder: Path, fix: str) -> TaskSettings:
    raw = stored.get("settings") if isinstance(stored, dict) else None
    if not isinstance(raw, dict):
        raise MassiveLensError(f"{folder / RESULT} is not a sink-task result: it holds no \"settings\" object; {fix}")
    if "task" not in raw:
        raise MassiveLensError(f"{folder / RESULT}: its settings name no task; {fix}")
    missing = [k for k in RAW_RESULT if not isinstance(stored.get(k), (int, float)) or isinstance(stored[k], bool)]
    if missing:
        raise MassiveLensError(f"{folder / RESULT} lacks the end-of-run measurements {missing}; {fix}")
    try:
        settings = TaskSettings.from_dict(raw)  # either settings format (SETTINGS_FORMAT)
        check_settings(settings)
    except MassiveLensError as exc:
        raise MassiveLensError(f"{folder / RESULT}: {exc}; {fix}") from exc
    return settings


def _read_parquet(path: Path, needed: tuple[str, ...], fix: str) -> pd.DataFrame:
    if not path.is_file():
        raise MassiveLensError(f"{path.parent} is a damaged run: result.json without {path.name}; {fix}")
    if path.stat().st_size > MAX_PARQUET_BYTES:
        raise MassiveLensError(f"{path}: {path.stat().st_size:,} bytes, more than a run's record can be "
                               f"({MAX_PARQUET_BYTES:,}); {fix}")
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors share no base class with ours: say which file
        raise MassiveLensError(f"{path} is not a readable record ({type(exc).__name__}: {str(exc)[:120]}); "
                               f"{fix}") from exc
    bad = [c for c in needed if c not in frame or not pd.api.types.is_numeric_dtype(frame[c])]
    if bad or frame.empty:
        raise MassiveLensError(f"{path} is not a sink-task record: " + (f"no numeric columns {bad}" if bad else
                               "it has no rows") + f"; {fix}")
    return frame


def _check_raw(folder: Path, s: TaskSettings, evals: pd.DataFrame, heads: pd.DataFrame, fix: str) -> None:
    """The raw records are one whole run: evaluation steps unique, ending at the run's last step, each with
    one row per (layer, head) of the settings' model."""
    steps = evals["step"].tolist()
    per_step = heads.groupby("step").size()
    problem = None
    if len(set(steps)) != len(steps) or steps[-1] != s.train.steps or steps != sorted(steps):
        problem = f"its evaluation steps {steps[:3]}...{steps[-1:]} are not a finished run of {s.train.steps} steps"
    elif set(per_step.index) != set(steps) or (per_step != s.n_layers * s.n_heads).any():
        problem = f"heads.parquet does not hold {s.n_layers * s.n_heads} heads at each evaluation step"
    if problem:
        raise MassiveLensError(f"{folder} is a damaged run: {problem}; {fix}")


def _same(a: Any, b: Any) -> bool:
    """Equal values (lists elementwise), NaN equal to NaN."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _diff(names: list[str], stored: dict, derived: dict) -> str:
    return "; ".join(f"{k} stored {stored.get(k, 'nothing')!r}, recomputed {derived[k]!r}" if k in derived
                     else f"the {k} column" for k in names)
