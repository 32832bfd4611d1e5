"""The sink-term rows of Table 3 at 128, 256 and 512 tokens, on the offline models
(docs/interventions.md, "The sink-term rows depend on the sequence length").

    python scripts/sink_term_lengths.py [--models default,qwen2.5-coder-1.5b] [--n-seqs 8]

Each length uses the same number of evaluation and calibration sequences, cut from the start of
WikiText-2 test and valid; calibration and evaluation share the length. Writes one CSV per
(model, length) into docs/interventions_lengths/ and prints the Markdown table the page shows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from massive_lens import load_model, run_interventions

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
OUT = ROOT / "docs" / "interventions_lengths"
SETTINGS = ["sink_term_zero", "sink_term_mean", "sink_attention_removed"]
LENGTHS = (128, 256, 512)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="default,qwen2.5-coder-1.5b")
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--table-only", action="store_true", help="print the table of the CSVs already written")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in [] if args.table_only else args.models.split(","):
        model = load_model(name)
        for seq_len in LENGTHS:
            table = run_interventions(model, str(DATA / "test.txt"), calibration=str(DATA / "valid.txt"),
                                      settings=["original", *SETTINGS], seq_len=seq_len, n_seqs=args.n_seqs,
                                      calibration_seqs=args.n_seqs, progress=False)
            frame = table.to_frame().assign(model=table.model_name, seq_len=seq_len)
            frame.to_csv(OUT / f"{name}_{seq_len}.csv", index=False)
            print(table.summary().splitlines()[0], flush=True)
        del model
    rows = pd.concat([pd.read_csv(p) for p in sorted(OUT.glob("*.csv"))], ignore_index=True)
    print("| model | tokens | original perplexity | " + " | ".join(SETTINGS) + " |")
    print("|---|---|---|" + "---|" * len(SETTINGS))
    for (model, seq_len), group in rows.groupby(["model", "seq_len"], sort=False):
        by = group.set_index("setting")
        original = float(by.at[SETTINGS[0], "perplexity"] / by.at[SETTINGS[0], "ratio"])  # the ratios' baseline
        cells = [f"x{by.at[s, 'ratio']:.3g} [{by.at[s, 'ratio_low']:.3g}, {by.at[s, 'ratio_high']:.3g}]"
                 for s in SETTINGS]
        print(f"| {model} | {seq_len} | {original:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
