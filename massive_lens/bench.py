"""Performance measurements, as ratios taken in one run (these machines are shared and noisy).

Each analysis is timed against a plain forward pass of the same model on the same tokens,
the cases interleaved and repeated, the median kept; peak memory is measured in a fresh
subprocess per case (peak resident memory above the level after loading the model).

    python -m massive_lens.bench                 # prints the table
    python -m massive_lens.bench --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

N_SEQS, SEQ_LEN = 4, 512
CASES = ("plain_forward", "find_massive", "scan_corpus", "run_with_cache")
EXTRA_BENCHES = (  # (module, function): optional benches of other modules, rows of dicts
    ("massive_lens._bench_origin", "bench_origin"),
    ("massive_lens._bench_attention", "bench_attention"),
    ("massive_lens.train.bench_train", "bench_training"),
)


def _setup() -> tuple[Any, torch.Tensor]:
    from massive_lens._model_view import ModelView
    from massive_lens.corpora import token_batches
    from massive_lens.models import load_model

    model = load_model()
    tokens = next(token_batches(ModelView(model), None, seq_len=SEQ_LEN, batch_size=N_SEQS))
    return model, tokens


def _case(name: str, model: Any, tokens: torch.Tensor) -> Callable[[], Any]:
    from massive_lens.detect import find_massive, scan_corpus

    def plain():
        with torch.no_grad():
            return model(tokens)

    def naive():  # what a notebook would do: cache everything, then reduce
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
        return [cache[f"blocks.{i}.hook_resid_post"].abs().amax() for i in range(model.cfg.n_layers)]

    return {
        "plain_forward": plain,
        "find_massive": lambda: find_massive(model, tokens),
        "scan_corpus": lambda: scan_corpus(model, tokens, seq_len=SEQ_LEN, batch_size=N_SEQS,
                                           max_tokens=None, progress=False),
        "run_with_cache": naive,
    }[name]


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) / 1024


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]) / 1024


def memory_of(name: str) -> float:
    """Peak resident memory (MB) one call of ``name`` adds, in this (fresh) process."""
    model, tokens = _setup()
    _case("plain_forward", model, tokens[:1, :8])()  # wire lazy state with a tiny pass
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak (VmHWM) to the current resident size
    base = _rss_mb()
    _case(name, model, tokens)()
    return _peak_rss_mb() - base


def time_cases(repeats: int = 5) -> dict[str, float]:
    """Median seconds per case, the cases interleaved so load changes hit all alike."""
    model, tokens = _setup()
    calls = {name: _case(name, model, tokens) for name in CASES}
    for call in calls.values():
        call()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_detection(repeats: int = 5) -> list[dict[str, Any]]:
    seconds = time_cases(repeats)
    memory = {}
    for name in CASES:
        out = subprocess.run([sys.executable, "-m", "massive_lens.bench", "--memory", name],
                             capture_output=True, text=True, check=True)
        memory[name] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for name, goal in (("find_massive", 1.10), ("scan_corpus", 1.10), ("run_with_cache", None)):
        detail = f"{N_SEQS}x{SEQ_LEN} tokens; {seconds[name]:.2f} s vs {seconds['plain_forward']:.2f} s"
        rows.append({"name": f"{name} time / plain forward", "ratio": seconds[name] / seconds["plain_forward"],
                     "goal": f"<= {goal}" if goal else "(naive baseline)", "detail": detail})
        detail = f"{memory[name]:.0f} MB vs {memory['plain_forward']:.0f} MB above the loaded model"
        rows.append({"name": f"{name} peak memory / plain forward", "goal": "<= 1.2" if goal else "(naive baseline)",
                     "ratio": memory[name] / memory["plain_forward"], "detail": detail})
    return rows


def run_all(repeats: int = 5) -> list[dict[str, Any]]:
    rows = bench_detection(repeats)
    for module, function in EXTRA_BENCHES:
        try:
            bench = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError):
            continue
        rows.extend(bench())
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = (f"Measured with `python -m massive_lens.bench --write docs/benchmarks.md` on "
            f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, load average {load:.1f} at the end; the default "
            "model (SmolLM2-135M-Instruct, float32). Ratios are medians of interleaved repeats in one run.\n\n")
    lines = ["| measurement | ratio | goal | detail |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ratio']:.2f} | {r['goal']} | {r['detail']} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", default=None, help="write the table into this Markdown file")
    args = parser.parse_args(argv)
    if args.memory:
        print(json.dumps(memory_of(args.memory)))
        return
    table = to_markdown(run_all(args.repeats))
    print(table)
    if args.write:
        with open(args.write, "w") as handle:
            handle.write("# Benchmarks\n\n" + table)


if __name__ == "__main__":
    main()
