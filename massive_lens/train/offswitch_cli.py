"""``massive-lens offswitch``: the off-switch protocol (:mod:`massive_lens.handover.offswitch`) on a
model, and on the sink-forcing task runs (:mod:`massive_lens.train.offswitch_runs`).

    massive-lens offswitch --model tiny:gpt_oss          # a tiny gpt-oss (learned sink logits)
    massive-lens offswitch --model openai/gpt-oss-20b --dtype bfloat16 --device-map auto --out offswitch.md
    massive-lens offswitch --runs docs/sinktasks/runs/trigger_conditional --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from massive_lens.core.outputs import check_out_file
from massive_lens.errors import MassiveLensError
from massive_lens.handover.offswitch import offswitch
from massive_lens.models.load import load_model
from massive_lens.models.tiny import tiny_model
from massive_lens.train.offswitch_runs import VARIANTS, offswitch_task_runs, where_table

HELP = ("where an attention's off-switch (learned sink logit, sink slot, output gate) puts idle attention, beside "
        "the first token, the residual peak and the float16 verdict (on a model, or on the task runs with --runs)")
TEXT = ("The quick brown fox jumps over the lazy dog. Attention heads with nothing to do park their weight "
        "somewhere; the question is where.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=None,
                        help="a model name or path, or tiny:FAMILY (tiny:gpt_oss, tiny:qwen3_next); repeatable")
    parser.add_argument("--text", default=TEXT, help="the text to read (default: a short English paragraph)")
    parser.add_argument("--dtype", default=None, help="load the model in this dtype (e.g. bfloat16)")
    parser.add_argument("--device-map", default=None, help="passed to the loader (e.g. auto, for a model over GPUs)")
    parser.add_argument("--no-precision", dest="precision", action="store_false",
                        help="predict the float16 verdict from the residual peaks (no precision_check run)")
    parser.add_argument("--runs", default=None, help="a task's run folder (docs/sinktasks/runs/<task>)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="settings' variants with --runs")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds with --runs (default: all)")
    parser.add_argument("--cache", default=None, help="keep the retrained task models here (safetensors)")
    parser.add_argument("--out", default=None, help="also write the results as Markdown to this file")


def cmd_offswitch(args: argparse.Namespace) -> None:
    if not args.model and not args.runs:
        raise MassiveLensError("name a model (--model NAME, or tiny:gpt_oss) or a task's run folder (--runs DIR)")
    out = None if args.out is None else check_out_file(args.out)
    parts = []
    for name in args.model or []:
        if name.startswith("tiny:"):
            model = tiny_model(name.split(":", 1)[1])
        else:
            options = {k: v for k, v in (("dtype", args.dtype), ("device_map", args.device_map)) if v is not None}
            model = load_model(name, **options)
        result = offswitch(model, args.text, precision=args.precision)
        print(result.summary())
        frame = result.to_frame()
        parts.append(f"## {result.model_name}\n\n```text\n{result.summary()}\n```\n\n{markdown(frame)}\n")
    if args.runs:
        seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",")]
        frame = offswitch_task_runs(args.runs, variants=args.variants.split(","), seeds=seeds, cache=args.cache)
        table = where_table(frame)
        print(table)
        parts.append(f"## Task runs: {Path(args.runs).name}\n\n{table}\n")
    if out is not None:
        Path(out).write_text("\n".join(parts))
        print(f"wrote {out}")


def markdown(frame: pd.DataFrame) -> str:
    """A DataFrame as a Markdown table (floats to 4 significant digits)."""
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    head = "| " + " | ".join(map(str, frame.columns)) + " |"
    return "\n".join([head, "|" + "---|" * len(frame.columns), *("| " + " | ".join(r) + " |" for r in cells)])
