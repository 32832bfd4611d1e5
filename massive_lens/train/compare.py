"""Train attention variants side by side and compare their outliers and int8 cost.

Each variant is trained with the same preset, seeds, data order and budget; only the
attention differs. Then each trained model is measured with
:func:`massive_lens.quantize.measure_outliers` on held-out text: full-precision loss,
W8A8 loss and their gap, max |activation|, top-1/median ratio, kurtosis, sink metric.

The comparison means something only if the ``softmax`` baseline develops massive
activations; :attr:`Comparison.baseline_massive` says whether it did (by Sun et al.'s
criterion: a magnitude above ``100`` and above ``1000`` times the median), and the
summary says so in words.

>>> result = compare_variants(["softmax", "softmax1"], "smoke", seeds=[0], progress=False,
...                           steps=2, data="One. Two, three.\\n" * 100, measure_seqs=1,
...                           model=dict(n_layers=1, d_model=16, n_ctx=16))
>>> sorted(result.to_frame().index)
['softmax', 'softmax1']
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from massive_lens.errors import MassiveLensError
from massive_lens.train.attention import VARIANTS

log = logging.getLogger(__name__)
METRICS = ["fp_loss", "w8a8_loss", "gap", "max_inf_norm", "max_ratio", "mean_kurtosis",
           "sink_metric", "first_token_norm_ratio"]
MASSIVE_VALUE, MASSIVE_RATIO = 100.0, 1000.0


@dataclass(frozen=True)
class Comparison:
    """Results of :func:`compare_variants`.

    ``runs``: one row per (variant, seed) with the :data:`METRICS` columns plus
    ``val_loss``, ``steps`` and ``seconds``. ``curves``: variant, seed, step, loss,
    val_loss. ``profiles``: variant, seed, layer, max_inf_norm, median, ratio, kurtosis.
    """

    preset: str
    runs: pd.DataFrame
    curves: pd.DataFrame
    profiles: pd.DataFrame

    @property
    def baseline_massive(self) -> bool | None:
        """Did the softmax baseline develop massive activations (None: not trained)?"""
        base = self.runs[self.runs["variant"] == "softmax"]
        if base.empty:
            return None
        return bool(((base["max_inf_norm"] > MASSIVE_VALUE) & (base["max_ratio"] > MASSIVE_RATIO)).any())

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
                f"(needs > {MASSIVE_VALUE:.0f} and > {MASSIVE_RATIO:.0f}x the median), so "
                "this comparison cannot show whether a variant removes them."
            )
        elif verdict:
            lines.append("  The softmax baseline developed massive activations.")
        return "\n".join(lines)

    def plot(self, axes: Any = None) -> Any:
        """Training curves (left) and max |activation| per layer (right), per variant."""
        import matplotlib.pyplot as plt

        if axes is None:
            _, axes = plt.subplots(1, 2, figsize=(11, 4))
        for variant, curve in self.curves.groupby("variant", sort=False):
            mean = curve.groupby("step")["loss"].mean()
            axes[0].plot(mean.index, mean.values, label=variant)
        axes[0].set(xlabel="step", ylabel="training loss", title=f"preset {self.preset}")
        for variant, prof in self.profiles.groupby("variant", sort=False):
            mean = prof.groupby("layer")["max_inf_norm"].mean()
            axes[1].semilogy(mean.index, mean.values, "o-", label=variant)
        axes[1].set(xlabel="layer", ylabel="max |activation| (block output)")
        axes[1].xaxis.get_major_locator().set_params(integer=True)
        axes[1].legend(fontsize=8)
        return axes[0].figure


def compare_variants(
    variants: Sequence[str] = ("softmax", "softmax1"),
    preset: Any = "cpu",
    seeds: Sequence[int] = (0,),
    *,
    out_dir: str | os.PathLike | None = None,
    until_step: int | None = None,
    progress: bool = True,
    measure_seqs: int = 8,
    **overrides: Any,
) -> Comparison:
    """Train every variant for every seed under one preset, then measure each model.

    With ``out_dir``, runs live in ``out_dir/<variant>/seed<seed>`` and resume there, so
    an interrupted comparison continues where it stopped. ``overrides`` are
    :class:`~massive_lens.train.presets.TrainConfig` fields applied to every run.
    """
    from massive_lens.quantize import measure_outliers
    from massive_lens.train.data import get_tokenizer, sample_batch, split_held_out, start_token, token_stream
    from massive_lens.train.model import MassiveLMConfig
    from massive_lens.train.presets import get_preset
    from massive_lens.train.trainer import train_model

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise MassiveLensError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    base = get_preset(preset, **overrides)
    tokenizer = get_tokenizer(base.tokenizer)
    stream = token_stream(base.data, tokenizer, base.max_chars)
    _, held_out = split_held_out(stream, base.model.get("n_ctx", MassiveLMConfig.n_ctx), base.val_fraction)
    bos = start_token(tokenizer, base.prepend_bos)
    runs, curves, profiles = [], [], []
    for variant in variants:
        for seed in seeds:
            cfg = get_preset(base.with_attention(variant), seed=seed)
            folder = None if out_dir is None else Path(out_dir) / variant / f"seed{seed}"
            t0 = time.perf_counter()
            run = train_model(cfg, out_dir=folder, until_step=until_step, progress=progress)
            seconds = time.perf_counter() - t0
            n_ctx = run.model.cfg.n_ctx
            tokens = sample_batch(held_out, 2 * measure_seqs, min(n_ctx, len(held_out) - 1),
                                  bos, seed=12345, step=0)
            report = measure_outliers(run.model, tokens)
            row = report.to_frame().iloc[0].to_dict()
            runs.append(dict(variant=variant, seed=seed, **row, val_loss=run.val_loss,
                             steps=run.steps, seconds=seconds))
            curves += [dict(variant=variant, seed=seed, step=h["step"], loss=h["loss"],
                            val_loss=h["val_loss"]) for h in run.history]
            profiles += [dict(variant=variant, seed=seed, **r) for r in report.layers.to_dict("records")]
            log.info("%s seed %d: %s", variant, seed, report.summary())
    name = preset if isinstance(preset, str) else "custom"
    return Comparison(name, pd.DataFrame(runs), pd.DataFrame(curves), pd.DataFrame(profiles))


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
    ``comparison.png`` into ``out_dir``.
    """
    names = variants.split(",") if isinstance(variants, str) else list(variants)
    seed_list = [int(s) for s in seeds.split(",")] if isinstance(seeds, str) else list(seeds)
    result = compare_variants([n.strip() for n in names], preset, seed_list, out_dir=out_dir,
                              until_step=until_step, progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.runs.to_csv(out / "runs.csv", index=False)
    result.to_frame().to_csv(out / "summary.csv")
    result.curves.to_csv(out / "curves.csv", index=False)
    result.profiles.to_csv(out / "profiles.csv", index=False)
    text = result.summary()
    (out / "summary.txt").write_text(text + "\n")
    import matplotlib

    matplotlib.use("Agg", force=False)
    result.plot().savefig(out / "comparison.png", dpi=120, bbox_inches="tight")
    return text
