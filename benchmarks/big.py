"""A Llama-2-7B-shaped model in bfloat16: the peak memory of each analysis against its weights.

The model (32 layers, d_model 4096, MLP 11008, 32 heads, a 32,000-token vocabulary) is built
directly in bfloat16, with no float32 copy at any point: the Hugging Face model is constructed
without its initialisation, then every weight is filled in place from one seeded pool of
random values (each tensor a random window of the pool, so that filling 6.7B weights takes
seconds, not minutes). Output projections are scaled down by ``1/sqrt(2 * layers)`` (as in
GPT-2's initialisation) so that the residual stream of a random model stays near 1, and a
massive activation is planted the way the tests plant one in the tiny models: the BOS
token's embedding reads ``TRIGGER_SCALE`` in one dimension, one MLP neuron of layer 1 reads
only that dimension and writes only ``DIM``, scaled from a measured run so that it writes
``VALUE`` there. Every analysis then has something to find.

Each case runs in its own interpreter (the model is 13.5 GB: one at a time), on short
texts (2 x 64 tokens). Its peak resident memory (the high-water mark, reset after the model
was built) less what the interpreter held before the model was built (Python and the
libraries) is the model plus what the analysis added; the goal is at most ``GOAL`` times
the weights.

    python -m benchmarks.big                           # every case, one subprocess each
    python -m benchmarks.big --lock /tmp/qwen.lock     # each subprocess under flock
    python -m benchmarks.big --shape tiny --device cpu # the same cases on a small model, seconds
    python -m benchmarks.big --case find_massive       # one case in this process (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import ROOT, resident_mb
from massive_lens.core.budget import weight_bytes

GOAL = 1.5
SEQ_LEN, N_SEQS = 64, 2
LAYER, NEURON, DIM, TRIGGER_DIM = 1, 5, 7, 3  # the planted neuron: layer 1's neuron 5 writes dim 7
VALUE, TRIGGER_SCALE, GAIN = 3000.0, 20.0, 3.0
SEVEN_B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
SHAPES = {
    "7b": SEVEN_B,
    **{f"7b-{n}layers": {**SEVEN_B, "num_hidden_layers": n} for n in (2, 4, 8)},  # the 7B's widths, fewer layers
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096),
}
POOL = 1 << 26  # random values that every weight is a window of


def _fill(model: torch.nn.Module, n_layers: int, seed: int = 0) -> None:
    """Random weights in place, in the model's own dtype: norms 1, the rest uniform with std
    0.02 (output projections ``0.02 / sqrt(2 * n_layers)``), each a window of one pool."""
    gen = torch.Generator().manual_seed(seed)
    first = next(model.parameters())
    pool = torch.empty(POOL, dtype=first.dtype).uniform_(-math.sqrt(3), math.sqrt(3), generator=gen)  # std 1
    pool = pool.to(first.device)
    out_scale = 1 / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            flat, done = param.view(-1), 0
            while done < flat.numel():
                start = int(torch.randint(0, POOL // 2, (1,), generator=gen))
                n = min(flat.numel() - done, POOL - start)
                flat[done:done + n].copy_(pool[start:start + n])
                done += n
            param.mul_(0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0))


def _plant(hf: Any, bos: int, device: torch.device) -> float:
    """Plant the massive activation (see the module docstring); returns the neuron's activation
    at BOS before its output was scaled."""
    mlp = hf.model.layers[LAYER].mlp
    with torch.no_grad():
        hf.model.embed_tokens.weight[bos].zero_()
        hf.model.embed_tokens.weight[bos, TRIGGER_DIM] = TRIGGER_SCALE
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[NEURON].zero_()
            proj.weight[NEURON, TRIGGER_DIM] = GAIN
        mlp.down_proj.weight[:, NEURON] = 0.0
        mlp.down_proj.weight[DIM, NEURON] = 1.0
    seen: dict[str, float] = {}

    def grab(_module: Any, args: tuple[torch.Tensor, ...]) -> None:
        seen["act"] = float(args[0][0, 0, NEURON])

    handle = mlp.down_proj.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            hf(torch.tensor([[bos, 65, 66, 67]], device=device))
    finally:
        handle.remove()
    with torch.no_grad():
        mlp.down_proj.weight[DIM, NEURON] = VALUE / seen["act"]
    return seen["act"]


def build(shape: str = "7b", device: str | None = None, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The planted model of ``shape`` (a key of :data:`SHAPES`) as a TransformerBridge, built in ``dtype``."""
    from transformers.initialization import no_init_weights

    from massive_lens.core.tokens import byte_tokenizer
    from massive_lens.models.load import wrap_hf_model
    from massive_lens.models.tiny import tiny_config

    tok = byte_tokenizer()
    model_cls, config = tiny_config("llama", tok, SHAPES[shape])
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with no_init_weights(), where:
        hf = model_cls._from_config(config, torch_dtype=dtype)
    _fill(hf, config.num_hidden_layers)
    _plant(hf, tok.bos_token_id, where)
    return wrap_hf_model(hf, tok, name=f"llama-{shape}-shaped-{str(dtype).split('.')[-1]}")


def _tokens(model: Any) -> torch.Tensor:
    from massive_lens.core.corpora import token_batches
    from massive_lens.core.model_view import ModelView

    return next(token_batches(ModelView(model), None, seq_len=SEQ_LEN, batch_size=2 * N_SEQS))


def cases(model: Any, tokens: torch.Tensor) -> dict[str, Callable[[], str]]:
    """Each case runs one analysis on ``tokens`` (N_SEQS sequences; the next N_SEQS calibrate)
    and returns what it found, in a few words."""
    from massive_lens import (
        decompose_attention,
        find_massive,
        measure_outliers,
        perplexity,
        scan_corpus,
        sink_attention,
        trace_origin,
        write_report,
    )
    from massive_lens.interventions import calibrate, fix_sink_term

    text, calib = tokens[:N_SEQS], tokens[N_SEQS:]

    def plain() -> str:
        with torch.no_grad():
            model(text)
        return "-"

    def intervention() -> str:
        cal = calibrate(model, calib, seq_len=SEQ_LEN, n_seqs=len(calib), progress=False)
        hooks = fix_sink_term(model, "mean", calibration=cal)
        result = perplexity(model, text, batch_size=None, hooks=hooks, progress=False)
        return f"perplexity {result.perplexity:.4g} with fix_sink_term (calibration included)"

    def report() -> str:
        with tempfile.TemporaryDirectory() as out:
            write_report(model, out_dir=out, quick=True, progress=False, tables=False)
        return "quick report written"

    def found(f: Any) -> str:
        return f"{len(f.entries)} massive entries, dims {list(f.dims)[:4]}, positions {list(f.positions)[:4]}"

    return {
        "plain_forward": plain,
        "find_massive": lambda: found(find_massive(model, text)),
        "scan_corpus": lambda: scan_corpus(model, text, seq_len=SEQ_LEN, batch_size=N_SEQS, max_tokens=None,
                                           progress=False).summary().splitlines()[0][:120],
        "trace_origin": lambda: f"{len(trace_origin(model, text[:1]).targets)} targets traced",
        "sink_attention": lambda: f"sinks: {sink_attention(model, text).sinks.describe()}",
        "decompose_attention": lambda: f"{len(decompose_attention(model, text[:1]).to_frame())} rows",
        "intervention": intervention,
        "w8a8": lambda: f"{len(measure_outliers(model, tokens).to_frame())} layers measured",
        "report_quick": report,
    }


def run_cases(names: list[str], shape: str, device: str | None) -> list[dict[str, Any]]:
    """Build the model once and run the cases one after the other in this process: each one's
    peak (the high-water mark reset after collecting and trimming what the one before freed),
    time and finding."""
    from massive_lens.report.memory import release_free_memory

    libraries = resident_mb() * 2**20
    start = time.perf_counter()
    model = build(shape, device)
    built = time.perf_counter() - start
    tokens = _tokens(model).to(next(model.parameters()).device)
    calls = cases(model, tokens)
    cuda = torch.cuda.is_available()
    results = []
    for name in names:
        release_free_memory()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset the high-water mark to the current resident size
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        what = calls[name]()
        seconds = time.perf_counter() - start
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status)
        results.append({"case": name, "shape": shape, "peak": int(fields["VmHWM"].split()[0]) * 1024,
                        "libraries": libraries, "weights": weight_bytes(model),
                        "cuda_peak": torch.cuda.max_memory_allocated() if cuda else 0, "seconds": seconds,
                        "build_s": built, "found": what, "tokens": f"{len(tokens[:N_SEQS])}x{tokens.shape[1]}",
                        "process": "shared" if len(names) > 1 else "own"})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown table of the cases' results."""
    gb = 2**30
    lines = ["| case | peak above the libraries / weights | goal | verdict | peak resident | on the GPU | time | "
             "found |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | - | {GOAL:g} | failed | - | - | - | {r['error']} |")
            continue
        on_gpu = r["cuda_peak"] > 0
        ratio = (r["cuda_peak"] if on_gpu else r["peak"] - r["libraries"]) / r["weights"]
        verdict = "ok" if ratio <= GOAL else "over goal"
        lines.append(f"| {r['case']} | {ratio:.2f} | {GOAL:g} | {verdict} | {r['peak'] / gb:.2f} GiB | "
                     f"{r['cuda_peak'] / gb:.2f} GiB | {r['seconds']:.1f} s | {r['found']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.big", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--case", default=None, help="run this one case here and print its JSON")
    parser.add_argument("--together", action="store_true",
                        help="run the cases in one process, the model built once (faster; each case's peak is "
                             "still its own: the high-water mark is reset between cases)")
    parser.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
    parser.add_argument("--lock", default=None, help="run each case under `flock LOCK` (one big process at a time)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_cases([args.case], args.shape, args.device)[0]))
        return 0
    names = args.cases.split(",") if args.cases else list(cases(None, torch.zeros(2 * N_SEQS, 1)))
    if args.together:
        results = run_cases(names, args.shape, args.device)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(results, handle, indent=1)
        print(table(results))
        return 0
    results = []
    for name in names:
        cmd = [sys.executable, "-m", "benchmarks.big", "--case", name, "--shape", args.shape]
        cmd += ["--device", args.device] if args.device else []
        cmd = ["flock", args.lock, *cmd] if args.lock else cmd
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            results.append({"case": name, "error": f"failed (exit {out.returncode})"})
        else:
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(results, handle, indent=1)
    print(table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
