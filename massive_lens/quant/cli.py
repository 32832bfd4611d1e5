"""``massive-lens quantize``: the argparse wiring of :func:`massive_lens.quant.quantize_grid`.

``massive_lens.cli`` registers the command with :func:`add_arguments` and :func:`cmd_quantize`.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> parser.parse_args(["--settings", "W4A4,W4A4+hadamard"]).settings
'W4A4,W4A4+hadamard'
"""

from __future__ import annotations

import argparse
from pathlib import Path

from massive_lens.core.outputs import check_out_dir
from massive_lens.core.render import close_figure
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import load_model
from massive_lens.quant.api import quantize_grid
from massive_lens.quant.settings import GRANULARITIES, GRID, Setting

HELP = "loss and quantization error under low-bit settings (W4A4, KV cache, rotations, kept sinks)"
COLUMNS = ["setting", "loss", "gap", "gap_low", "gap_high", "ppl_ratio", "err_sink", "err_massive", "err_other",
           "max_abs", "kurtosis", "top1_median"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``quantize`` options to ``parser``."""
    parser.add_argument("--model", default=None, help="model name or path for load_model (default: the default model)")
    parser.add_argument("--corpus", default=None, help="evaluation text file (default: the offline default text)")
    parser.add_argument("--calibration", default=None,
                        help="text file for static ranges and the prefix (default: the corpus's next sequences)")
    parser.add_argument("--settings", default=",".join(GRID),
                        help="comma-separated W<w>A<a>[KV<b>][@granularity][+hadamard|+orthogonal][+kvsink|+prefix] "
                             f"(default {','.join(GRID)})")
    parser.add_argument("--granularity", default="token", choices=GRANULARITIES,
                        help="for settings that name none (default token)")
    parser.add_argument("--asymmetric", action="store_true", help="asymmetric grids with a zero point")
    parser.add_argument("--group-size", type=int, default=128, help="group width of @group (default 128)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--n-seqs", type=int, default=8, help="evaluation sequences (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random rotations (default 0)")
    parser.add_argument("--out-dir", default=None, help="save the result (massive_lens.load), its CSV and figure here")


def cmd_quantize(args: argparse.Namespace) -> None:
    """Run :func:`quantize_grid` with the parsed options (settings checked before the model loads)."""
    settings = [Setting.parse(s) for s in args.settings.split(",") if s.strip()]
    if not settings:
        raise MassiveLensError("--settings is empty: name at least one, e.g. W4A4")
    for flag in ("seq_len", "n_seqs", "group_size"):
        if getattr(args, flag) < 1:
            raise MassiveLensError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    for flag in ("corpus", "calibration"):
        value = getattr(args, flag)
        if value is not None and not value.startswith("hf:") and not Path(value).is_file():
            raise MassiveLensError(f"--{flag} {value}: no such file")
    out = check_out_dir(args.out_dir, "--out-dir") if args.out_dir is not None else None  # writable, before the work
    model = load_model(args.model) if args.model else load_model()
    result = quantize_grid(model, args.corpus, settings=settings, granularity=args.granularity,
                           symmetric=not args.asymmetric, group_size=args.group_size, seq_len=args.seq_len,
                           n_seqs=args.n_seqs, calibration=args.calibration, seed=args.seed)
    print(result.summary())
    print(result.to_frame()[COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        result.save(out / "result", overwrite=True)
        result.to_frame().to_csv(out / "quantization.csv", index=False)
        ax = result.plot()
        ax.figure.savefig(out / "quantization.png", dpi=120, bbox_inches="tight")
        close_figure(ax)
