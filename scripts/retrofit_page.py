"""Regenerate docs/retrofit.md's tables, answer list and figures from the committed result folders.

    .venv/bin/python scripts/retrofit_page.py            # rewrite the page's generated blocks and figures
    .venv/bin/python scripts/retrofit_page.py --check    # exit 1 if the page differs from the folders

Every run folder ``docs/retrofit/seeds/<setting>_seed<s>/`` holds ``result`` (a ``Retrofit``), and
once measured ``outliers`` (``measure_outliers``) and ``lowbit`` (``lowbit_grid``); all are read with
``massive_lens.load``. A run counts in the end-of-run tables only if it reached its last step.
Intervals are 95% Student-t intervals over seeds (``mean +- t * sd / sqrt(n)``); a difference
between two settings is paired by seed (the same batches) and is *shown* only if its interval
excludes zero. The generated text sits between ``<!-- gen:NAME -->`` and ``<!-- /gen:NAME -->``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

import massive_lens  # noqa: E402
from massive_lens.train.retrofit import RETROFIT_SETTINGS, Retrofit  # noqa: E402
from massive_lens.train.taskpage import fill  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs/retrofit/seeds"
PAGE = ROOT / "docs/retrofit.md"
FIGURES = ROOT / "docs/retrofit"
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]  # Student t, df 1..10
# (label, setting, baseline): each difference is setting minus baseline, paired by seed
PAIRS = [("softmax1 vs softmax (removed)", "softmax1-removed", "softmax-removed"),
         ("kv_bias vs softmax (removed)", "kv_bias-removed", "softmax-removed"),
         ("learned_sink vs softmax (removed)", "learned_sink-removed", "softmax-removed"),
         ("softmax1 vs softmax (removed, held)", "softmax1-removed-held", "softmax-removed-held"),
         ("removal under softmax (vs kept)", "softmax-removed", "softmax-kept")]
QUANTITIES = [("val_loss", "held-out loss at the end (nats)"),
              ("first_max", "first token's largest absolute value in the traced dims"),
              ("dims_max", "largest absolute value of the traced dims anywhere"),
              ("first_mass", "attention on the first token"),
              ("w8a8_gap", "W8A8 gap, static per-tensor activations (nats)"),
              ("mean_kurtosis", "mean kurtosis of the block outputs"),
              ("W8A8", "W8A8 gap, per-token activations (nats)"),
              ("W4A16", "W4A16 gap (nats)"),
              ("W4A4", "W4A4 gap, per-token activations (nats)")]


def interval(values: pd.Series) -> tuple[float, float, float, int]:
    """Mean, 95% t-interval low and high, and n (no interval below two values: NaN)."""
    v = values.dropna().astype(float)
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    if n < 2:
        return float(v.mean()), math.nan, math.nan, 1
    half = T975[min(n - 1, len(T975)) - 1] * float(v.std(ddof=1)) / math.sqrt(n)
    return float(v.mean()), float(v.mean()) - half, float(v.mean()) + half, n


def fmt(x: float) -> str:
    """A number at a precision that suits its size."""
    if math.isnan(x):
        return "-"
    a = abs(x)
    return f"{x:,.0f}" if a >= 100 else f"{x:.3f}"


def cell(values: pd.Series) -> str:
    mean, low, high, n = interval(values)
    if n == 0:
        return ""
    return fmt(mean) + (f" [{fmt(low)}, {fmt(high)}]" if n > 1 else "") + f" (n={n})"


def load_runs(folder: Path = RUNS) -> tuple[Retrofit, pd.DataFrame]:
    """The merged result of every run folder and one row per run with the end-of-run readings
    (``complete``: it reached its last step; the W8A8 and low-bit columns where measured)."""
    results, extra = [], []
    for run in sorted(folder.glob("*/result")):
        result = massive_lens.load(run)
        results.append(result)
        row = dict(setting=result.curves.setting.iloc[0], seed=int(result.curves.seed.iloc[0]),
                   target=int(result.budget["steps"]), wall_s=int(result.budget.get("wall_s", 0)))
        if (run.parent / "outliers").is_dir() and (run.parent / "lowbit").is_dir():
            report, grid = massive_lens.load(run.parent / "outliers"), massive_lens.load(run.parent / "lowbit")
            row.update(w8a8_gap=report.gap, mean_kurtosis=report.totals["mean_kurtosis"],
                       fp_loss_quant=grid.fp_loss, **grid.gaps())
        extra.append(row)
    merged = Retrofit.merge(*results)
    frame = merged.to_frame().merge(pd.DataFrame(extra), on=["setting", "seed"])
    frame["complete"] = frame.steps == frame.target
    return merged, frame


def ordered(settings: list[str]) -> list[str]:
    return [s for s in RETROFIT_SETTINGS if s in settings] + sorted(s for s in settings if s not in RETROFIT_SETTINGS)


def runs_table(frame: pd.DataFrame) -> str:
    lines = ["| setting | seed: steps reached / planned, wall time of the training |", "|---|---|"]
    for s in ordered(list(frame.setting.unique())):
        rows = frame[frame.setting == s].sort_values("seed")
        lines.append(f"| {s} | " + "; ".join(f"{r.seed}: {r.steps}/{r.target}, {r.wall_s / 60:.0f} min"
                                             for r in rows.itertuples()) + " |")
    missing = [s for s in RETROFIT_SETTINGS if s not in set(frame.setting)]
    if missing:
        lines += ["", "Not run yet: " + ", ".join(f"`{s}`" for s in missing) + "."]
    return "\n".join(lines)


def curve_table(merged: Retrofit) -> str:
    curves = merged.curves.dropna(subset=["val_loss"])
    settings = ordered(list(curves.setting.unique()))
    lines = ["| step | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for step in sorted(curves.step.unique()):
        at = curves[curves.step == step]
        lines.append(f"| {step} | " + " | ".join(cell(at[at.setting == s].val_loss) for s in settings) + " |")
    return "\n".join(lines)


def end_table(frame: pd.DataFrame) -> str:
    done = frame[frame.complete]
    if done.empty:
        return "No run has reached its last step yet."
    settings = ordered(list(done.setting.unique()))
    lines = ["| reading | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for column, label in [("val_loss_start", "held-out loss at step 0 (nats)"), *QUANTITIES[:4],
                          ("slot_mass", "attention on the slot"), *QUANTITIES[4:]]:
        if column in done:
            lines.append(f"| {label} | " + " | ".join(cell(done[done.setting == s][column]) for s in settings) + " |")
    return "\n".join(lines)


def differences(frame: pd.DataFrame) -> pd.DataFrame:
    """Setting minus baseline, paired by seed, for every pair and quantity with two or more seeds."""
    done = frame[frame.complete].set_index(["setting", "seed"])
    rows = []
    for label, setting, base in PAIRS:
        if setting not in done.index.get_level_values(0) or base not in done.index.get_level_values(0):
            continue
        for column, what in QUANTITIES:
            if column not in done:
                continue
            diff = (done.loc[setting][column] - done.loc[base][column]).dropna()
            mean, low, high, n = interval(diff)
            if n >= 2:
                shown = low > 0 or high < 0
                rows.append(dict(pair=label, quantity=what, mean=mean, low=low, high=high, n=n, shown=shown))
    return pd.DataFrame(rows, columns=["pair", "quantity", "mean", "low", "high", "n", "shown"])


def diff_table(diffs: pd.DataFrame) -> str:
    lines = ["| comparison | reading | difference [95% interval] | seeds | verdict |", "|---|---|---|---|---|"]
    for r in diffs.itertuples():
        verdict = ("shown: higher" if r.low > 0 else "shown: lower") if r.shown else "not shown"
        lines.append(f"| {r.pair} | {r.quantity} | {fmt(r.mean)} [{fmt(r.low)}, {fmt(r.high)}] | {r.n} | {verdict} |")
    return "\n".join(lines)


def answer(diffs: pd.DataFrame, frame: pd.DataFrame) -> str:
    done = frame[frame.complete]
    seeds = done.groupby("setting").seed.nunique()
    per_setting = ", ".join(f"{s}: {seeds[s]}" for s in ordered(list(seeds.index))) or "none"
    head = f"Runs that reached their last step: {len(done)} of {len(frame)} started (seeds per setting: {per_setting})."
    shown = [f"- **{r.pair}**, {r.quantity}: {fmt(r.mean)} [{fmt(r.low)}, {fmt(r.high)}] ({r.n} seeds)"
             for r in diffs[diffs.shown].itertuples()]
    not_shown = [f"{r.pair}: {r.quantity}" for r in diffs[~diffs.shown].itertuples()]
    text = [head, "", "Shown (the 95% interval of the paired difference excludes zero):", ""]
    text += shown or ["- nothing yet"]
    text += ["", "Not shown (the interval includes zero): " + ("; ".join(not_shown) if not_shown else "none") + "."]
    return "\n".join(text)


def figures(merged: Retrofit, frame: pd.DataFrame, out: Path = FIGURES) -> None:
    """loss.png (held-out loss, mean and interval band), activations.png, lowbit.png."""
    curves = merged.curves.dropna(subset=["val_loss"])
    peak = merged.per_layer.groupby(["setting", "seed", "step"])[["first_max", "dims_max"]].max().reset_index()
    panels = (("loss", curves, "val_loss", "held-out loss (nats)", False),
              ("activations", peak, "first_max", "first token's largest abs. value, traced dims", True))
    for name, data, column, title, log in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in ordered(list(data.setting.unique())):
            stats = [(step, *interval(g[column])) for step, g in data[data.setting == s].groupby("step")]
            steps, mean, low, high = (list(c) for c in list(zip(*stats, strict=True))[:4])
            ax.plot(steps, mean, label=s)
            ax.fill_between(steps, low, high, alpha=0.15)
        ax.set(xlabel="step", ylabel=title, title=f"{merged.model_name}: retrofit, mean and 95% interval over seeds")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
    done = frame[frame.complete]
    grid = [c for c in ("W8A8", "W4A16", "W4A4") if c in done]
    fig, ax = plt.subplots(figsize=(7, 4))
    if not grid:
        ax.text(0.5, 0.5, "no measured run yet", ha="center", va="center")
    else:
        settings = ordered(list(done.dropna(subset=grid).setting.unique()))
        for i, s in enumerate(settings):
            stats = [interval(done[done.setting == s][c]) for c in grid]
            xs = [j + i / (len(settings) + 1) for j in range(len(grid))]
            ax.bar(xs, [m for m, *_ in stats], width=1 / (len(settings) + 1), label=s,
                   yerr=[[m - lo if n > 1 else 0 for m, lo, _, n in stats], [hi - m if n > 1 else 0
                                                                             for m, _, hi, n in stats]])
        ax.set_xticks([j + 0.4 for j in range(len(grid))], grid)
        ax.legend(fontsize=7)
    ax.set(ylabel="loss - full-precision loss (nats)", title="round-to-nearest fake quantization at the end")
    fig.savefig(out / "lowbit.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def reference(folder: Path = RUNS.parent / "untouched") -> str:
    """One line on the untouched model, measured as the runs are (one measurement, no interval)."""
    if not (folder / "lowbit").is_dir():
        return "The untouched model has not been measured yet."
    report, grid = massive_lens.load(folder / "outliers"), massive_lens.load(folder / "lowbit")
    gaps = ", ".join(f"{k} {fmt(v)}" for k, v in grid.gaps().items())
    return (f"The untouched model (no removal, no fine-tuning) on the same windows: loss {fmt(grid.fp_loss)}; "
            f"W8A8 gap (static per-tensor activations) {fmt(report.gap)}; mean kurtosis "
            f"{fmt(report.totals['mean_kurtosis'])}; per-token grid gaps: {gaps} (nats).")


def blocks(folder: Path = RUNS) -> dict[str, str]:
    """The page's generated blocks, by name, from the run folders."""
    merged, frame = load_runs(folder)
    diffs = differences(frame)
    return dict(answer=answer(diffs, frame), runs=runs_table(frame), curves=curve_table(merged),
                end=end_table(frame), reference=reference(folder.parent / "untouched"), differences=diff_table(diffs))


def main(argv: list[str]) -> int:
    generated = blocks()
    page = PAGE.read_text()
    new = fill(page, generated)
    if "--check" in argv:
        return 0 if new == page else 1
    PAGE.write_text(new)
    merged, frame = load_runs()
    figures(merged, frame)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
