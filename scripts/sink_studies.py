"""Issue 42's two studies on a real model, on WikiText-2 (ranked or calibrated on valid, evaluated on test):

    python scripts/sink_studies.py orders default 8    # head_curve, ranked orders -> docs/head_curve/<model>_orders/
    python scripts/sink_studies.py scaling default 8   # sink_scale_sweep (ZeroTuning) -> docs/sink_scaling/<model>/

``orders``: which head order (sink score, activation norm, weight magnitude, dormant-first) keeps
perplexity lowest at each share, with the paired interval against the runner-up (random heads are in
docs/head_curve/default, on the same sequences). ``scaling``: every head's attention to the first
token multiplied by each γ, perplexity and a copying task against γ = 1. Each prints its summary and
saves the result (massive_lens.load reads it back).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from massive_lens import load_model
from massive_lens.interventions import head_curve, sink_scale_sweep

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=("orders", "scaling"))
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("n_seqs", nargs="?", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model)
    start = time.perf_counter()
    if args.study == "orders":
        result = head_curve(model, WIKI / "test.txt", calibration=WIKI / "valid.txt", n_seqs=args.n_seqs,
                            seq_len=128, orders=("dormant", "sink", "activation", "weight"))
        out = ROOT / "docs" / "head_curve" / f"{args.model}_orders"
    else:
        result = sink_scale_sweep(model, WIKI / "test.txt", n_seqs=args.n_seqs, repeat_seqs=args.n_seqs)
        out = ROOT / "docs" / "sink_scaling" / args.model
    print(result.summary())
    print(f"{time.perf_counter() - start:.0f} s")
    result.save(out, overwrite=True)


if __name__ == "__main__":
    main()
