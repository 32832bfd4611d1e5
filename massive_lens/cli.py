"""The ``massive-lens`` command: the library's main analyses from a shell.

    massive-lens scan                      # the offline default model on its offline text
    massive-lens scan --model gpt2 --corpus wiki.txt --max-tokens 65536
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from massive_lens.errors import MassiveLensError

EXAMPLE_TEXT = "Summer is warm. Winter is cold.\nThe cat sat on the mat, and the dog slept."


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="hub id, local folder or .gguf file (default: the offline SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")


def _criterion_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--abs-threshold", type=float, default=100.0, help="|value| must exceed this (default 100)")
    parser.add_argument("--ratio-threshold", type=float, default=1000.0,
                        help="|value| / median must exceed this (default 1000)")


def _load(args: argparse.Namespace):
    from massive_lens.models import load_model

    return load_model(args.model, device=args.device, dtype=args.dtype)


def _criterion(args: argparse.Namespace):
    from massive_lens.detect import Criterion

    return Criterion(args.abs_threshold, args.ratio_threshold)


def cmd_scan(args: argparse.Namespace) -> None:
    from massive_lens.detect import find_massive, scan_corpus

    model = _load(args)
    found = find_massive(model, args.text, _criterion(args))
    print(found.summary(), end="\n\n")
    scan = scan_corpus(model, args.corpus, seq_len=args.seq_len, batch_size=args.batch_size,
                       max_tokens=args.max_tokens, criterion=_criterion(args))
    print(scan.summary())
    if args.csv:
        scan.to_frame().to_csv(args.csv, index=False)
        print(f"\nwrote {args.csv}")


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], None], str]] = {
    "scan": (cmd_scan, "find massive activations in a text and measure how often they occur in a corpus"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="massive-lens",
        description="Find, trace and test massive activations and attention sinks in language models. "
        "Every command runs offline on the default model (SmolLM2-135M-Instruct) unless --model names another.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    scan = sub.add_parser("scan", help=COMMANDS["scan"][1], description=COMMANDS["scan"][1])
    _model_args(scan)
    _criterion_args(scan)
    scan.add_argument("--text", default=EXAMPLE_TEXT, help="text to inspect token by token")
    scan.add_argument("--corpus", default=None,
                      help="text file, 'hf:NAME[:CONFIG[:SPLIT]]', or omitted for the offline default text")
    scan.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    scan.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default 4)")
    scan.add_argument("--max-tokens", type=int, default=16_384, help="tokens to scan (default 16384)")
    scan.add_argument("--csv", default=None, help="also write the frequency table to this CSV file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        COMMANDS[args.command][0](args)
    except MassiveLensError as exc:
        print(f"massive-lens {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
