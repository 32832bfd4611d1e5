"""Issue 42's sink scaling (ZeroTuning) on a real model: sink_scale_sweep on WikiText-2 test, every
head's attention to the first token multiplied by each γ, against γ = 1 on the same sequences.

    python scripts/sink_scaling.py default 8          # -> docs/sink_scaling/<model>/

Prints the summary (perplexity ratio and the repeated-random-token copying task's accuracy change,
each with a paired 95% interval; whether any γ helps) and saves the result.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from massive_lens import load_model
from massive_lens.interventions import sink_scale_sweep

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("n_seqs", nargs="?", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model)
    start = time.perf_counter()
    sweep = sink_scale_sweep(model, WIKI / "test.txt", n_seqs=args.n_seqs, repeat_seqs=args.n_seqs)
    print(sweep.summary())
    print(f"{time.perf_counter() - start:.0f} s")
    sweep.save(ROOT / "docs" / "sink_scaling" / args.model, overwrite=True)


if __name__ == "__main__":
    main()
