"""``massive-lens mask`` and ``massive-lens dims``: the hand-over pieces from a shell.

    massive-lens mask --text "Hello world. How are you?"          # positions to leave out, token ids
    massive-lens mask --corpus test.txt --levels primary,secondary --thresholds
    massive-lens dims --corpus test.txt --json massive_dims.json   # dims to keep out of a direction

Each command is a (help text, add_arguments, run) triple that ``massive_lens.cli`` registers.
"""

from __future__ import annotations

import argparse

from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.outputs import check_out_file
from massive_lens.handover.dims import HERETIC_PERSISTENCE, massive_dims
from massive_lens.handover.masks import exclusion_mask, norm_thresholds
from massive_lens.models.load import load_model

MASK_HELP = ("positions to leave out of SAE training or evaluation (massive activations, sinks by level), the token "
             "ids for SAELens's exclude_special_tokens, and per-layer norm thresholds")
DIMS_HELP = "the massive dims to keep out of a steering or abliteration direction, as a JSON other tools read"


def _load(args: argparse.Namespace):
    return load_model(args.model, device=args.device, dtype=args.dtype)


def add_mask_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", default=None, help="text to mask (default: --corpus, cut into sequences)")
    parser.add_argument("--levels", default="primary", help="sink levels to leave out (default primary)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per corpus sequence (default 128)")
    parser.add_argument("--n-seqs", type=int, default=8, help="corpus sequences (default 8)")
    parser.add_argument("--thresholds", action="store_true",
                        help="also calibrate per-layer norm thresholds on the corpus (dictionary_learning's form)")


def cmd_mask(args: argparse.Namespace) -> None:
    model = _load(args)
    text = args.text if args.text is not None else sequences(ModelView(model), args.corpus, args.seq_len, args.n_seqs)
    levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    print(exclusion_mask(model, text, levels=levels).summary())
    if args.thresholds:
        print()
        print(norm_thresholds(model, args.corpus, seq_len=args.seq_len, n_seqs=args.n_seqs).summary())


def add_dims_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--persistence", type=float, default=HERETIC_PERSISTENCE,
                        help=f"share of layers a dim must be massive in (default {HERETIC_PERSISTENCE}, heretic's)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--n-seqs", type=int, default=8, help="sequences (default 8)")
    parser.add_argument("--json", default=None, help="write the dims to this JSON file (schema: docs/handover.md)")


def cmd_dims(args: argparse.Namespace) -> None:
    if args.json is not None:
        check_out_file(args.json, "--json")  # before the model loads ('' too: a folder, refused)
    dims = massive_dims(_load(args), args.corpus, persistence=args.persistence, seq_len=args.seq_len,
                        n_seqs=args.n_seqs)
    print(dims.summary())
    if args.json is not None:
        print(f"wrote {dims.to_json(args.json)}")
