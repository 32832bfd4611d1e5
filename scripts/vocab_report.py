"""The quick report's peak memory on a 262k-vocabulary tiny llama, over its weights (docs/benchmarks.md,
"Large vocabularies"): peak resident memory while the report ran, less the interpreter and its imports
before the model was built, over ``weight_bytes``. With ``--warm`` a small tiny llama is built and its
quick report written first, so lazily imported modules count as libraries.

    python scripts/vocab_report.py [--warm] [--vocab 262144] [--width 64] [--layers 4]

``--width 1024 --layers 2`` gives a real-size large-vocabulary shape: a 262k x 1024 embedding and
unembedding (2 GiB of float32 weights, as in a Gemma-3-1B-sized vocabulary) over a shallow stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks`
from benchmarks.harness import resident_mb
from massive_lens import tiny_model
from massive_lens.core.budget import trim_allocator, weight_bytes
from massive_lens.report import write_report
from massive_lens.report.memory import PeakMemory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", action="store_true", help="run a small tiny llama's quick report first")
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--width", type=int, default=64, help="hidden size (the tiny llama's default: 64)")
    parser.add_argument("--layers", type=int, default=4, help="layers (the tiny llama's default: 4)")
    args = parser.parse_args()
    if args.warm:
        with tempfile.TemporaryDirectory() as out:
            write_report(tiny_model("llama"), quick=True, out_dir=out, progress=False)
    trim_allocator()
    libraries = resident_mb() * 2**20
    shape = {} if (args.width, args.layers) == (64, 4) else dict(
        hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers)
    model = tiny_model("llama", vocab_size=args.vocab, **shape)
    with tempfile.TemporaryDirectory() as out, PeakMemory() as peak:
        write_report(model, quick=True, out_dir=out, progress=False)
    weights = weight_bytes(model)
    mb = 2**20
    print(json.dumps(dict(ratio=round((peak.peak_bytes - libraries) / weights, 3), peak_mb=round(peak.peak_bytes / mb),
                          libraries_mb=round(libraries / mb), weights_mb=round(weights / mb), warm=args.warm,
                          width=args.width, layers=args.layers, vocab=args.vocab)))


if __name__ == "__main__":
    main()
