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
import sys
from collections.abc import Sequence

from massive_lens.models import load_model
from massive_lens.train.retrofit import SETTINGS, retrofit

HELP = "fine-tune a pretrained model with its massive activations removed, under softmax or an off-switch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``retrofit`` options to ``parser``."""
    parser.add_argument("--model", default=None, help="model name or path for load_model (default: the default model)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
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


def cmd_retrofit(args: argparse.Namespace) -> None:
    """Run :func:`retrofit` with the parsed options and print its summary."""
    model = load_model(args.model) if args.model else load_model()
    result = retrofit(model, [s.strip() for s in args.settings.split(",")], steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                      seeds=[int(s) for s in args.seeds.split(",")], data=args.data, eval_data=args.eval_data,
                      eval_every=args.eval_every, eval_seqs=args.eval_seqs, measure=args.measure,
                      out_dir=args.out_dir)
    print(result.summary())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command outside ``massive-lens`` (progress logged to stderr)."""
    parser = argparse.ArgumentParser(prog="massive-lens retrofit", description=HELP)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cmd_retrofit(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
