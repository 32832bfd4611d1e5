"""Cost against sequence length: the time and peak memory of each analysis, and of a plain
forward pass, on one model, for each length (one fresh interpreter per length).

Memory is the peak resident memory an analysis adds above the loaded model (the high-water
mark is reset before each analysis and the allocator trimmed, as in :mod:`benchmarks.harness`).
Time is one call's process CPU time (all threads) after one warm-up call at 32 tokens (with
``--repeats``, the median of that many calls a row, the rows called in turn): on
a shared machine it is less sensitive to the load than wall time, which is kept in the JSON;
the plain forward of the same run is the yardstick. ``plain_forward x2``
and ``find_massive x2`` read two sequences of the length: memory should stay flat in the
number of sequences for the analyses that reduce inside their hooks.

    python -m benchmarks.length --lengths 128,256,512,1024,2048 --out runs/length.json \\
        --figure docs/img/length.png
    python -m benchmarks.length --length 512    # one length in this process (prints JSON)
    python -m benchmarks.length --lengths 2048 --fresh --only "plain_forward (SDPA),sink_kv"  # a process a row
    python -m benchmarks.length --lengths 4096 --repeats 3 --only "plain_forward (SDPA),sink_kv"  # medians of 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import ROOT, peak_memory_of, resident_mb

LENGTHS = (128, 256, 512, 1024, 2048)


def analyses(model: Any, one: torch.Tensor, two: torch.Tensor, hooks: Any) -> dict[str, Callable[[], Any]]:
    """The analyses on one sequence ``one`` (``two``: two sequences of the same length)."""
    import massive_lens as ml
    from massive_lens.attention import dormant_heads, find_sinks, sink_circuit, sink_kv
    from massive_lens.core.lse import lse_run
    from massive_lens.core.model_view import ModelView
    from massive_lens.effects import compression_valley
    from massive_lens.handover import offswitch
    from massive_lens.interventions import sink_dependence, sink_strength

    def forward(tokens: torch.Tensor) -> Callable[[], Any]:
        def call() -> None:
            with torch.no_grad():
                model(tokens)
        return call

    def sdpa_forward(tokens: torch.Tensor = one) -> None:  # the LSE path's yardstick: transformers' own SDPA
        with lse_run(ModelView(model), implementation="sdpa"), torch.no_grad():
            model(tokens)

    return {
        "plain_forward": forward(one),
        "plain_forward (SDPA)": lambda: sdpa_forward(one),
        "plain_forward x2": forward(two),
        "plain_forward x2 (SDPA)": lambda: sdpa_forward(two),
        "find_massive": lambda: ml.find_massive(model, one),
        "find_massive x2": lambda: ml.find_massive(model, two),
        "scan_corpus": lambda: ml.scan_corpus(model, one, seq_len=one.shape[1], batch_size=1, max_tokens=None,
                                              progress=False),
        "trace_origin": lambda: ml.trace_origin(model, one),
        "sink_attention": lambda: ml.sink_attention(model, one),
        "decompose_attention": lambda: ml.decompose_attention(model, one),
        "sink_census": lambda: ml.sink_census(model, one),
        "sink_circuit": lambda: sink_circuit(model, one),
        "find_sinks": lambda: find_sinks(model, one),
        "dormant_heads": lambda: dormant_heads(model, one),
        "sink_kv": lambda: sink_kv(model, one),
        "sink_kv (given)": lambda: sink_kv(model, one, sinks=[0]),
        "sink_attention (eager)": lambda: ml.sink_attention(model, one, attention="eager"),
        "sink_census (eager)": lambda: ml.sink_census(model, one, attention="eager"),
        "perplexity": lambda: ml.perplexity(model, one, progress=False),
        "intervention perplexity": lambda: ml.perplexity(model, one, hooks=hooks, progress=False),
        "measure_outliers (W8A8)": lambda: ml.measure_outliers(model, two),
        "offswitch": lambda: offswitch(model, one, precision=False),
        "sink_strength": lambda: sink_strength(model, one, pos=[0, 1]),
        "sink_dependence x2 (untouched pass)": lambda: sink_dependence(model, two, heads=[], seq_len=two.shape[1],
                                                                       n_seqs=2, progress=False),
        "compression_valley": lambda: compression_valley(model, one, seq_len=one.shape[1], n_seqs=1, ablate=None),
    }


def run_length(model_name: str, length: int, only: list[str] | None = None, repeats: int = 1) -> list[dict[str, Any]]:
    from massive_lens.core.corpora import token_batches
    from massive_lens.core.model_view import ModelView
    from massive_lens.interventions import calibrate, fix_sink_term
    from massive_lens.models.load import load_model

    model = load_model(model_name)
    view = ModelView(model)
    tokens = next(token_batches(view, None, seq_len=length, batch_size=3))
    calib = calibrate(model, tokens[2:, :128], seq_len=128, n_seqs=1, progress=False)
    hooks = fix_sink_term(model, "mean", calibration=calib)
    calls = analyses(model, tokens[:1], tokens[:2], hooks)
    small = analyses(model, tokens[:1, :32], tokens[:2, :32], hooks)
    names = [name for name in calls if not only or name in only]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for name in names:
        small[name]()  # warm-up: lazy imports and state, at 32 tokens
    for _ in range(repeats):  # the rows in turn, so that a slow spell of the machine falls on each alike
        for name in names:
            resident_mb()  # collect and trim what the warm-up or the row before freed
            cpu, wall = time.process_time(), time.perf_counter()
            peak = peak_memory_of(calls[name])
            runs[name].append({"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
                               "peak_mb": peak})
            print(json.dumps({"analysis": name, **runs[name][-1]}), file=sys.stderr, flush=True)
    return [{"model": view.name, "analysis": name, "length": length, "repeats": repeats,
             **{key: statistics.median(run[key] for run in runs[name]) for key in runs[name][0]},
             "cpu_runs": [run["cpu_seconds"] for run in runs[name]]} for name in names]


def table(rows: list[dict[str, Any]]) -> str:
    lengths = sorted({r["length"] for r in rows})
    names = list(dict.fromkeys(r["analysis"] for r in rows))
    at = {(r["analysis"], r["length"]): r for r in rows}
    head = "| analysis | " + " | ".join(f"{n} tokens" for n in lengths) + " | time growth | memory growth |"
    lines = [head, "|---|" + "---|" * (len(lengths) + 2)]
    for name in names:
        cells = []
        for n in lengths:
            r = at.get((name, n))
            cells.append(f"{r['cpu_seconds']:.2f} s, {r['peak_mb']:.0f} MB" if r else "-")
        first, last = at.get((name, lengths[0])), at.get((name, lengths[-1]))
        growth = ["-", "-"]
        if first and last and len(lengths) > 1:
            growth = [f"{last['cpu_seconds'] / max(first['cpu_seconds'], 1e-9):.1f}x",
                      f"{last['peak_mb'] / max(first['peak_mb'], 1e-9):.1f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {growth[0]} | {growth[1]} |")
    return "\n".join(lines) + "\n"


def versus(rows: list[dict[str, Any]], base: str = "plain_forward (SDPA)") -> str:
    """Each analysis's time and memory as multiples of ``base`` of the same length (the issue's
    yardstick for the LSE path: a plain forward of the model on transformers' own SDPA)."""
    lengths = sorted({r["length"] for r in rows})
    at = {(r["analysis"], r["length"]): r for r in rows}
    lines = [f"| analysis / {base} | " + " | ".join(f"{n} tokens (time, memory)" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name in dict.fromkeys(r["analysis"] for r in rows):
        cells = []
        for n in lengths:
            r, b = at.get((name, n)), at.get((base, n))
            cells.append(f"{r['cpu_seconds'] / b['cpu_seconds']:.2f}x, {r['peak_mb'] / max(b['peak_mb'], 1e-9):.2f}x"
                         if r and b else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["analysis"] for r in rows):
        mine = sorted((r for r in rows if r["analysis"] == name), key=lambda r: r["length"])
        style = dict(lw=2.5, color="black") if name == "plain_forward" else dict(lw=1.2)
        ax_t.plot([r["length"] for r in mine], [r["cpu_seconds"] for r in mine], marker="o", ms=3, label=name, **style)
        ax_m.plot([r["length"] for r in mine], [r["peak_mb"] for r in mine], marker="o", ms=3, **style)
    for ax, label in ((ax_t, "CPU seconds (one call)"), (ax_m, "peak MB above the loaded model")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel=label)
        ax.grid(alpha=0.3, which="both")
    ax_t.legend(fontsize=7)
    fig.suptitle(f"{rows[0]['model']}: cost against sequence length (plain forward in black)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.length", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--length", type=int, default=None, help="run one length here and print its JSON")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--only", default=None, help="comma-separated analyses (default: all)")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    parser.add_argument("--figure", default=None, help="draw the figure into this PNG")
    parser.add_argument("--repeats", type=int, default=1,
                        help="calls of each row, in turn, in one process: the median time and memory (default 1)")
    parser.add_argument("--fresh", action="store_true",
                        help="each analysis of --only in a process of its own (a row's peak then owes nothing to "
                             "what the rows before it left in the process)")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    if args.fresh and not only:
        parser.error("--fresh needs --only: the analyses to run, each in a process of its own")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.length:
        print(json.dumps(run_length(args.model, args.length, only, args.repeats)))
        return 0
    rows = []
    for length in map(int, args.lengths.split(",")):
        cmd = [sys.executable, "-m", "benchmarks.length", "--model", args.model, "--length", str(length),
               "--repeats", str(args.repeats)]
        for part in [[name] for name in only] if args.fresh else [only] if only else [None]:
            out = subprocess.run(cmd + (["--only", ",".join(part)] if part else []), capture_output=True, text=True,
                                 check=False, cwd=ROOT)
            if out.returncode != 0:
                print(f"length {length} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                continue
            rows += json.loads(out.stdout.strip().splitlines()[-1])
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(rows, handle, indent=1)
    print(table(rows))
    if any(r["analysis"] == "plain_forward (SDPA)" for r in rows):
        print(versus(rows))
    if args.figure and rows:
        figure(rows, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
