"""The off-switch protocol on the sink-forcing task runs: does a trained ``softmax1`` or
``learned_sink`` model put its "do nothing" attention on the sink slot, or on the first token?

The saved runs (``docs/sinktasks/runs/<task>/<variant>-<norm>/seed<s>/``) keep their records, not
their weights. :func:`offswitch_task_runs` retrains each chosen run from its ``result.json``
settings (same seed: same batches), runs :func:`~massive_lens.handover.offswitch.offswitch` on the
held-out batch and checks, from its table (``first_head_max``), that the retrained model reproduces the
run's recorded largest first-token mass (``reproduced``: the difference). With ``cache`` the
retrained weights are kept there as safetensors (``<cache>/<task>/<setting>/seed<s>/model.safetensors``)
and read back on the next call.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file, save_file

from massive_lens.core.model_lock import model_lock
from massive_lens.errors import MassiveLensError
from massive_lens.handover.offswitch import offswitch
from massive_lens.train.taskrun import RESULT, build_model, train_task
from massive_lens.train.tasksettings import TaskSettings, check_settings

log = logging.getLogger(__name__)
VARIANTS = ("softmax", "softmax1", "learned_sink", "kv_bias", "gated")
COLUMNS = ["task", "setting", "seed", "kind", "idle", "null_max", "first_max", "gate_shut_max", "residual",
           "resid_top1_share", "float16", "reproduced"]


def offswitch_task_runs(root: str | Path, *, variants: Sequence[str] = VARIANTS, norm: str = "pre",
                        seeds: Sequence[int] | None = None, cache: str | Path | None = None) -> pd.DataFrame:
    """One row per run (:data:`COLUMNS`): where its idle attention goes (``idle``), the largest
    null mass and first-token mass of a head (queries after the first token, the held-out batch),
    the largest share of shut gates, what the residual peak is, the float16 verdict, and how far the
    retrained model's largest first-token mass is from the recorded one (``reproduced``).

    Args:
        root: a task's run folder (``docs/sinktasks/runs/trigger_conditional``).
        variants: the settings' attention variants (default :data:`VARIANTS`).
        norm: the norm placement (``"pre"`` or ``"post"``).
        seeds: the seeds (None: every finished one).
        cache: a folder for the retrained weights (None: retrain every time).

    Returns:
        A DataFrame, one row per run.

    Raises:
        MassiveLensError: if ``root`` holds none of the chosen runs.
    """
    root = Path(root)
    rows = []
    for variant in variants:
        folder = root / f"{variant}-{norm}"
        found = sorted(folder.glob(f"seed*/{RESULT}"), key=lambda p: int(p.parent.name[4:]))
        for path in found:
            stored = json.loads(path.read_text())
            settings = TaskSettings.from_dict(stored["settings"])  # either settings format
            if seeds is not None and settings.train.seed not in seeds:
                continue
            rows.append(_one(settings, stored, cache))
    if not rows:
        raise MassiveLensError(f"{root} holds no finished run of {', '.join(variants)} ({norm}-norm)"
                               f"{'' if seeds is None else f' with seeds {list(seeds)}'}")
    return pd.DataFrame(rows, columns=COLUMNS)


def _one(settings: TaskSettings, stored: dict, cache: str | Path | None) -> dict:
    task = check_settings(settings)
    where = None if cache is None else Path(cache) / settings.task / settings.name / f"seed{settings.train.seed}"
    weights = None if where is None else where / "model.safetensors"
    if weights is not None and weights.exists():
        model = build_model(settings)
        with model_lock(model):  # the model just built: no one else holds it yet
            model.load_state_dict(load_file(str(weights)))
        model.eval()
    else:
        log.info("retraining %s %s seed %d", settings.task, settings.name, settings.train.seed)
        model = train_task(settings).model
        if weights is not None:
            weights.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(weights))
    tokens = task.sample(settings.eval_seqs, seed=-1, step=0).tokens
    result = offswitch(model, tokens)
    frame = result.to_frame()
    # the runs' recorded sink_mass: the largest over layers and heads of queries 1..'s mean attention to the
    # first token, as the protocol's one attention pass read it (the held-out batch has no padding)
    first_max = float(frame["first_head_max"].max())
    return dict(task=settings.task, setting=settings.name, seed=settings.train.seed, kind=result.kind or "none",
                idle=result.idle, null_max=float(frame["null_head_max"].max()), first_max=first_max,
                gate_shut_max=float(frame["gate_shut"].max()), residual=result.residual,
                resid_top1_share=float(frame.loc[frame["peak"].idxmax(), "top1_share"]), float16=result.float16,
                reproduced=abs(first_max - float(stored["sink_mass"])))


def where_table(frame: pd.DataFrame) -> str:
    """The sink-task page's row per setting: seeds, where idle attention goes (counts), and the
    largest null and first-token mass of a head (mean and range over seeds), as Markdown.

    Args:
        frame: :func:`offswitch_task_runs`' table, a row per run.

    Returns:
        A Markdown table, a row per setting.
    """
    lines = ["| setting | seeds | idle attention goes to | largest null mass of a head | largest first-token mass "
             "of a head | largest share of shut gates | residual peak | float16 | retrained vs recorded |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, g in frame.groupby("setting", sort=False):
        counts = ", ".join(f"{k} {v}/{len(g)}" for k, v in g["idle"].value_counts().items())
        resid = ", ".join(f"{k} {v}/{len(g)}" for k, v in g["residual"].value_counts().items())
        f16 = ", ".join(f"{k} {v}/{len(g)}" for k, v in g["float16"].value_counts().items())
        lines.append(f"| {setting} | {len(g)} | {counts} | {_spread(g['null_max'])} | {_spread(g['first_max'])} | "
                     f"{_spread(g['gate_shut_max'])} | {resid} | {f16} | {g['reproduced'].max():.1e} |")
    return "\n".join(lines)


def _spread(values: pd.Series) -> str:
    """``mean [min, max]`` over seeds, or ``–`` where the setting has no such quantity."""
    if values.isna().all():
        return "–"
    return f"{values.mean():.3f} [{values.min():.3f}, {values.max():.3f}]"
