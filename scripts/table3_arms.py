"""Table 3 with every ablation arm (zero, mean, resample, noise, template) on one real model.

Usage (from the checkout; WikiText-2 test for evaluation, valid for calibration):

    python scripts/table3_arms.py                                  # SmolLM2-135M-Instruct
    flock /tmp/ml_qwen.lock python scripts/table3_arms.py --model qwen2.5-coder-1.5b --n-seqs 8 --arms-only

Prints the table's summary and writes its frame to docs/interventions_arms/<model>.csv.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from massive_lens import load_model, run_interventions
from massive_lens.interventions import SETTINGS

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
ARMS = ("original", "zero", "mean", "resample", "noise", "template", "control")
OUT = Path(__file__).resolve().parents[1] / "docs" / "interventions_arms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="load_model name (default: the offline default model)")
    parser.add_argument("--n-seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--arms-only", action="store_true",
                        help="only original and the massive-activation arms (zero, mean, resample, noise, "
                        "template, control)")
    args = parser.parse_args()
    model = load_model(args.model) if args.model else load_model()
    start = time.perf_counter()
    table = run_interventions(model, str(DATA / "test.txt"), calibration=str(DATA / "valid.txt"),
                              settings=ARMS if args.arms_only else SETTINGS, n_seqs=args.n_seqs, seq_len=args.seq_len,
                              calibration_seqs=args.n_seqs, progress=False)
    seconds = time.perf_counter() - start
    OUT.mkdir(parents=True, exist_ok=True)
    table.to_frame().to_csv(OUT / f"{table.model_name}.csv", index=False)
    print(table.summary())
    print(f"[{seconds:.0f} s on this machine]")


if __name__ == "__main__":
    main()
