"""``massive-lens retrofit``: the argparse wiring of :func:`massive_lens.train.retrofit.retrofit`.

``massive_lens.cli`` registers the command with :func:`add_arguments` and :func:`cmd_retrofit`;
``python -m massive_lens.train.retrofit_cli`` runs it directly.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> parser.parse_args(["--steps", "3"]).steps
3
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from massive_lens.errors import MassiveLensError
from massive_lens.models.load import load_model
from massive_lens.train.retrofit import RETROFIT_SETTINGS, retrofit
from massive_lens.train.retrofit_parts import parse_setting

HELP = "fine-tune a pretrained model with its massive activations removed, under softmax or an off-switch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``retrofit`` options to ``parser``."""
    parser.add_argument("--model", default=None, help="model name or path for load_model (default: the default model)")
    parser.add_argument("--settings", default=",".join(RETROFIT_SETTINGS),
                        help="comma-separated '<variant>-kept|removed[-held]' (default: the four of the issue)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, BOS included (default 128)")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    parser.add_argument("--warmup-steps", type=int, default=4, help="linear warmup steps (default 4)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--data", default=None, help="training text file (default WikiText-2 valid)")
    parser.add_argument("--eval-data", default=None, help="held-out text file (default WikiText-2 test)")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between tracked evaluations (default 5)")
    parser.add_argument("--eval-seqs", type=int, default=8, help="held-out sequences per evaluation (default 8)")
    parser.add_argument("--no-measure", dest="measure", action="store_false", help="skip the final W8A8 measurement")
    parser.add_argument("--out-dir", "--out", dest="out_dir", default="runs/retrofit",
                        help="where the result, CSVs and figures are written as the run goes")
    parser.add_argument("--save-models", default=None,
                        help="save each fine-tuned model (safetensors) under this folder as <setting>_seed<s>/")


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The settings and seeds, after checking every option that can be checked before the model loads.

    Raises:
        MassiveLensError: for bad seeds or settings, counts below 1, ``--seq-len`` below 2,
            a data file that is missing or empty, an output path that is a file, or a model
            path (``./``, ``/``, ``~``, ``.gguf``) that does not exist.
    """
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise MassiveLensError(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2") from None
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings:
        raise MassiveLensError("--settings is empty: name at least one, e.g. softmax-kept")
    for name in settings:
        parse_setting(name)
    for flag in ("steps", "batch_size", "eval_every", "eval_seqs"):
        if getattr(args, flag) < 1:
            raise MassiveLensError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.seq_len < 2:
        raise MassiveLensError(f"--seq-len {args.seq_len}: must be at least 2 (BOS and one token to predict)")
    for flag in ("data", "eval_data"):
        value = getattr(args, flag)
        if value is None or value == "default" or value.startswith("hf:"):
            continue
        if not Path(value).is_file():
            raise MassiveLensError(f"--{flag.replace('_', '-')} {value}: no such file")
        if Path(value).stat().st_size == 0:
            raise MassiveLensError(f"--{flag.replace('_', '-')} {value}: the file is empty")
    for flag in ("out_dir", "save_models"):
        value = getattr(args, flag)
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise MassiveLensError(f"--{flag.replace('_', '-')} {value} is a file: give a folder")
    model = args.model
    if model and (model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") > 1
                  or os.sep in model and Path(model.split(os.sep)[0]).exists()):
        if not Path(model).expanduser().exists():
            raise MassiveLensError(f"--model {model}: no such model folder or file (a local path, not a hub id)")
    return settings, seeds


def cmd_retrofit(args: argparse.Namespace) -> None:
    """Run :func:`retrofit` with the parsed options (checked first) and print its summary."""
    settings, seeds = check_arguments(args)
    model = load_model(args.model) if args.model else load_model()
    result = retrofit(model, settings, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                      seeds=seeds, data=args.data, eval_data=args.eval_data,
                      eval_every=args.eval_every, eval_seqs=args.eval_seqs, measure=args.measure,
                      out_dir=args.out_dir, save_models=args.save_models)
    print(result.summary())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command outside ``massive-lens`` (progress logged to stderr)."""
    parser = argparse.ArgumentParser(prog="massive-lens retrofit", description=HELP)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        cmd_retrofit(parser.parse_args(argv))
    except MassiveLensError as err:
        print(f"massive-lens retrofit: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
