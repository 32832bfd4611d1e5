"""``python -m benchmarks [--write FILE] [--repeats N] [--areas detect,origin,...]
[--models default,qwen2.5-coder-1.5b]``."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import traceback
from pathlib import Path

import torch

from benchmarks import attention, detect, harness, origin, quantize, report, train
from massive_lens.core.corpora import token_batches
from massive_lens.core.model_view import ModelView
from massive_lens.models.load import load_model
from massive_lens.models.tiny import tiny_model

AREAS = ("detect", "origin", "attention", "report", "train")
MODEL_AREAS = ("detect", "origin", "attention", "report")  # on each model; train needs none
MODELS = ("default", "qwen2.5-coder-1.5b")  # the two offline models


def _load(name: str):
    """A model for the benchmarks: ``tiny-FAMILY`` is a tiny random model (for dry runs), any
    other name goes to ``load_model``, in the dtype and on the device of ``--dtype`` and
    ``--device`` (passed on to the memory subprocesses in the environment)."""
    dtype, device = os.environ.get("BENCH_DTYPE") or None, os.environ.get("BENCH_DEVICE") or None
    if name.startswith("tiny-"):
        family = name.split("-", 1)[1]
        model = tiny_model(family, **{"n_positions" if family == "gpt2" else "max_position_embeddings": 1024})
        return model.to(device or "cpu", getattr(torch, dtype) if dtype else torch.float32)
    return load_model(name, dtype=dtype, device=device)


def _tokens(model) -> torch.Tensor:
    view = ModelView(model)
    return next(token_batches(view, None, seq_len=detect.SEQ_LEN, batch_size=2 * detect.N_SEQS)).to(view.input_device)


def _memory(spec: str, model_name: str) -> float | dict[str, float]:
    area, case = spec.split(":")
    if area not in ("detect", "report", "quantize"):
        raise SystemExit(f"no memory cases in area {area!r}")
    libraries = harness.resident_mb() * 2**20  # the interpreter and its libraries, before the model
    model = _load(model_name)
    if area == "report":
        return {**report.measure(model), "model": ModelView(model).name, "libraries": libraries}
    if area == "quantize":  # the low-bit grid (one case)
        return {**quantize.measure(model), "model": ModelView(model).name, "libraries": libraries}
    tokens = detect.batch(model, _tokens(model))
    calls = detect.cases(model, tokens)
    detect.cases(model, tokens[:1, :8])["plain_forward"]()  # wire lazy state with a tiny pass
    return harness.peak_memory_of(calls[case])


def _model_rows(name: str, areas: list[str], repeats: int, failed: list[str]) -> tuple[list[harness.Row], str]:
    """The rows of the model-based areas on one model (loaded here, released on return)."""
    try:
        model = _load(name)
    except Exception:
        failed.extend(f"{area} ({name})" for area in areas)
        print(f"could not load {name!r}:\n{traceback.format_exc()}", file=sys.stderr)
        return [], name
    tokens = _tokens(model)
    runs = {"detect": lambda: detect.rows(model, tokens, repeats, memory=os.environ.get("BENCH_MEMORY") != "0"),
            "origin": lambda: origin.rows(model, tokens, repeats),
            "attention": lambda: attention.rows(model, tokens, repeats),
            "report": lambda: report.rows(name) + report.rows(name, runs=1, pinned=True)}
    rows = []
    for area in areas:
        try:
            rows += runs[area]()
        except Exception:  # a failing area is reported, never dropped silently
            failed.append(f"{area} ({name})")
            print(f"benchmark area {area!r} on {name!r} failed:\n{traceback.format_exc()}", file=sys.stderr)
    return rows, ModelView(model).name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=harness.__doc__.splitlines()[0])
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per area (default 5)")
    parser.add_argument("--areas", default=",".join(AREAS), help=f"comma-separated, from {', '.join(AREAS)}")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated model names for load_model (default: {','.join(MODELS)})")
    parser.add_argument("--write", default=None, help="update the table in this Markdown file: the rows measured "
                        "replace theirs; the other rows and everything after the table stay")
    parser.add_argument("--dtype", default=None, help="load the models in this dtype (e.g. bfloat16; default float32)")
    parser.add_argument("--device", default=None, help="load the models on this device (e.g. cuda)")
    parser.add_argument("--no-memory", action="store_true", help="time only: skip the per-case memory subprocesses")
    args = parser.parse_args(argv)
    os.environ.update(BENCH_DTYPE=args.dtype or os.environ.get("BENCH_DTYPE", ""),
                      BENCH_DEVICE=args.device or os.environ.get("BENCH_DEVICE", ""),
                      BENCH_MEMORY="0" if args.no_memory else os.environ.get("BENCH_MEMORY", "1"))
    areas = args.areas.split(",")
    unknown = sorted(set(areas) - set(AREAS))
    if unknown:
        parser.error(f"unknown areas {unknown}; choose from {', '.join(AREAS)}")
    if args.memory:
        print(json.dumps(_memory(args.memory, args.models.split(",")[0])))
        return 0
    rows, failed, names = [], [], []
    model_areas = [a for a in areas if a in MODEL_AREAS]
    for name in args.models.split(",") if model_areas else []:
        model_rows, model_name = _model_rows(name, model_areas, args.repeats, failed)
        rows += model_rows
        names.append(model_name)
        gc.collect()  # release this model before the next one loads
    if "train" in areas:
        try:
            rows += train.rows(repeats=args.repeats)
        except Exception:
            failed.append("train")
            print(f"benchmark area 'train' failed:\n{traceback.format_exc()}", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    header = (f"Last updated with `{command}` on {os.cpu_count()} CPU "
              f"cores ({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} threads, load "
              f"average {load:.1f} at the end; models: {', '.join(names) or 'none'} ({args.dtype or 'float32'}"
              f"{', on ' + args.device if args.device else ''}; on a large model the "
              f"cases read fewer sequences, see the detail column). Each ratio is the median time of the case over "
              f"the median time of its baseline, interleaved in one run, on the same model. Rows of other areas "
              f"and models are from earlier runs (their detail column says when, where it says).")
    if failed:
        header += f"\n\n**Failed areas (see the log): {', '.join(failed)}.**"
    table = harness.to_markdown(rows, header)
    print(table)
    if args.write:  # the rows measured replace theirs; the file's notes and other rows stay
        harness.write_table(Path(args.write), rows, header)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
