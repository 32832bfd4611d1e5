"""Does an off-switch make 4 bits easier? The low-bit grid on retrofitted SmolLM2 models.

    .venv/bin/python scripts/quantize_retrofit.py measure MODELS [JOB ...]  # grid per saved model
    .venv/bin/python scripts/quantize_retrofit.py table                      # the paired table

``MODELS`` is the folder ``scripts/retrofit_runs.sh`` saves models into (``--save-models``, a local
run output: ``runs/retrofit_models``); each ``JOB`` a subfolder ``<setting>_seed<s>`` (default:
all). Each model is measured on a bridge that computes its attention variant, held dims held
(:func:`~massive_lens.train.retrofit_parts.analysis_bridge`), with
:func:`~massive_lens.quant.quantize_grid` over ``SETTINGS`` on the windows of
``scripts/retrofit_lowbit.py``: 8 windows of 128 tokens of WikiText-2 test (BOS first), the first
4 evaluated, the other 4 calibrate. One JSON per model goes to ``docs/quantization/retrofit/``
(the grid's rows and the full-precision loss).

``table`` prints, per setting, each group's gap (mean [95% t-interval] over seeds) and the
difference softmax1 minus softmax paired by seed, with the interval helper of
``scripts/retrofit_page.py`` (a difference is *shown* only if its interval excludes zero).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrofit_lowbit import SEED, SEQ_LEN, SEQS  # noqa: E402
from retrofit_page import fmt, interval  # noqa: E402

from massive_lens.core.corpora import data_file  # noqa: E402
from massive_lens.quant import quantize_grid  # noqa: E402
from massive_lens.train.data import sample_batch, start_token, token_stream  # noqa: E402
from massive_lens.train.retrofit_parts import analysis_bridge, load_retrofitted  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs/quantization/retrofit"
SETTINGS = ("W4A16", "W4A4", "W4A4+hadamard", "W4A4+hadamard+kvsink", "W8A8@tensor")
PAIR = ("softmax1-removed-held", "softmax-removed-held")  # setting minus baseline, paired by seed
COLUMNS = ["setting", "loss", "gap", "gap_low", "gap_high", "err_sink", "err_other", "max_abs", "kurtosis",
           "rotation_error"]


def measure(models: Path, job: str) -> None:
    hf, tokenizer, meta = load_retrofitted(models / job)
    hold = (meta["dims"], meta["hold_start"]) if meta.get("hold_start") is not None else None
    bridge = analysis_bridge(hf, tokenizer, hold=hold, name=job)
    del hf
    held = token_stream(data_file("wikitext-2/test.txt"), tokenizer)
    tokens = sample_batch(held, SEQS, SEQ_LEN, start_token(tokenizer), seed=SEED, step=0)
    half = SEQS // 2
    grid = quantize_grid(bridge, tokens[:half], calibration=tokens[half:], settings=SETTINGS, seq_len=SEQ_LEN,
                         n_seqs=half)
    print(grid.summary(), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    frame = grid.to_frame()[COLUMNS]
    record = dict(job=job, setting=meta["setting"], seed=int(meta["seed"]), variant=meta.get("variant"),
                  fp_loss=grid.fp_loss, n_seqs=half, seq_len=SEQ_LEN, rows=frame.to_dict("records"))
    (OUT / f"{job}.json").write_text(json.dumps(record, indent=1) + "\n")


def load(folder: Path = OUT) -> pd.DataFrame:
    """One row per (model, low-bit setting): ``run`` (the retrofit setting), ``seed``, ``fp_loss``
    and the grid's columns."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        rows += [dict(run=record["setting"], seed=record["seed"], fp_loss=record["fp_loss"], **r)
                 for r in record["rows"]]
    return pd.DataFrame(rows)


def cell(values: pd.Series) -> str:
    mean, low, high, n = interval(values)
    return "" if n == 0 else fmt(mean) + (f" [{fmt(low)}, {fmt(high)}]" if n > 1 else "") + f" (n={n})"


def table(frame: pd.DataFrame) -> str:
    """The Markdown table: the gap per group and setting, and the paired difference."""
    runs = [r for r in (*PAIR, "softmax-kept") if r in set(frame.run)]
    lines = ["| low-bit setting | " + " | ".join(f"{r} gap (nats)" for r in runs)
             + f" | {PAIR[0]} minus {PAIR[1]} (paired by seed) | verdict |",
             "|---|" + "---|" * (len(runs) + 2)]
    fp = frame.drop_duplicates(["run", "seed"])
    rows = [("full-precision loss", {r: fp[fp.run == r].set_index("seed").fp_loss for r in runs})]
    for setting in frame.setting.drop_duplicates():
        at = frame[frame.setting == setting]
        rows.append((setting, {r: at[at.run == r].set_index("seed").gap for r in runs}))
    for label, by_run in rows:
        diff = (by_run.get(PAIR[0], pd.Series(dtype=float)) - by_run.get(PAIR[1], pd.Series(dtype=float))).dropna()
        mean, low, high, n = interval(diff)
        shown = n > 1 and (low > 0 or high < 0)
        verdict = ("shown: " + ("higher" if mean > 0 else "lower")) if shown else "not shown"
        lines.append(f"| {label} | " + " | ".join(cell(by_run[r]) for r in runs)
                     + f" | {cell(diff)} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["measure"] and len(argv) >= 2:
        torch.set_num_threads(1)
        models = Path(argv[1])
        jobs = argv[2:] or sorted(p.parent.name for p in models.glob("*/retrofit.json"))
        for job in jobs:
            measure(models, job)
        return 0
    if argv == ["table"]:
        print(table(load()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
