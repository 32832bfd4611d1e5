"""sink_dependence on one real model over WikiText-2 test: per sink head, its attention to the sinks,
the loss change without it (paired 95% interval over sequences) and its no-op / broadcast label.

Usage (from the checkout):

    python scripts/sink_dependence_run.py                                   # SmolLM2-135M-Instruct
    flock /tmp/ml_qwen.lock python scripts/sink_dependence_run.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from massive_lens import load_model
from massive_lens.interventions import sink_dependence

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
OUT = Path(__file__).resolve().parents[1] / "docs" / "interventions_arms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="load_model name (default: the offline default model)")
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-heads", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model) if args.model else load_model()
    start = time.perf_counter()
    dep = sink_dependence(model, str(DATA / "test.txt"), n_seqs=args.n_seqs, seq_len=args.seq_len,
                          max_heads=args.max_heads, progress=False)
    seconds = time.perf_counter() - start
    OUT.mkdir(parents=True, exist_ok=True)
    dep.to_frame().to_csv(OUT / f"dependence_{dep.model_name}.csv", index=False)
    print(dep.summary())
    print(f"[{seconds:.0f} s on this machine]")


if __name__ == "__main__":
    main()
