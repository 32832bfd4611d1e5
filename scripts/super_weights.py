"""Super weights, verified, on a real model (docs/origin.md, "Super weights, verified").

Traces the massive activations of the first ``--trace-tokens`` tokens of WikiText-2's
validation text, then zeroes the top ``--top-k`` candidate weights per layer one at a time
(and the most damaging in pairs) and measures the loss on WikiText-2's test text, paired over
sequences. Prints both summaries and writes the candidates and pairs as CSV into ``--out``.

    python scripts/super_weights.py                                   # SmolLM2-135M-Instruct
    flock /tmp/ml_qwen.lock python scripts/super_weights.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from massive_lens import load_model, trace_origin
from massive_lens.origin import verify_super_weights

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a load_model name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--trace-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-seqs", type=int, default=16)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the model's own)")
    parser.add_argument("--out", default="docs/origin_super_weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype=dtype) if args.model else load_model(dtype=dtype)
    text = (DATA / "valid.txt").read_text(encoding="utf-8")
    ids = model.tokenizer(text[:20_000])["input_ids"][: args.trace_tokens]
    started = time.perf_counter()
    trace = trace_origin(model, torch.tensor(ids))
    print(trace.summary(), f"\n[trace: {time.perf_counter() - started:.1f} s]\n")
    started = time.perf_counter()
    check = verify_super_weights(model, trace, str(DATA / "test.txt"), top_k=args.top_k, pairs=args.pairs,
                                 seq_len=args.seq_len, n_seqs=args.n_seqs)
    print(check.summary(), f"\n[verification: {time.perf_counter() - started:.1f} s]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = check.model_name.replace("/", "_")
    check.candidates.to_csv(out / f"{slug}_candidates.csv", index=False, float_format="%.6g")
    check.pairs.to_csv(out / f"{slug}_pairs.csv", index=False, float_format="%.6g")


if __name__ == "__main__":
    main()
