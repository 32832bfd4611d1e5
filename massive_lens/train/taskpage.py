"""The answer page of the sink-task grid (``docs/sinktasks.md``), generated from its run folders.

Every finished run (``result.json`` and ``evals.parquet`` under ``<root>/<task>/<setting>/seed<s>/``,
see :mod:`massive_lens.train.taskgrid`) gives one row of end values per (task, setting, seed); the
evaluation steps give the curves. Every derived value (the end values, ``sink_step`` on the package's sink
threshold :data:`massive_lens.core.criterion.SINK_THRESHOLD`, the largest head's columns) is recomputed
from the raw records (:mod:`massive_lens.train.taskrecord`); stored summaries are only checked.

Intervals are 95% Student-t intervals over seeds (:func:`massive_lens.core.stats.t_interval`).
A difference between two settings is paired by seed (one seed: the same initial weights where the
shapes agree, and the same batches) and is *shown* only when at least two seeds have both runs and
its interval excludes zero; otherwise the page says *not shown*. The page's generated text sits
between ``<!-- gen:NAME -->`` and ``<!-- /gen:NAME -->``; :func:`write_page` rewrites it (and the
figure) or, with ``check``, says whether the page differs from the folders. A partial grid works:
every statement says how many seeds it rests on.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from massive_lens.core.criterion import SINK_THRESHOLD
from massive_lens.core.render import close_figure, new_figure, save_figure
from massive_lens.core.stats import t_interval
from massive_lens.errors import MassiveLensError
from massive_lens.train.taskgrid import SETTINGS, TASK_SETTINGS
from massive_lens.train.taskrecord import read_runs

BASE = "softmax-pre"
ORDER = [f"{v}-{n}" for v, n in SETTINGS]
# (column, what it is): the end values each comparison reads
QUANTITIES = [("sink_mass", "sink mass"), ("accuracy", "accuracy"), ("resid_ratio", "resid top-1/median"),
              ("resid_norm_ratio", "resid norm ratio"), ("value_ratio", "value-norm ratio"),
              ("max_logit", "max logit"), ("w8a8_gap", "W8A8 gap"), ("w4a4_gap", "W4A4 gap")]
DECOUPLERS = [("post-norm vs pre-norm (softmax)", "softmax-post", "softmax-pre"),
              ("post-norm vs pre-norm (softmax1)", "softmax1-post", "softmax1-pre"),
              ("softmax1 vs softmax (post-norm)", "softmax1-post", "softmax-post"),
              ("vscale vs softmax (pre-norm)", "vscale-pre", "softmax-pre")]
FIGURE = "curves"


def load_runs(root: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(ends, curves)``: one row per finished run (task, setting, seed, end values, ``sink_step``,
    ``seconds``) and one per evaluation step of each (task, setting, seed, step, the step's record).

    Every derived value is recomputed from the run's raw records with the current definitions
    (:func:`massive_lens.train.taskrecord.read_runs`: stale stored fields are recomputed and logged, copied
    or misplaced run folders refused), never read from what ``result.json`` stored.
    """
    ends, curves = [], []
    for record in read_runs(root):
        s, evals = record.settings, record.evals
        keys = dict(task=s.task, setting=s.name, seed=s.train.seed)
        ends.append({**keys, **{k: v for k, v in record.result.items() if k != "definitions"},
                     "eval_every": s.train.eval_every, "start_resid_ratio": float(evals["resid_ratio"].iloc[0]),
                     "start_resid_norm_ratio": float(evals["resid_norm_ratio"].iloc[0])})
        curves.append(evals.assign(**keys))
    if not ends:
        return pd.DataFrame(columns=["task", "setting", "seed"]), pd.DataFrame(columns=["task", "setting", "step"])
    return pd.DataFrame(ends), pd.concat(curves, ignore_index=True)


def fmt(x: float) -> str:
    """A number at a readable precision."""
    if math.isnan(x):
        return "nan"
    if 0 < abs(x) < 0.001:
        return f"{x:.1e}"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def paired(ends: pd.DataFrame, task: str, setting: str, base: str, column: str) -> tuple[float, float, float, int]:
    """Mean, low, high of ``setting`` minus ``base`` over the seeds both finished, and that count."""
    rows = ends[ends.task == task]
    a = rows[rows.setting == setting].set_index("seed")[column]
    b = rows[rows.setting == base].set_index("seed")[column]
    diff = (a - b).dropna()
    return (*t_interval(diff.tolist()), len(diff))


def shown(low: float, high: float, n: int) -> bool:
    """Two seeds at least, and the interval excludes zero."""
    return n >= 2 and not math.isnan(low) and (low > 0 or high < 0)


def diff_cell(ends: pd.DataFrame, task: str, setting: str, base: str, column: str) -> str:
    mean, low, high, n = paired(ends, task, setting, base, column)
    if n == 0:
        return "no runs"
    return f"{fmt(mean)} [{fmt(low)}, {fmt(high)}]" if shown(low, high, n) else "not shown"


def diff_table(ends: pd.DataFrame, task: str, pairs: list[tuple[str, str, str]]) -> str:
    """One row per (label, setting, base); a cell per quantity: the paired difference, or *not shown*."""
    lines = ["| comparison | seeds | " + " | ".join(label for _, label in QUANTITIES) + " |",
             "|---|---|" + "---|" * len(QUANTITIES)]
    for label, setting, base in pairs:
        n = paired(ends, task, setting, base, "sink_mass")[3]
        cells = [diff_cell(ends, task, setting, base, c) for c, _ in QUANTITIES]
        lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_cell(values: pd.Series) -> str:
    """``mean [low, high]`` over seeds; one seed: its value, said so."""
    clean = values.astype(float).dropna().tolist()
    mean, low, high = t_interval(clean)
    if len(clean) < 2:
        return "nan" if math.isnan(mean) else f"{fmt(mean)} (one seed)"
    return f"{fmt(mean)} [{fmt(low)}, {fmt(high)}]"


def end_table(ends: pd.DataFrame, task: str) -> str:
    """Mean [95% interval] over seeds of each setting's end values."""
    columns = [("accuracy", "accuracy"), ("sink_mass", "sink mass"), ("sink_step", "sink step"),
               ("resid_ratio", "resid top-1/median"), ("resid_norm_ratio", "resid norm ratio"),
               ("value_ratio", "value-norm ratio"), ("max_logit", "max logit"), ("w4a4_gap", "W4A4 gap"),
               ("seconds", "seconds")]
    lines = ["| setting | seeds | " + " | ".join(label for _, label in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    rows = ends[ends.task == task]
    for setting in [s for s in ORDER if s in set(rows.setting)]:
        part = rows[rows.setting == setting]
        lines.append(f"| {setting} | {len(part)} | " + " | ".join(mean_cell(part[c]) for c, _ in columns) + " |")
    return "\n".join(lines)


def baseline_text(ends: pd.DataFrame, task: str) -> str:
    """Does softmax form the sink, and when; does the residual peak grow with it."""
    base = ends[(ends.task == task) & (ends.setting == BASE)]
    if base.empty:
        return f"No finished {BASE} run yet."
    mean, low, _ = t_interval(base["sink_mass"].tolist())
    formed = int((base["sink_mass"] > SINK_THRESHOLD).sum())
    verdict = "**shown**" if len(base) >= 2 and low > SINK_THRESHOLD else "**not shown**"
    text = [f"*Does softmax form the sink?* {verdict}: at the end the largest first-token mass of a head is "
            f"{mean_cell(base['sink_mass'])} ({len(base)} seeds; the sink threshold is {SINK_THRESHOLD}); "
            f"{formed} of {len(base)} seeds end above the threshold."]
    steps = base["sink_step"].dropna()
    if len(steps):
        text.append(f"It first exceeds the threshold at evaluation step {mean_cell(steps)} ({len(steps)} seeds; "
                    f"evaluations every {int(base['eval_every'].iloc[0])} steps).")
    grow = [(c, (base[c] - base[f"start_{c}"]).tolist()) for c in ("resid_ratio", "resid_norm_ratio")]
    parts = []
    for column, values in grow:
        m, lo, hi = t_interval(values)
        parts.append(f"{column} end minus start {fmt(m)} [{fmt(lo)}, {fmt(hi)}]" if shown(lo, hi, len(values))
                     else f"{column} end minus start not shown")
    text.append("*Does the first token's residual peak grow while softmax trains?* " + "; ".join(parts) + ".")
    return " ".join(text)


def decoupling_text(ends: pd.DataFrame, task: str) -> str:
    """Post-norm or V-scale decouple the sink and the residual peak if the sink stays above the
    threshold (interval) and is not shown lower than its partner's, while the residual peak is shown
    lower than its partner's."""
    lines = []
    for label, setting, base in DECOUPLERS:
        part = ends[(ends.task == task) & (ends.setting == setting)]["sink_mass"]
        _, sink_low, _ = t_interval(part.tolist())
        _, low, high, n = paired(ends, task, setting, base, "resid_ratio")
        _, d_low, d_high, d_n = paired(ends, task, setting, base, "sink_mass")
        keeps = len(part) >= 2 and sink_low > SINK_THRESHOLD and not (shown(d_low, d_high, d_n) and d_high < 0)
        lower = shown(low, high, n) and high < 0
        verdict = "decoupled: sink kept (not shown lower), residual peak lower" if keeps and lower \
            else "decoupling not shown"
        lines.append(f"- {label}: {verdict} ({setting} sink mass {mean_cell(part)}; residual top-1/median "
                     f"difference {diff_cell(ends, task, setting, base, 'resid_ratio')}, {n} paired seeds)")
    return "\n".join(lines)


def task_block(ends: pd.DataFrame, task: str) -> str:
    rows = ends[ends.task == task]
    seeds = ", ".join(f"{s}: {int((rows.setting == s).sum())}" for s in ORDER if (rows.setting == s).any())
    offs = [(f"{s.split('-')[0]} vs softmax", s, BASE) for s in ORDER if s.endswith("-pre") and s != BASE]
    return "\n\n".join([
        f"### {task}", f"Finished runs: {len(rows)} (seeds per setting: {seeds or 'none'}).",
        baseline_text(ends, task),
        "*Does each off-switch avoid the sink, at equal accuracy?* Paired differences, setting minus "
        "softmax (pre-norm), at the end of training:", diff_table(ends, task, offs),
        "*Does post-norm or V-scale decouple the sink from the residual peak?*", decoupling_text(ends, task),
        diff_table(ends, task, DECOUPLERS)])


def blocks(root: str | Path) -> tuple[dict[str, str], pd.DataFrame]:
    """The generated text of each block (``answer``, ``ends``) and the curves."""
    ends, curves = load_runs(root)
    tasks = _tasks(ends)
    answer = "\n\n".join(task_block(ends, t) for t in tasks)
    table = "\n\n".join(f"**{t}**\n\n{end_table(ends, t)}" for t in tasks)
    return dict(answer=answer, ends=table), curves


def task_answer(root: str | Path) -> str:
    """The answer block of the page (markdown), from the finished runs under ``root``.

    Args:
        root: a grid's run folders (``<root>/<task>/<variant>-<norm>/seed<s>/``).

    Returns:
        Per task: the baseline's sink, the off-switches' paired differences, the decoupling verdicts.
    """
    return blocks(root)[0]["answer"]


def _tasks(frame: pd.DataFrame) -> list[str]:
    """The grid's tasks that have runs in ``frame`` (all of them when none has)."""
    present = [t for t in TASK_SETTINGS if (frame["task"] == t).any()]
    return present or list(TASK_SETTINGS)


def figure(curves: pd.DataFrame, path: str | Path) -> Any:
    """Sink mass and the first token's residual top-1/median against steps, mean over seeds, per setting."""
    tasks = _tasks(curves)
    fig, axes = new_figure(len(tasks), 2, size=(11, 3.6 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks, strict=True):
        part = curves[curves.task == task]
        for setting in [s for s in ORDER if s in set(part.setting)]:
            mean = part[part.setting == setting].groupby("step")[["sink_mass", "resid_ratio"]].mean()
            style = dict(ls="--" if setting.endswith("post") else "-", lw=2 if setting == BASE else 1.2)
            for ax, column in zip(row, ("sink_mass", "resid_ratio"), strict=True):
                ax.plot(mean.index, mean[column], label=setting, **style)
        row[0].axhline(SINK_THRESHOLD, color="grey", lw=0.8, ls=":")
        row[0].set(title=f"{task}: first-token sink mass (largest head)", xlabel="step", ylabel="sink mass")
        row[1].set(title=f"{task}: first token's residual top-1 / median", xlabel="step", ylabel="ratio")
        row[0].legend(fontsize=7, frameon=False, ncol=2)
    save_figure(fig, path, formats=("png",), dpi=110)
    close_figure(fig)
    return fig


def fill(page: str, generated: dict[str, str]) -> str:
    """``page`` with each ``<!-- gen:NAME -->`` block replaced by ``generated[NAME]``."""
    for name, text in generated.items():
        pattern = re.compile(rf"(<!-- gen:{name} -->\n).*?(<!-- /gen:{name} -->)", re.S)
        if not pattern.search(page):
            raise MassiveLensError(f"the page has no <!-- gen:{name} --> ... <!-- /gen:{name} --> block; add one")
        page = pattern.sub(lambda m, t=text: m.group(1) + "\n" + t + "\n\n" + m.group(2), page)
    return page


def write_page(root: str | Path, page: str | Path, check: bool = False) -> int:
    """Rewrite ``page``'s generated blocks and its figure (next to it, ``<page stem>/curves.png``) from
    the runs under ``root``; with ``check``, write nothing and return 1 if the page differs, else 0."""
    page = Path(page)
    if not page.is_file():
        raise MassiveLensError(f"no page {page}; it needs the <!-- gen:answer --> and <!-- gen:ends --> blocks")
    generated, curves = blocks(root)
    old = page.read_text()
    new = fill(old, generated)
    if check:
        return int(new != old)
    page.write_text(new)
    figure(curves, page.with_suffix("") / FIGURE)
    return 0
