"""Issue 42's sink-aware pruning on a real model: head_curve with every ranked order (sink score,
activation norm, weight magnitude, dormant-first), ranked on WikiText-2 valid, evaluated on test.

    python scripts/head_orders.py default 8          # -> docs/head_curve/<model>_orders/

Prints the summary (which order keeps perplexity lowest at each share, paired interval against the
runner-up) and saves the result beside docs/head_curve/default (massive_lens.load reads it back).
Random heads are left out: docs/head_curve/default has them, on the same sequences.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from massive_lens import load_model
from massive_lens.interventions import head_curve

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("n_seqs", nargs="?", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model)
    start = time.perf_counter()
    curve = head_curve(model, WIKI / "test.txt", calibration=WIKI / "valid.txt", n_seqs=args.n_seqs, seq_len=128,
                       orders=("dormant", "sink", "activation", "weight"))
    print(curve.summary())
    print(curve.best().to_string(index=False))
    print(f"{time.perf_counter() - start:.0f} s")
    name = "default" if args.model == "default" else args.model
    curve.save(ROOT / "docs" / "head_curve" / f"{name}_orders", overwrite=True)


if __name__ == "__main__":
    main()
