"""The sink-task grid: both tasks x attention variants x norm placements x seeds, resumable.

Every run lives in ``<root>/<task>/<variant>-<norm>/seed<s>/`` (:mod:`massive_lens.train.taskrun`);
a run whose ``result.json`` exists is finished and skipped, so running the grid again resumes an
interrupted one. A finished run is read back first (:func:`massive_lens.train.taskrecord.read_run`): one
written with older definitions has its derived fields rewritten from its raw records, and one that is
damaged or holds other settings than the grid asks for stops the grid before anything trains. The
order puts seeds 0 and 1 of every setting before any seed 2+, so a partial
grid still pairs every setting with the baseline.

    massive-lens tasks run  --seeds 0,1,2,3,4                        # into runs/sinktasks (DEFAULT_ROOT)
    massive-lens tasks page --root docs/sinktasks/runs --page docs/sinktasks.md            # the docs' grid
    massive-lens tasks page --root docs/sinktasks/runs --page docs/sinktasks.md --check    # 1 if it differs

>>> [s.name for s in grid_settings(seeds=[0], tasks=["trigger_conditional"])][:3]
['softmax-pre', 'softmax1-pre', 'learned_sink-pre']
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from massive_lens.errors import MassiveLensError
from massive_lens.train.taskrecord import read_run, refresh_run, run_folder
from massive_lens.train.taskrun import RESULT, train_task
from massive_lens.train.tasksettings import TaskSettings, check_settings

log = logging.getLogger(__name__)

# (variant, norm): every variant with pre-norm, the baseline and softmax1 with post-norm too
SETTINGS = [("softmax", "pre"), ("softmax1", "pre"), ("learned_sink", "pre"), ("kv_bias", "pre"),
            ("gated", "pre"), ("relu", "pre"), ("vscale", "pre"), ("softmax", "post"), ("softmax1", "post")]
# each task's model and budget, sized so that a run takes 1-2 minutes on one CPU thread
TASK_SETTINGS: dict[str, dict[str, Any]] = {
    "trigger_conditional": dict(steps=300, n_layers=2, d_model=64, n_heads=4, eval_every=20,
                                task_options=dict(seq_len=32)),
    "bigram_backcopy": dict(steps=500, n_layers=2, d_model=64, n_heads=1, eval_every=25,
                            task_options=dict(seq_len=32)),
    # Guo et al.'s setting (their code's BBM/train_main.py and scripts/dynamics.sh): Tiny Shakespeare's
    # character chain, 256 tokens after BOS, a 1-layer model of width 256 with one head, LayerNorm,
    # learned positions, a 4x MLP; AdamW at a constant 3e-4, betas (0.9, 0.99), weight decay 1e-4, no
    # clipping; PyTorch's default init. Shortened for one CPU thread: batches of 32 sequences (theirs
    # 512), 300 steps (theirs 10,000)
    "bigram_backcopy_paper": dict(steps=300, n_layers=1, d_model=256, n_heads=1, eval_every=25, batch_size=32,
                                  lr=3e-4, warmup_steps=0, min_lr_ratio=1.0, beta2=0.99, weight_decay=1e-4,
                                  grad_clip=0.0, style="gpt2", init="torch"),
}
DEFAULT_ROOT = "runs/sinktasks"  # under the working folder, as the other commands' runs/...; never a docs folder


def grid_settings(seeds: Sequence[int] = (0, 1, 2, 3, 4), tasks: Sequence[str] = tuple(TASK_SETTINGS),
                  settings: Sequence[tuple[str, str]] = tuple(SETTINGS), **overrides: Any) -> list[TaskSettings]:
    """Every run of the grid, in running order: seeds 0-1 of every setting first, then each later seed.

    Args:
        seeds: the seeds of every setting.
        tasks: task names (:data:`~massive_lens.train.tasks.TASKS`).
        settings: ``(variant, norm)`` pairs.
        **overrides: :meth:`TaskSettings.of <massive_lens.train.tasksettings.TaskSettings.of>` knobs that
            replace those of every run (for small CI grids).

    Returns:
        One :class:`~massive_lens.train.tasksettings.TaskSettings` per run, in running order.
    """
    early, late = [s for s in seeds if s < 2], [s for s in seeds if s >= 2]
    runs = []
    for seed in [*early, *late]:
        for variant, norm in settings:
            for task in tasks:
                fields = {**TASK_SETTINGS.get(task, {}), **overrides}
                runs.append(TaskSettings.of(task, variant=variant, norm=norm, seed=seed, **fields))
    return runs


def check_root(root: str | Path) -> None:
    """Refuse a grid folder that is not a writable folder (made if missing), before anything trains."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MassiveLensError(f"cannot use {root} as the grid's folder ({type(exc).__name__}: {exc}); pass a "
                               "writable folder as --root") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise MassiveLensError(f"cannot write into {root}; pass a writable folder as --root")


def resume_check(root: str | Path, runs: Sequence[TaskSettings]) -> int:
    """Read back every finished run of ``runs``: refuse one that is damaged or holds other settings, rewrite
    the derived fields of a stale one from its raw records (never skip it as it is); the number rewritten."""
    rewritten = 0
    for settings in runs:
        folder = run_folder(root, settings)
        if not (folder / RESULT).exists():
            continue
        found = read_run(folder, stale="recompute").settings
        if found != settings:
            flat, asked = _flat(found), _flat(settings)
            other = {k: (v, asked.get(k)) for k, v in flat.items() if asked.get(k) != v}
            raise MassiveLensError(f"{folder} holds a finished run with other settings than the grid asks for "
                                   f"(stored, asked: {other}); use another --root, or delete it to retrain")
        if refresh_run(folder):
            rewritten += 1
            log.info("%s: derived fields rewritten from the raw records (stale definitions)", folder)
    return rewritten


def _flat(settings: TaskSettings) -> dict[str, Any]:
    stored = settings.to_dict()
    return {**{k: v for k, v in stored.items() if k not in ("format", "train")}, **stored["train"]}


def pending(root: str | Path, runs: Sequence[TaskSettings]) -> Iterator[TaskSettings]:
    """The runs without a ``result.json`` yet, in order."""
    return (s for s in runs if not (run_folder(root, s) / RESULT).is_file())


def run_grid(root: str | Path, runs: Sequence[TaskSettings], threads: int | None = 1) -> int:
    """Run every unfinished run of ``runs`` into ``root`` (finished runs, with a result file, are
    skipped, so an interrupted grid resumes); every run's settings are checked, and every finished run read
    back (:func:`resume_check`), before the first.

    Args:
        root: the grid's folder.
        runs: the runs, in running order (:func:`grid_settings`).
        threads: torch threads to train with (None: leave torch's setting).

    Returns:
        The number of runs trained by this call.

    Raises:
        MassiveLensError: for bad settings, an unusable ``root`` or ``threads``, or a finished run that
            cannot be resumed from (:func:`resume_check`).
    """
    for settings in runs:
        check_settings(settings)  # a typo fails now, not an hour in
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise MassiveLensError(f"threads must be a whole number >= 1 (or None: torch's setting), got {threads!r}")
    check_root(root)
    resume_check(root, runs)
    if threads:
        torch.set_num_threads(threads)
    done = 0
    for settings in pending(root, runs):
        t0 = time.perf_counter()
        train_task(settings, run_folder(root, settings))
        done += 1
        log.info("%s %s seed %d: %.0f s", settings.task, settings.name, settings.train.seed, time.perf_counter() - t0)
    return done
