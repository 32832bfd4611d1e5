"""``python -m massive_lens.bench [--write FILE] [--repeats N] [--areas detect,origin,...]``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback

import torch

from massive_lens.bench import attention, detect, harness, origin, train
from massive_lens.core.corpora import token_batches
from massive_lens.core.model_view import ModelView
from massive_lens.models import load_model

AREAS = ("detect", "origin", "attention", "train")


def _tokens(model) -> torch.Tensor:
    return next(token_batches(ModelView(model), None, seq_len=detect.SEQ_LEN, batch_size=2 * detect.N_SEQS))


def _memory(spec: str) -> float:
    area, case = spec.split(":")
    if area != "detect":
        raise SystemExit(f"no memory cases in area {area!r}")
    model = load_model()
    tokens = _tokens(model)[: detect.N_SEQS]
    calls = detect.cases(model, tokens)
    detect.cases(model, tokens[:1, :8])["plain_forward"]()  # wire lazy state with a tiny pass
    return harness.peak_memory_of(calls[case])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m massive_lens.bench", description=harness.__doc__.splitlines()[0])
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per area (default 5)")
    parser.add_argument("--areas", default=",".join(AREAS), help=f"comma-separated, from {', '.join(AREAS)}")
    parser.add_argument("--write", default=None, help="write the table into this Markdown file")
    args = parser.parse_args(argv)
    if args.memory:
        print(json.dumps(_memory(args.memory)))
        return 0
    model = load_model()
    tokens = _tokens(model)
    runs = {"detect": lambda: detect.rows(model, tokens, args.repeats),
            "origin": lambda: origin.rows(model, tokens, args.repeats),
            "attention": lambda: attention.rows(model, tokens, args.repeats),
            "train": lambda: train.rows(repeats=args.repeats)}
    rows, failed = [], []
    for area in args.areas.split(","):
        try:
            rows += runs[area]()
        except Exception:  # a failing area is reported, never dropped silently
            failed.append(area)
            print(f"benchmark area {area!r} failed:\n{traceback.format_exc()}", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (f"Measured with `python -m massive_lens.bench --write docs/benchmarks.md` on {os.cpu_count()} CPU "
              f"cores ({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} threads, load "
              f"average {load:.1f} at the end; the default model ({ModelView(model).name}, float32). Each ratio is "
              f"the median time of the case over the median time of its baseline, interleaved in one run.")
    if failed:
        header += f"\n\n**Failed areas (see the log): {', '.join(failed)}.**"
    table = harness.to_markdown(rows, header)
    print(table)
    if args.write:
        with open(args.write, "w") as handle:
            handle.write("# Benchmarks\n\n" + table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
