"""``massive-lens effects``: the argparse wiring of the effect experiments.

    massive-lens effects valley --corpus test.txt --calibration valid.txt
    massive-lens effects streaming --corpus test.txt --window 256 --seq-len 1024
    massive-lens effects mixing --corpus test.txt --calibration valid.txt
    massive-lens effects repeated --token " the" --n 3000

``massive_lens.cli`` registers the command with :func:`add_arguments` and :func:`cmd_effects`.
With ``--out-dir`` the result is saved
there (``massive_lens.load`` reads it back) with its figure as ``<experiment>.png``.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> args = parser.parse_args(["streaming", "--window", "64", "--sinks", "0,1"])
>>> args.experiment, args.window, _ints(args.sinks)
('streaming', 64, [0, 1])
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from massive_lens.core.outputs import check_out_dir
from massive_lens.core.render import save_figure
from massive_lens.effects.mixing import over_mixing
from massive_lens.effects.repeated import repeated_token_probe
from massive_lens.effects.streaming import streaming_window
from massive_lens.effects.valley import compression_valley
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import load_model

HELP = ("what the sink does: compression valley, StreamingLLM window, over-mixing, repeated-token circuit")
EXPERIMENTS = ("valley", "streaming", "mixing", "repeated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``effects`` options to ``parser``."""
    parser.add_argument("experiment", choices=EXPERIMENTS, help="which experiment")
    parser.add_argument("--model", default=None, help="model name or path for load_model (default: the default model)")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
    parser.add_argument("--corpus", default=None, help="text file or 'hf:NAME' (default: the offline default text)")
    parser.add_argument("--calibration", default=None,
                        help="valley, mixing: text file where the massive activations and sinks are found")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: valley 256, streaming 1024, mixing and repeated 128)")
    parser.add_argument("--n-seqs", type=int, default=None, help="sequences (default: streaming 4, else 8)")
    parser.add_argument("--layers", default=None, help="valley, mixing: comma-separated layers (default all)")
    parser.add_argument("--window", type=int, default=256, help="streaming: recent tokens kept (default 256)")
    parser.add_argument("--sinks", default="0,1,2,4", help="streaming: first tokens kept, comma-separated")
    parser.add_argument("--positions", default="cache", choices=("cache", "original"),
                        help="streaming: positions within the cache (StreamingLLM) or the original ones")
    parser.add_argument("--pos", type=int, default=1, help="mixing: the perturbed position (default 1)")
    parser.add_argument("--token", default=" the", help="repeated: the token repeated (default ' the')")
    parser.add_argument("--n", type=int, default=3000, help="repeated: repeats after the first token (default 3000)")
    parser.add_argument("--first", default=None,
                        help="repeated: the token before the repeats (default BOS, or the token itself without BOS)")
    parser.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                        help="save the result and its figure in this folder")


def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise MassiveLensError(f"{text!r}: give comma-separated integers, e.g. 0,1,2") from None


def run(args: argparse.Namespace, model: Any) -> Any:
    """The experiment ``args.experiment`` on ``model`` with the parsed options."""
    size = {k: v for k, v in (("seq_len", args.seq_len), ("n_seqs", args.n_seqs)) if v is not None}
    if args.experiment == "valley":
        return compression_valley(model, args.corpus, layers=_ints(args.layers), calibration=args.calibration, **size)
    if args.experiment == "streaming":
        return streaming_window(model, args.corpus, window=args.window, sinks=_ints(args.sinks),
                                positions=args.positions, **size)
    if args.experiment == "mixing":
        return over_mixing(model, args.corpus, pos=args.pos, layers=_ints(args.layers), calibration=args.calibration,
                           **size)
    return repeated_token_probe(model, args.token, args.n, text=args.corpus, first=args.first, **size)


def cmd_effects(args: argparse.Namespace) -> None:
    """Run the chosen experiment (output folder checked first), print its summary, save it."""
    out = check_out_dir(args.out_dir, "--out-dir")
    _ints(args.sinks), _ints(args.layers)  # bad lists fail before the model loads
    model = load_model(args.model, dtype=args.dtype)
    result = run(args, model)
    print(result.summary())
    if out is not None:
        result.save(out / args.experiment, overwrite=True)
        save_figure(result.plot(), Path(out) / args.experiment, formats=("png",))
