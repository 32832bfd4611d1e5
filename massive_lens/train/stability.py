"""Training stability: do loss spikes come with massive activations?

Every :func:`~massive_lens.train.train_model` step is recorded (:mod:`massive_lens.train.recorder`:
loss, gradient norm, the largest residual |activation| and its ratio to the median, attention on
the first token). :func:`training_stability` finds the **spikes** in that record and measures the
massive activations around each one.

A step is a *loss spike* when its loss exceeds ``loss_factor`` times the median loss of the
``window`` steps before it, and a *gradient spike* when its gradient norm exceeds ``grad_factor``
times their median gradient norm (only once ``window`` steps precede it). Flagged steps less than
``around`` steps apart are one spike. Around each spike, ``act_before`` is the median of the
largest |activation| over the ``around`` steps before it, ``act_after`` the largest over the spike
and the ``around`` steps after it, and ``act_growth`` their ratio (likewise ``ratio_*`` for the
top-1/median ratio and ``attn_*`` for the first-token attention, means).

Runs are told apart by their ``run`` label (for a folder of runs, the run's folder), never by
variant and seed alone: two experiments under one folder may share both. A run whose loss becomes
NaN or infinite **diverged**: ``diverged_at`` names the first such step (spikes are looked for in
the finite steps before and after it, and the summary says so).

Per run, ``to_frame()`` gives the number of spikes and the state at the end (means over the last
``window`` steps); :meth:`TrainingStability.table` the mean per variant with a 95% t-interval over
runs (with 3 seeds the interval is wide, as it should be).

>>> import numpy as np
>>> loss = np.full(200, 3.0); loss[120] = 6.0
>>> int(find_spikes(loss, window=50, factor=1.2).sum()), int(find_spikes(np.full(200, 3.0)).sum())
(1, 0)
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from massive_lens.core.render import ensure_axes, new_figure
from massive_lens.core.results import Result
from massive_lens.core.stats import t_interval
from massive_lens.errors import MassiveLensError
from massive_lens.train.steprecords import KEYS, NEEDED, read_step_folder

WINDOW, LOSS_FACTOR, GRAD_FACTOR, AROUND = 50, 1.2, 3.0, 10
END_METRICS = ("loss", "max_act", "act_ratio", "first_attn", "first_attn_top")
PANELS = (("loss", "training loss", False), ("grad_norm", "gradient norm", True),
          ("max_act", "largest |activation|", True), ("first_attn", "attention on the first token", False))


def find_spikes(values: Sequence[float] | np.ndarray | pd.Series, *, window: int = WINDOW,
                factor: float | int = 2.0) -> np.ndarray:
    """Which steps jump above the rolling median of the steps before them.

    Args:
        values: one value per step (a loss or a gradient norm).
        window: how many preceding steps the median is taken over.
        factor: how far above that median a step must be.

    Returns:
        A boolean array: ``values[t] > factor * median(values[t - window:t])`` (False until
        ``window`` values precede ``t``).

    Raises:
        MassiveLensError: if ``window`` is below 2 or ``factor`` is not above 1.

    >>> find_spikes([1.0, 1.0, 1.0, 5.0, 1.0], window=3).tolist()
    [False, False, False, True, False]
    """
    if window < 2 or not factor > 1:
        raise MassiveLensError(f"window must be >= 2 and factor > 1, got window={window}, factor={factor}")
    series = pd.Series(np.asarray(values, dtype=float))
    median = series.shift(1).rolling(window, min_periods=window).median()
    return (series > factor * median).to_numpy()


def spike_table(run: pd.DataFrame, *, window: int = WINDOW, loss_factor: float | int = LOSS_FACTOR,
                grad_factor: float | int = GRAD_FACTOR, around: int = AROUND) -> pd.DataFrame:
    """The spikes of one run's per-step record (rows in step order), one row each (see the module
    docstring): ``step``, ``end``, ``kind`` (``loss``, ``grad`` or ``loss+grad``), ``loss_jump`` and
    ``grad_jump`` (largest value over the spike / the median before it), ``act_before``,
    ``act_after``, ``act_growth``, ``ratio_before``, ``ratio_after``, ``attn_before``, ``attn_after``."""
    run = run.sort_values("step").reset_index(drop=True)
    loss_flag = find_spikes(run["loss"], window=window, factor=loss_factor)
    grad_flag = find_spikes(run["grad_norm"], window=window, factor=grad_factor)
    flagged = np.flatnonzero(loss_flag | grad_flag)
    if not len(flagged):
        return pd.DataFrame()
    med = {c: run[c].shift(1).rolling(window, min_periods=window).median() for c in ("loss", "grad_norm")}
    groups = np.split(flagged, np.flatnonzero(np.diff(flagged) >= around) + 1)
    rows = []
    for idx in groups:
        first, last = int(idx[0]), int(idx[-1])
        before, after = run.iloc[max(0, first - around):first], run.iloc[first:last + around + 1]
        kinds = [k for k, f in (("loss", loss_flag), ("grad", grad_flag)) if f[idx].any()]
        rows.append(dict(step=int(run["step"][first]), end=int(run["step"][last]), kind="+".join(kinds),
                         loss_jump=float((run["loss"][idx] / med["loss"][idx]).max()),
                         grad_jump=float((run["grad_norm"][idx] / med["grad_norm"][idx]).max()),
                         act_before=float(before["max_act"].median()), act_after=float(after["max_act"].max()),
                         ratio_before=float(before["act_ratio"].median()), ratio_after=float(after["act_ratio"].max()),
                         attn_before=float(before["first_attn"].mean()), attn_after=float(after["first_attn"].mean())))
    frame = pd.DataFrame(rows)
    frame.insert(frame.columns.get_loc("act_after") + 1, "act_growth", frame["act_after"] / frame["act_before"])
    return frame


@dataclass(frozen=True, kw_only=True)
class TrainingStability(Result):
    """Spikes and massive activations over training (see the module docstring).

    ``per_step``: ``run`` (the run's label: for a folder of runs, the run's folder relative to
    it, ``.`` for the folder itself; else ``<variant> seed <seed>``, or a TrainRun's ``out_dir``),
    ``variant``, ``seed`` and the recorder's columns, one row per step of each run. ``spikes``:
    ``run``, ``variant``, ``seed`` and the :func:`spike_table` columns. ``to_frame()``: one row per
    run: ``run``, ``variant``, ``seed``, ``steps``, ``spikes``, ``loss_spikes``, ``grad_spikes``,
    ``loss_jump_max`` and ``grad_jump_max`` (the largest value over the median of the ``window``
    steps before it: how close the run came to a spike), ``act_growth`` (largest over its spikes,
    NaN without one), ``act_ratio_peak``, ``diverged_at`` (the first step whose loss is NaN or
    infinite; NaN if none) and the means over the last ``window`` steps of :data:`END_METRICS`
    (``<metric>_end``).
    """

    per_step: pd.DataFrame
    spikes: pd.DataFrame
    window: int = WINDOW
    loss_factor: float = LOSS_FACTOR
    grad_factor: float = GRAD_FACTOR
    around: int = AROUND

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for (label, variant, seed), run in _keyed(self.per_step).groupby(list(KEYS), sort=False):
            mine = self._spikes_of(label)
            end = run.sort_values("step").tail(self.window)
            kinds = mine["kind"] if len(mine) else pd.Series(dtype=str)
            rows.append(dict(run=label, variant=variant, seed=int(seed), steps=int(run["step"].max()), spikes=len(mine),
                             loss_spikes=int(kinds.str.contains("loss").sum()),
                             grad_spikes=int(kinds.str.contains("grad").sum()),
                             loss_jump_max=_largest_jump(run, "loss", self.window),
                             grad_jump_max=_largest_jump(run, "grad_norm", self.window),
                             act_growth=float(mine["act_growth"].max()) if len(mine) else math.nan,
                             act_ratio_peak=float(run["act_ratio"].max()), diverged_at=_diverged_at(run),
                             **{f"{m}_end": float(end[m].mean()) if m in end else math.nan for m in END_METRICS}))
        return pd.DataFrame(rows)

    def _spikes_of(self, label: str) -> pd.DataFrame:
        if not len(self.spikes):
            return self.spikes
        return self.spikes[_keyed(self.spikes)["run"] == label]

    def table(self) -> pd.DataFrame:
        """Per variant: each run metric's mean over seeds with its 95% t-interval
        (``<metric>``, ``<metric>_low``, ``<metric>_high``), ``seeds`` (the number of runs) and
        ``diverged`` (how many of them diverged)."""
        runs, rows = self.to_frame(), []
        metrics = ["spikes", "loss_jump_max", "grad_jump_max", "act_ratio_peak"] + [f"{m}_end" for m in END_METRICS]
        for variant, part in runs.groupby("variant", sort=False):
            row: dict[str, Any] = dict(variant=variant, seeds=len(part), steps=int(part["steps"].max()),
                                       diverged=int(part["diverged_at"].notna().sum()))
            for m in metrics:
                row[m], row[f"{m}_low"], row[f"{m}_high"] = t_interval(part[m].tolist())
            rows.append(row)
        return pd.DataFrame(rows)

    def summary(self) -> str:
        table, runs = self.table(), self.to_frame()
        lines = [f"training stability over {len(runs)} runs (spike: loss > {self.loss_factor:g}x or "
                 f"gradient norm > {self.grad_factor:g}x the median of the {self.window} steps before; 95% "
                 "t-intervals over seeds):"]
        for _, r in table.iterrows():
            ci = functools.partial(_ci, r)
            lines.append(f"  {r['variant']} ({r['seeds']} seeds, {r['steps']} steps): {ci('spikes', '.2f')} spikes "
                         f"per run (largest jumps: loss {ci('loss_jump_max')}x, gradient norm "
                         f"{ci('grad_jump_max')}x the median before); at the end max|act| {ci('max_act_end')}, "
                         f"top-1/median {ci('act_ratio_end')}, "
                         f"first-token attention {ci('first_attn_end', '.3f')} (top layer "
                         f"{ci('first_attn_top_end', '.3f')}), loss {ci('loss_end')}")
        diverged = runs[runs["diverged_at"].notna()]
        if len(diverged):
            lines.append(f"  {len(diverged)} run{'s' * (len(diverged) != 1)} DIVERGED (loss NaN or infinite): " +
                         "; ".join(f"{r.run} ({r.variant}, seed {r.seed}) from step {int(r.diverged_at)}"
                                   for r in diverged.itertuples()) + "; spikes are counted in the finite steps only")
        if not len(self.spikes) and len(diverged):
            lines.append("  No spikes in the finite steps of any run.")
        elif not len(self.spikes):
            lines.append("  No spikes in any run: this budget says nothing about massive activations and spikes.")
        else:
            growth = self.spikes["act_growth"]
            lines.append(f"  {len(growth)} spike{'s' * (len(growth) != 1)}; around them the largest |activation| grew "
                         f"{growth.median():.2f}x "
                         f"(median; range {growth.min():.2f}-{growth.max():.2f})")
        return "\n".join(lines)

    def plot(self, ax: Any = None, metric: str | None = None) -> Any:
        """The record over steps, one color per variant and one line per seed, spikes marked.

        Args:
            ax: an axis to draw one metric on (None: a new figure).
            metric: the column to draw (``max_act`` when only ``ax`` is given). With neither, four
                panels (loss, gradient norm, largest |activation|, first-token attention).

        Returns:
            The axis drawn on (with four panels, the top one; ``.figure`` holds all).
        """
        if ax is None and metric is None:
            fig, panels = new_figure(len(PANELS), 1, size=(9, 10), sharex=True)
            for panel, (name, label, log) in zip(panels, PANELS, strict=True):
                self._draw(panel, name, label, log)
            panels[-1].set_xlabel("step")
            panels[0].legend(fontsize=7, ncol=3)
            panels[0].set_title(f"training stability ({len(self.to_frame())} runs; x: spikes)")
            return panels[0]
        ax = ensure_axes(ax, (9, 3.5))
        name, label, log = next((p for p in PANELS if p[0] == (metric or "max_act")), (metric, metric, False))
        self._draw(ax, name, label, log)
        ax.set_xlabel("step")
        ax.legend(fontsize=7, ncol=3)
        return ax

    def _draw(self, ax: Any, name: str, label: str, log: bool) -> None:
        if name not in self.per_step:
            raise MassiveLensError(f"no column {name!r} in the per-step record; choose from {list(self.per_step)}")
        per_step = _keyed(self.per_step)
        for i, variant in enumerate(per_step["variant"].unique()):
            for j, (label, run) in enumerate(per_step[per_step["variant"] == variant].groupby("run", sort=False)):
                ax.plot(run["step"], run[name], color=f"C{i}", lw=0.7, alpha=0.8, label=variant if j == 0 else None)
                hits = run[run["step"].isin(self._spikes_of(label).get("step", []))]
                ax.plot(hits["step"], hits[name], "x", color=f"C{i}", ms=7)
        ax.set(ylabel=label, yscale="log" if log else "linear")


def _diverged_at(run: pd.DataFrame) -> float:
    """The first step whose loss is NaN or infinite (NaN when every loss is finite)."""
    run = run.sort_values("step")
    bad = ~np.isfinite(run["loss"].to_numpy(dtype=float))
    return float(run["step"].iloc[int(bad.argmax())]) if bad.any() else math.nan


def _keyed(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``run`` column first (``<variant> seed <seed>`` where it has none: a frame
    given without one, or a result saved before runs had labels)."""
    if "run" in frame or frame.empty:
        return frame
    label = frame["variant"].astype(str) + " seed " + frame["seed"].astype(str)
    return frame.assign(run=label)[["run", *frame.columns]]


def _largest_jump(run: pd.DataFrame, column: str, window: int) -> float:
    values = run.sort_values("step")[column].reset_index(drop=True)
    return float((values / values.shift(1).rolling(window, min_periods=window).median()).max())


def _ci(row: pd.Series, metric: str, form: str = ".3g") -> str:
    return f"{row[metric]:{form}} ({row[metric + '_low']:{form}}-{row[metric + '_high']:{form}})"


def training_stability(runs: Any, *, window: int = WINDOW, loss_factor: float | int = LOSS_FACTOR,
                       grad_factor: float | int = GRAD_FACTOR, around: int = AROUND,
                       until_step: int | None = None) -> TrainingStability:
    """Find the spikes in recorded training runs and the massive-activation growth around them.

    Args:
        runs: a :class:`~massive_lens.train.Comparison`, a :class:`~massive_lens.train.TrainRun`, a
            list of them, a per-step frame with ``variant`` and ``seed`` columns (and ``run``, where
            runs share both), or a folder (``train-compare``'s ``out_dir``: every ``steps.parquet``
            under it, with its ``run.json``; each run is labelled by its folder; read and checked by
            :func:`massive_lens.train.steprecords.read_step_folder`).
        window: steps of the rolling median a step is compared with (default 50).
        loss_factor: a loss above this many times the median is a spike (default 1.2).
        grad_factor: a gradient norm above this many times the median is a spike (default 3.0).
        around: steps before and after a spike that its activation growth is measured over, and
            the gap below which flagged steps are one spike (default 10).
        until_step: read only the steps up to this one (None: all), to compare runs that went on
            for different lengths over the same steps.

    Returns:
        A :class:`TrainingStability`.

    Raises:
        MassiveLensError: if no run has a per-step record (trained with ``record=False``, or a
            folder without ``steps.parquet``), a ``steps.parquet`` or ``run.json`` in the folder
            cannot be read or lacks what it should hold, a run is given twice (two copies of one folder, or
            one record passed twice), or window / factors are invalid.

    >>> import numpy as np
    >>> steps = pd.DataFrame(dict(variant="softmax", seed=0, step=np.arange(1, 101), loss=3.0, grad_norm=1.0,
    ...                           max_act=10.0, act_ratio=5.0, first_attn=0.2, first_attn_top=0.3))
    >>> training_stability(steps, window=20).to_frame()[["run", "spikes", "act_ratio_end"]].values.tolist()
    [['softmax seed 0', 0, 5.0]]
    """
    per_step = _per_step(runs)
    if until_step is not None and len(per_step):
        per_step = per_step[per_step["step"] <= until_step].reset_index(drop=True)
    if per_step.empty:
        raise MassiveLensError("no per-step record in these runs: train with record=True (the default), "
                               "or point at a folder holding runs' steps.parquet")
    if around < 1:
        raise MassiveLensError(f"around must be a positive number of steps, got {around}")
    _refuse_copies(per_step)
    tables = []
    for (label, variant, seed), run in per_step.groupby(list(KEYS), sort=False):
        found = spike_table(run, window=window, loss_factor=loss_factor, grad_factor=grad_factor, around=around)
        if len(found):
            tables.append(found.assign(run=label, variant=variant, seed=seed))
    spikes = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    if len(spikes):
        spikes = spikes[[*KEYS] + [c for c in spikes if c not in KEYS]]
    return TrainingStability(per_step=per_step, spikes=spikes, window=window, loss_factor=float(loss_factor),
                             grad_factor=float(grad_factor), around=around)


def _refuse_copies(per_step: pd.DataFrame) -> None:
    """Two runs with one variant and seed and the same per-step record are one run given twice (a copied
    folder, the same TrainRun passed twice): refused, since counting both would count one seed twice."""
    seen: dict[tuple, str] = {}
    for (label, variant, seed), run in per_step.groupby(list(KEYS), sort=False):
        record = run.drop(columns=list(KEYS)).sort_values("step")
        key = (variant, seed, int(pd.util.hash_pandas_object(record, index=False).sum()))
        if key in seen:
            raise MassiveLensError(f"the runs {seen[key]!r} and {label!r} are copies of one run ({variant}, seed "
                                   f"{seed}, the same per-step record): counting both would count one seed twice; "
                                   "give each run once")
        seen[key] = label


def _per_step(runs: Any) -> pd.DataFrame:
    if isinstance(runs, (str, os.PathLike)):
        return read_step_folder(Path(runs))
    if isinstance(runs, pd.DataFrame):
        missing = {"variant", "seed", *NEEDED} - set(runs)
        if missing:
            raise MassiveLensError(f"the per-step frame lacks the columns {sorted(missing)}")
        return _keyed(runs.reset_index(drop=True))
    if isinstance(runs, (list, tuple)):
        frames = [_per_step(r) for r in runs]
        labels = [set(f["run"]) if len(f) else set() for f in frames]
        if sum(map(len, labels)) != len(set().union(*labels)):  # two items share a label: number them
            frames = [f.assign(run=f"#{i} " + f["run"].astype(str)) if len(f) else f for i, f in enumerate(frames)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    frame = getattr(runs, "per_step", None)
    if not isinstance(frame, pd.DataFrame):
        raise MassiveLensError(f"cannot read a per-step record from {type(runs).__name__}; give a TrainRun, a "
                               "Comparison, a per-step frame or a runs folder")
    if "variant" in frame or frame.empty:
        return _keyed(frame)
    variant, seed = runs.model.cfg.attention.name, runs.config.seed
    label = str(runs.out_dir) if getattr(runs, "out_dir", None) else f"{variant} seed {seed}"
    return frame.assign(run=label, variant=variant, seed=seed)[[*KEYS, *frame.columns]]
