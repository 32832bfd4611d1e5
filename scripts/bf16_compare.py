"""bfloat16 against float32 end to end on one model: detection (find_massive), the ledger
(trace_origin), the value-update decomposition (decompose_attention) and Table 3
(run_interventions), each in both dtypes on the same tokens; how far each bf16 reading is from
float32, and the time and peak memory of each.

Each dtype runs in its own interpreter (``run``), which writes ``OUT/DTYPE.json``: each
analysis's table (``to_frame()``), CPU and wall seconds, and peak resident memory above the
loaded model (the high-water mark reset before each). ``compare`` reads both and prints the
Markdown tables. A large model's runs belong under a machine-wide lock, one at a time::

    flock /tmp/qwen.lock nice -n 5 python scripts/bf16_compare.py run qwen2.5-coder-1.5b float32 runs/bf16
    flock /tmp/qwen.lock nice -n 5 python scripts/bf16_compare.py run qwen2.5-coder-1.5b bfloat16 runs/bf16
    python scripts/bf16_compare.py compare runs/bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks`
from benchmarks.harness import peak_memory_of, resident_mb

SEQ_LEN, N_EVAL, N_CALIB, TRACE_LEN = 128, 4, 4, 64
KEYS = {"find_massive": ["seq", "layer", "pos", "dim"], "trace_origin": ["pos", "dim", "layer", "component"],
        "decompose_attention": ["layer", "head", "term"], "table3": ["setting"]}
VALUES = {"find_massive": ["value"], "trace_origin": ["contribution", "resid"],
          "decompose_attention": ["norm", "cos_pos", "cos_text"], "table3": ["perplexity", "ratio", "accuracy"]}


def run(model_name: str, dtype: str, out: Path) -> None:
    from massive_lens import decompose_attention, find_massive, load_model, run_interventions, trace_origin
    from massive_lens.core.corpora import token_batches
    from massive_lens.core.model_view import ModelView

    libraries = resident_mb()
    start = time.perf_counter()
    model = load_model(model_name, dtype=dtype)
    for t in [*model.parameters(), *model.buffers()]:  # page the weights in (a float32 cache is memory-mapped):
        t.detach().sum()  # the first analysis would otherwise count them as its own memory and time
    loaded = {"load_s": time.perf_counter() - start, "model_mb": resident_mb() - libraries}
    tokens = next(token_batches(ModelView(model), None, seq_len=SEQ_LEN, batch_size=N_EVAL + N_CALIB))
    text, calib = tokens[:N_EVAL], tokens[N_EVAL:]
    calls = {
        "find_massive": lambda: find_massive(model, text).entries,
        "trace_origin": lambda: trace_origin(model, text[:1, :TRACE_LEN]).to_frame(),
        "decompose_attention": lambda: decompose_attention(model, text[:1]).to_frame(),
        "table3": lambda: run_interventions(model, text, calibration=calib, seq_len=SEQ_LEN, n_seqs=N_EVAL,
                                            calibration_seqs=N_CALIB, progress=False).to_frame(),
    }
    results: dict[str, Any] = {"model": ModelView(model).name, "dtype": dtype, **loaded, "analyses": {}}
    for name, call in calls.items():
        got: dict[str, pd.DataFrame] = {}
        cpu, wall = time.process_time(), time.perf_counter()
        peak = peak_memory_of(lambda call=call, got=got: got.update(frame=call()))
        frame = got["frame"]
        results["analyses"][name] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                                     "peak_mb": peak, "frame": frame[KEYS[name] + VALUES[name]].to_dict("records")}
        print(name, f"{time.perf_counter() - wall:.1f} s", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{dtype}.json").write_text(json.dumps(results, default=float))


def distance(name: str, ref: list[dict], half: list[dict]) -> str:
    """Rows found in each, and how far the shared rows' values are apart (relative)."""
    a, b = pd.DataFrame(ref), pd.DataFrame(half)
    if a.empty or b.empty:
        return f"{len(a)} rows in float32, {len(b)} in bf16"
    both = a.merge(b, on=KEYS[name], suffixes=("_32", "_16"))
    parts = [f"{len(a)} rows in float32, {len(b)} in bf16, {len(both)} shared"]
    for col in VALUES[name]:
        x, y = both[f"{col}_32"], both[f"{col}_16"]
        scale = x.abs().where(x.abs() > 1e-6 * x.abs().max(), float("nan"))
        rel = ((y - x).abs() / scale).dropna()
        if len(rel):
            top = float((y - x).abs().max() / x.abs().max())  # the largest difference, against the largest value
            parts.append(f"{col}: median {rel.median():.2%}, max {rel.max():.2%} off ({top:.2%} of the largest)")
    if name == "table3":
        parts.append("ratios " + ", ".join(f"{r['setting']} {r['ratio_32']:.4f} vs {r['ratio_16']:.4f}"
                                           for _, r in both.iterrows()))
    return "; ".join(parts)


def compare(out: Path) -> str:
    ref, half = (json.loads((out / f"{d}.json").read_text()) for d in ("float32", "bfloat16"))
    lines = [f"Model: {ref['model']}. Loading: float32 {ref['load_s']:.0f} s, {ref['model_mb']:.0f} MB resident; "
             f"bf16 {half['load_s']:.0f} s, {half['model_mb']:.0f} MB.", "",
             "| analysis | bf16 against float32 | CPU time float32 | CPU time bf16 | bf16/float32 time | "
             "peak above the model float32 | bf16 |", "|---|---|---|---|---|---|---|"]
    for name, r in ref["analyses"].items():
        h = half["analyses"][name]
        lines.append(f"| {name} | {distance(name, r['frame'], h['frame'])} | {r['cpu_s']:.1f} s | {h['cpu_s']:.1f} s "
                     f"| {h['cpu_s'] / r['cpu_s']:.2f}x | {r['peak_mb']:.0f} MB | {h['peak_mb']:.0f} MB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every analysis in one dtype")
    r.add_argument("model")
    r.add_argument("dtype", choices=["float32", "bfloat16"])
    r.add_argument("out", type=Path)
    c = sub.add_parser("compare", help="the Markdown table from both runs")
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        run(args.model, args.dtype, args.out)
    else:
        print(compare(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
