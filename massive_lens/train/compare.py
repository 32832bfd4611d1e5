"""Train attention variants side by side and compare their outliers and int8 cost.

Each variant is trained with the same preset, seeds, data order and budget; only the
attention differs. Then each trained model is measured with
:func:`massive_lens.quant.measure_outliers` on held-out text: full-precision loss,
W8A8 loss and their gap, max |activation|, top-1/median ratio, kurtosis, sink metric.

The comparison means something only if the ``softmax`` baseline develops massive
activations; :attr:`Comparison.baseline_massive` says whether it did (by Sun et al.'s
criterion: a magnitude above ``100`` and above ``1000`` times the median), and the
summary says so in words.

>>> result = compare_variants(["softmax", "softmax1"], preset="smoke", seeds=[0], progress=False,
...                           steps=2, data="One. Two, three.\\n" * 100, measure_seqs=1,
...                           model=dict(n_layers=1, d_model=16, n_ctx=16))
>>> sorted(result.to_frame().index)
['softmax', 'softmax1']
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from massive_lens.core.charts import curve_axes
from massive_lens.core.criterion import Criterion
from massive_lens.core.outputs import check_out_dir
from massive_lens.core.render import save_figure
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.quant import measure_outliers
from massive_lens.train.data import get_tokenizer, sample_batch, split_held_out, start_token, token_stream
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.presets import get_preset
from massive_lens.train.stability import TrainingStability, training_stability
from massive_lens.train.trainer import train_model
from massive_lens.train.variants import VARIANTS

log = logging.getLogger(__name__)
METRICS = ["fp_loss", "w8a8_loss", "gap", "max_inf_norm", "max_ratio", "mean_kurtosis",
           "sink_metric", "first_token_norm_ratio"]


@dataclass(frozen=True, kw_only=True)
class Comparison(Result):
    """Results of :func:`compare_variants`.

    ``runs``: one row per (variant, seed) with the :data:`METRICS` columns plus
    ``val_loss``, ``steps`` and ``seconds``. ``curves``: variant, seed, step, loss,
    val_loss. ``profiles``: variant, seed, layer, max_inf_norm, median, ratio, kurtosis.
    ``per_step``: variant, seed and every step's record (:data:`~massive_lens.train.recorder.STEP_COLUMNS`;
    empty with ``record=False``), which :meth:`stability` reads.
    """

    preset: str
    runs: pd.DataFrame
    curves: pd.DataFrame
    profiles: pd.DataFrame
    per_step: pd.DataFrame = field(default_factory=pd.DataFrame)

    def stability(self, **options: Any) -> TrainingStability:
        """The loss spikes and the massive activations around them.

        Args:
            **options: :func:`~massive_lens.train.stability.training_stability`'s window, factors
                and ``until_step``.

        Returns:
            A :class:`~massive_lens.train.stability.TrainingStability` of these runs.
        """
        return training_stability(self, **options)

    @property
    def baseline_massive(self) -> bool | None:
        """Did the softmax baseline develop massive activations (None: not trained)?"""
        base = self.runs[self.runs["variant"] == "softmax"]
        if base.empty:
            return None
        c = Criterion()
        return bool(((base["max_inf_norm"] > c.abs_threshold) & (base["max_ratio"] > c.ratio_threshold)).any())

    def to_frame(self) -> pd.DataFrame:
        """Mean over seeds per variant (index), with ``<metric>_std`` spread columns."""
        grouped = self.runs.groupby("variant", sort=False)[METRICS + ["val_loss"]]
        mean, std = grouped.mean(), grouped.std(ddof=0).add_suffix("_std")
        return mean.join(std).assign(seeds=self.runs.groupby("variant", sort=False).size())

    def summary(self) -> str:
        frame = self.to_frame()
        lines = [f"attention variants trained with preset {self.preset!r} "
                 f"({int(frame['seeds'].iloc[0])} seed(s) each):"]
        for variant, row in frame.iterrows():
            lines.append(
                f"  {variant:16s} loss {row.fp_loss:.3f} -> W8A8 {row.w8a8_loss:.3f} "
                f"(gap {row.gap:+.3f}±{row.gap_std:.3f}); max |act| {row.max_inf_norm:.1f}, "
                f"top-1/median {row.max_ratio:.0f}x, kurtosis {row.mean_kurtosis:.1f}, "
                f"sink metric {row.sink_metric:.0%}"
            )
        verdict = self.baseline_massive
        if verdict is False:
            lines.append(
                "  CAUTION: the softmax baseline did NOT develop massive activations "
                f"(needs > {Criterion().abs_threshold:.0f} and > {Criterion().ratio_threshold:.0f}x the median), so "
                "this comparison cannot show whether a variant removes them."
            )
        elif verdict:
            lines.append("  The softmax baseline developed massive activations.")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Training curves per variant (mean over seeds); the layer profiles are
        :func:`massive_lens.viz.overlay_profiles` of :attr:`profiles`."""
        return curve_axes(self.curves, y=("loss",), by="variant", ax=ax, title=f"preset {self.preset}")


def compare_variants(
    variants: Sequence[str] = ("softmax", "softmax1"),
    *,
    preset: Any = "smoke",
    seeds: Sequence[int] = (0,),
    out_dir: str | os.PathLike | None = None,
    until_step: int | None = None,
    progress: bool = True,
    measure_seqs: int = 8,
    record: bool = True,
    **overrides: Any,
) -> Comparison:
    """Train every variant for every seed under one preset, then measure each model.

    With ``out_dir``, runs live in ``out_dir/<variant>/seed<seed>`` and resume there, so
    an interrupted comparison continues where it stopped. ``overrides`` are
    :class:`~massive_lens.train.presets.TrainConfig` fields applied to every run.

    Args:
        variants: attention variant names from :data:`~massive_lens.train.VARIANTS`
            (default ``softmax`` and ``softmax1``).
        preset: a preset name from :data:`~massive_lens.train.PRESETS` (default
            ``"smoke"``) or a :class:`~massive_lens.train.TrainConfig`.
        seeds: one run per variant and seed (default ``(0,)``).
        out_dir: the folder the runs are saved in and resumed from (None: nothing is
            written and every run starts from scratch).
        until_step: stop every run after this step (the schedule still targets ``steps``).
        progress: show training progress bars.
        measure_seqs: held-out sequences each model is evaluated on (as many again
            calibrate the W8A8 activation ranges; default 8).
        record: record every training step (:attr:`Comparison.per_step`; default True).
        **overrides: :class:`~massive_lens.train.TrainConfig` fields for every run
            (``model=`` dicts are merged into the preset's).

    Returns:
        A :class:`Comparison`: one row per (variant, seed) in ``runs``, training curves,
        and layer profiles.

    Raises:
        MassiveLensError: if ``variants`` is empty or names an unknown variant, ``seeds`` is
            empty or not whole numbers, ``out_dir`` cannot be written, the preset is unknown,
            an override is invalid, or the data is too short.

    >>> result = compare_variants(["softmax", "kv_bias"], preset="smoke", progress=False, steps=2,
    ...                           data="One. Two, three.\\n" * 100, measure_seqs=1,
    ...                           model=dict(n_layers=1, d_model=16, n_ctx=16))
    >>> result.runs[["variant", "seed", "steps"]].values.tolist()
    [['softmax', 0, 2], ['kv_bias', 0, 2]]
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise MassiveLensError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if not list(seeds):
        raise MassiveLensError("seeds is empty; pass at least one seed, e.g. seeds=[0]")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in seeds):
        raise MassiveLensError(f"seeds must be whole numbers, got {list(seeds)}")
    check_out_dir(out_dir)  # before training: an unwritable folder fails now
    base = get_preset(preset, **overrides)
    tokenizer = get_tokenizer(base.tokenizer)
    stream = token_stream(base.data, tokenizer, base.max_chars)
    _, held_out = split_held_out(stream, base.model.get("n_ctx", MassiveLMConfig.n_ctx), base.val_fraction)
    bos = start_token(tokenizer, base.prepend_bos)
    runs, curves, profiles, per_step = [], [], [], []
    for variant in variants:
        for seed in seeds:
            cfg = get_preset(base.with_attention(variant), seed=seed)
            folder = None if out_dir is None else Path(out_dir) / variant / f"seed{seed}"
            t0 = time.perf_counter()
            run = train_model(cfg, out_dir=folder, until_step=until_step, progress=progress, record=record)
            seconds = time.perf_counter() - t0
            n_ctx = run.model.cfg.n_ctx
            tokens = sample_batch(held_out, 2 * measure_seqs, min(n_ctx, len(held_out) - 1),
                                  bos, seed=12345, step=0)
            report = measure_outliers(run.model, tokens)
            row = report.totals
            runs.append(dict(variant=variant, seed=seed, **row, val_loss=run.val_loss,
                             steps=run.steps, seconds=seconds))
            curves += [dict(variant=variant, seed=seed, step=h["step"], loss=h["loss"],
                            val_loss=h["val_loss"]) for h in run.history]
            profiles += [dict(variant=variant, seed=seed, **r) for r in report.to_frame().to_dict("records")]
            if len(run.per_step):
                per_step.append(run.per_step.assign(variant=variant, seed=seed)[["variant", "seed",
                                                                                  *run.per_step.columns]])
            log.info("%s seed %d: %s", variant, seed, report.summary())
    name = preset if isinstance(preset, str) else "custom"
    steps = pd.concat(per_step, ignore_index=True) if per_step else pd.DataFrame()
    return Comparison(preset=name, runs=pd.DataFrame(runs), curves=pd.DataFrame(curves),
                      profiles=pd.DataFrame(profiles), per_step=steps)


def compare_main(
    *,
    variants: str | Sequence[str] = "softmax,softmax1",
    preset: str = "smoke",
    seeds: str | Sequence[int] = "0",
    out_dir: str | os.PathLike = "runs/train-compare",
    until_step: int | None = None,
    progress: bool = True,
) -> str:
    """What ``massive-lens train-compare`` runs: compare, save CSVs and a plot, return the summary.

    ``variants`` and ``seeds`` may be comma-separated strings. Writes ``runs.csv``,
    ``summary.csv``, ``curves.csv``, ``profiles.csv``, ``summary.txt`` and
    ``comparison.png`` into ``out_dir``, and the training-stability analysis of every step
    (:meth:`Comparison.stability`, up to ``until_step``) as ``stability/`` (``massive_lens.load`` reads it),
    ``stability.png``, ``stability_runs.csv`` and ``spikes.csv``.

    Args:
        variants: variant names, as a list or one comma-separated string (default
            ``"softmax,softmax1"``).
        preset: a preset name (default ``"smoke"``).
        seeds: seeds, as a list of ints or one comma-separated string (default ``"0"``).
        out_dir: where the runs and the outputs go (default ``"runs/train-compare"``);
            existing runs there are resumed.
        until_step: stop every run after this step.
        progress: show training progress bars.

    Returns:
        The comparison's summary text (:meth:`Comparison.summary`).

    Raises:
        MassiveLensError: as :func:`compare_variants`, and if a seed in a string is not a
            whole number or ``out_dir`` cannot be written (checked before training).
    """
    names = variants.split(",") if isinstance(variants, str) else list(variants)
    try:
        seed_list = [int(s) for s in seeds.split(",")] if isinstance(seeds, str) else list(seeds)
    except ValueError as exc:
        raise MassiveLensError(f"seeds must be comma-separated whole numbers, e.g. '0,1,2'; got {seeds!r}") from exc
    check_out_dir(out_dir)
    result = compare_variants([n.strip() for n in names], preset=preset, seeds=seed_list, out_dir=out_dir,
                              until_step=until_step, progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.runs.to_csv(out / "runs.csv", index=False)
    result.to_frame().to_csv(out / "summary.csv")
    result.curves.to_csv(out / "curves.csv", index=False)
    result.profiles.to_csv(out / "profiles.csv", index=False)
    text = result.summary()
    if len(result.per_step):
        stable = result.stability(until_step=until_step)  # runs that went on further: the same steps
        stable.save(out / "stability", overwrite=True)
        stable.to_frame().to_csv(out / "stability_runs.csv", index=False)
        stable.spikes.to_csv(out / "spikes.csv", index=False)
        save_figure(stable.plot(), out / "stability", formats=("png",), dpi=120)
        text += "\n" + stable.summary()
    (out / "summary.txt").write_text(text + "\n")
    save_figure(result.plot(), out / "comparison", formats=("png",), dpi=120)
    return text
