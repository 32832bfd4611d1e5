"""Which attention path is faster at a length: each attention analysis with ``attention="eager"``
and ``attention="lse"``, CPU time against a plain forward (the model's own, logits included), on
the default model, interleaved in one interpreter (median of ROUNDS), for each length; the table
says which path was faster per analysis (what ``LSE_FROM`` in ``massive_lens.core.attention_pass``
is set from).

    OMP_NUM_THREADS=1 python -m benchmarks.path_crossover 512 3                          # LENGTH ROUNDS; JSON
    OMP_NUM_THREADS=1 python -m benchmarks.path_crossover --lengths 384,512,768 --rounds 3  # JSON lines, table
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.harness import median_times

ANALYSES = ("find_sinks", "sink_attention", "sink_census", "dormant_heads", "decompose")


def main(length: int, rounds: int, model: object = None) -> dict:
    from massive_lens import load_model
    from massive_lens.attention import decompose_attention, dormant_heads, find_sinks, sink_attention, sink_census
    from massive_lens.core.corpora import token_batches
    from massive_lens.core.model_view import ModelView

    torch.set_num_threads(1)
    model = model or load_model()
    tokens = next(token_batches(ModelView(model), None, seq_len=length, batch_size=1))[:1, :length]

    def forward() -> None:
        with torch.no_grad():
            model(tokens)

    cases = {"forward": forward}
    for name, fn in zip(ANALYSES, (find_sinks, sink_attention, sink_census, dormant_heads, decompose_attention),
                        strict=True):
        for path in ("eager", "lse"):
            cases[f"{name} {path}"] = lambda fn=fn, path=path: fn(model, tokens, attention=path)
    s = median_times(cases, rounds, clock=time.process_time)
    return {"length": length, "cpu_seconds": s, "ratios": {k: s[k] / s["forward"] for k in s}}


def table(runs: list[dict]) -> str:
    """Per length and analysis: eager and LSE ratios to the forward, and the faster path."""
    lines = ["| length | " + " | ".join(f"{a} (eager, lse)" for a in ANALYSES) + " | faster on lse |",
             "|---|" + "---|" * (len(ANALYSES) + 1)]
    for run in runs:
        r = run["ratios"]
        cells = [f"{r[f'{a} eager']:.2f}, {r[f'{a} lse']:.2f}" for a in ANALYSES]
        faster = sum(r[f"{a} lse"] < r[f"{a} eager"] for a in ANALYSES)
        lines.append(f"| {run['length']} | " + " | ".join(cells) + f" | {faster} of {len(ANALYSES)} |")
    return "\n".join(lines) + "\n"


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.path_crossover", description=__doc__.splitlines()[0])
    parser.add_argument("length", nargs="?", type=int, help="one length (prints its JSON)")
    parser.add_argument("rounds", nargs="?", type=int, default=3)
    parser.add_argument("--lengths", default=None, help="comma-separated lengths, one model load (JSON lines, table)")
    parser.add_argument("--rounds", dest="rounds_opt", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds_opt or args.rounds
    if args.lengths is None:
        if args.length is None:
            parser.error("give LENGTH or --lengths")
        print(json.dumps(main(args.length, rounds), indent=1))
        return 0
    from massive_lens import load_model

    model, runs = load_model(), []
    for length in map(int, args.lengths.split(",")):
        runs.append(main(length, rounds, model))
        print(json.dumps(runs[-1]), flush=True)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
