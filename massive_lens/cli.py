"""The ``massive-lens`` command: the library's main analyses from a shell.

    massive-lens report --out report       # the main job: everything, as an HTML report
    massive-lens report --model default --model qwen2.5-coder-1.5b   # two models side by side
    massive-lens scan                      # the offline default model on its offline text
    massive-lens scan --model gpt2 --corpus wiki.txt --max-tokens 65536
    massive-lens trace --verify            # where the massive activations are born
    massive-lens intervene --corpus test.txt --calibration valid.txt
    massive-lens precision                 # does the model hold in float16 / bfloat16? (measured, then run)
    massive-lens sinks --corpus test.txt --out-dir sinks   # census, keys and values, dormant heads
    massive-lens sink-circuit --corpus test.txt   # why the first token: the sink's logit split, then cut
    massive-lens mask --corpus test.txt    # positions and token ids to leave out of SAE training
    massive-lens dims --json dims.json     # massive dims to keep out of an abliteration direction
    massive-lens train smoke runs/smoke steps=50 lr=3e-4     # one run (also under torchrun)
    massive-lens train-compare --variants softmax,softmax1 --preset smoke
    massive-lens effects valley            # what the sink does: valley, streaming, mixing, repeated
    massive-lens tasks run --seeds 0,1     # the sink-forcing tasks' grid (resumable); tasks page: its answer page
    massive-lens offswitch --model tiny:gpt_oss   # where an off-switch puts idle attention (issue 51)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from massive_lens.attention import dormant_heads, find_sinks, sink_census, sink_kv
from massive_lens.attention.circuit_cli import HELP as CIRCUIT_HELP
from massive_lens.attention.circuit_cli import add_arguments as circuit_arguments
from massive_lens.attention.circuit_cli import cmd_circuit
from massive_lens.core.corpora import sequences
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.outputs import check_out_dir, check_out_file
from massive_lens.detect import find_massive, scan_corpus
from massive_lens.effects.cli import HELP as EFFECTS_HELP
from massive_lens.effects.cli import add_arguments as effects_arguments
from massive_lens.effects.cli import cmd_effects
from massive_lens.errors import MassiveLensError
from massive_lens.handover import precision_check
from massive_lens.handover.cli import DIMS_HELP, MASK_HELP, add_dims_arguments, add_mask_arguments, cmd_dims, cmd_mask
from massive_lens.interventions import run_interventions
from massive_lens.models.load import load_model
from massive_lens.origin import trace_origin
from massive_lens.quant.cli import HELP as QUANTIZE_HELP
from massive_lens.quant.cli import add_arguments as quantize_arguments
from massive_lens.quant.cli import cmd_quantize
from massive_lens.report import compare_models, write_report
from massive_lens.report.inputs import DEFAULT as REPORT_DEFAULT
from massive_lens.report.inputs import FULL as REPORT_FULL
from massive_lens.report.inputs import QUICK as REPORT_QUICK
from massive_lens.report.inputs import SKIPPABLE
from massive_lens.report.write import DEFAULT_TEXT as EXAMPLE_TEXT
from massive_lens.train.compare import compare_main
from massive_lens.train.data import TOKENIZERS, write_token_file
from massive_lens.train.offswitch_cli import HELP as OFFSWITCH_HELP
from massive_lens.train.offswitch_cli import add_arguments as offswitch_arguments
from massive_lens.train.offswitch_cli import cmd_offswitch
from massive_lens.train.retrofit_cli import HELP as RETROFIT_HELP
from massive_lens.train.retrofit_cli import add_arguments as retrofit_arguments
from massive_lens.train.retrofit_cli import cmd_retrofit
from massive_lens.train.taskcli import HELP as TASKS_HELP
from massive_lens.train.taskcli import add_arguments as tasks_arguments
from massive_lens.train.taskcli import cmd_tasks
from massive_lens.train.trainer import run_and_exit


def _model_args(parser: argparse.ArgumentParser, several: bool = False) -> None:
    what = ("hub id, local folder, .gguf file or offline model (default: the offline SmolLM2-135M-Instruct; "
            "also offline: qwen2.5-coder-1.5b)")
    if several:
        parser.add_argument("--model", action="append", default=None,
                            help=what + "; repeat it to compare models side by side on one page")
    else:
        parser.add_argument("--model", default=None, help=what)
    parser.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")


def _criterion_args(parser: argparse.ArgumentParser) -> None:
    sun = Criterion()  # the defaults are the Criterion's own, written once
    parser.add_argument("--abs-threshold", type=float, default=sun.abs_threshold,
                        help=f"|value| must exceed this (default {sun.abs_threshold:g})")
    parser.add_argument("--ratio-threshold", type=float, default=sun.ratio_threshold,
                        help=f"|value| / median must exceed this (default {sun.ratio_threshold:g})")


def _load(args: argparse.Namespace):
    return load_model(args.model, device=args.device, dtype=args.dtype)


def _criterion(args: argparse.Namespace):
    return Criterion(args.abs_threshold, args.ratio_threshold)


def cmd_scan(args: argparse.Namespace) -> None:
    if args.csv:
        check_out_file(args.csv, "--csv")  # before the scan, not after it
    model = _load(args)
    found = find_massive(model, args.text, criterion=_criterion(args))
    print(found.summary(), end="\n\n")
    scan = scan_corpus(model, args.corpus, seq_len=args.seq_len, batch_size=args.batch_size,
                       max_tokens=args.max_tokens, criterion=_criterion(args))
    print(scan.summary())
    if args.csv:
        scan.to_frame().to_csv(args.csv, index=False)
        print(f"\nwrote {args.csv}")


def cmd_trace(args: argparse.Namespace) -> None:
    trace = trace_origin(_load(args), args.text, dim=args.dim, pos=args.pos, criterion=_criterion(args),
                         top_neurons=args.top_neurons, verify=args.verify, corpus=args.corpus)
    print(trace.summary())


def cmd_intervene(args: argparse.Namespace) -> None:
    if args.corpus is None and args.calibration is None:  # before loading the model
        raise MassiveLensError("name the evaluation text and other text for the means, e.g. --corpus test.txt "
                               "--calibration valid.txt; with neither, both would be the offline default text")
    table = run_interventions(_load(args), args.corpus, calibration=args.calibration, seq_len=args.seq_len,
                              n_seqs=args.n_seqs, batch_size=args.batch_size)
    print(table.summary())


def cmd_precision(args: argparse.Namespace) -> None:
    dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    check = precision_check(_load(args), args.corpus, dtypes=dtypes, seq_len=args.seq_len, n_seqs=args.n_seqs,
                            tolerance=args.tolerance, confirm=args.confirm)
    print(check.summary())


SINK_ANALYSES = {"census": sink_census, "kv": sink_kv, "dormant": dormant_heads}


def cmd_sinks(args: argparse.Namespace) -> None:
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    if not chosen or set(chosen) - set(SINK_ANALYSES):
        raise MassiveLensError(f"--only takes some of {','.join(SINK_ANALYSES)}, got {args.only!r}")
    if args.text is not None and not args.text.strip():  # '' would fall back to another text
        raise MassiveLensError("--text is empty: give the text to inspect, or leave --text out for the default one")
    folder = check_out_dir(args.out_dir, "--out-dir") if args.out_dir is not None else None  # before the model loads
    model = _load(args)
    text = args.text if args.corpus is None else sequences(ModelView(model), args.corpus, args.seq_len, args.n_seqs)
    sinks = find_sinks(model, text) if {"kv", "dormant"} <= set(chosen) else None  # one pass for both
    for name in chosen:
        result = SINK_ANALYSES[name](model, text) if name == "census" else SINK_ANALYSES[name](model, text, sinks=sinks)
        print(result.summary(), end="\n\n")
        if folder is not None:
            print(f"wrote {result.save(folder / name, overwrite=True)}", end="\n\n")


def cmd_train_compare(args: argparse.Namespace) -> None:
    print(compare_main(variants=args.variants, preset=args.preset, seeds=args.seeds, out_dir=args.out_dir,
                       until_step=args.until_step))


def cmd_tokenize(args: argparse.Namespace) -> None:
    path = write_token_file(args.data, args.tokenizer, args.out, max_chars=args.max_chars)
    print(f"wrote {path} ({path.stat().st_size:,} bytes); train on it with data={str(path)!r}")


def report_options() -> list[str]:
    """The options of :func:`write_report` (all but ``model``): ``massive-lens report`` has a
    flag for each, of the same name and default, and passes them all on."""
    return [name for name in inspect.signature(write_report).parameters if name != "model"]


def _report_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--text", default=None, help="text to inspect token by token (default: two short sentences)")
    add("--calibration", default=None,
        help="text file where intervention means and sinks are measured (default: the corpus sequences after "
             "the evaluation ones)")
    add("--out-dir", "--out", dest="out_dir", default="report", help="output folder (default ./report)")
    for flag, what in (("--seq-len", "tokens per corpus sequence"), ("--n-seqs", "evaluation sequences"),
                       ("--scan-seqs", "corpus sequences the scan reads"),
                       ("--calibration-seqs", "calibration sequences")):
        name = flag[2:].replace("-", "_")
        add(flag, type=int, default=None, help=f"{what} (default {getattr(REPORT_DEFAULT, name)}; "
                                               f"{getattr(REPORT_FULL, name)} with --full, "
                                               f"{getattr(REPORT_QUICK, name)} with --quick)")
    add("--verify", action=argparse.BooleanOptionalAction, default=None,
        help="check the origin causally by zero-ablation (default on; off with --quick)")
    add("--dim", type=int, default=None, help="trace this hidden dimension (default: the largest massive entry's)")
    add("--pos", type=int, default=None, help="trace this token position (default: the largest massive entry's)")
    add("--layer", type=int, default=None,
        help="layer of the landscape, attention and magnitude figures (default: the layer of the headline "
             "activation, the text's largest token-specific massive value)")
    add("--skip", default=None, help="comma-separated sections to leave out: " + ",".join(SKIPPABLE))
    add("--quick", action="store_true", help="small settings: seconds on a tiny model")
    add("--full", action="store_true",
        help="full settings of the costly steps: 8 evaluation and scan sequences, the causal check's perplexity "
             "on 4 sequences of --seq-len tokens (default 2 of 64), the 5-setting low-bit grid on 4 sequences "
             "(default 4 settings on 2), a half-precision fix confirmed by running the model in each dtype "
             "(default: none recommended); several times the default's minutes")
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add("--no-tables", dest="tables", action="store_false", help="do not write the tables as CSV files")


def cmd_report(args: argparse.Namespace) -> None:
    models = args.model or [None]
    options = {name: getattr(args, name) for name in report_options()}
    if len(models) == 1:
        path = write_report(models[0], **options)
    else:
        path = compare_models(models, **options)
    print(f"wrote {path}")


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs to a dict; a value is a Python literal when it parses as one
    (``3``, ``3e-4``, ``True``, ``[1, 2]``, ``{"a": 1}``) or ``nan``/``inf``, else the string itself.

    >>> parse_overrides(["steps=3", "data=fineweb-edu-10BT.bin", "lr=3e-4", "compile=False"])
    {'steps': 3, 'data': 'fineweb-edu-10BT.bin', 'lr': 0.0003, 'compile': False}
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MassiveLensError(f"expected key=value, got {pair!r} (e.g. steps=100 data=input.txt)")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # nan and inf are numbers too (and refused as such)
            out[key] = float(value) if value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity") else value
    return out


def cmd_train(args: argparse.Namespace) -> None:
    run_and_exit(args.preset, args.out_dir, parse_overrides(args.overrides))


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], None], str]] = {
    "report": (cmd_report, "run every analysis and write a self-contained HTML + Markdown report (the main job)"),
    "scan": (cmd_scan, "find massive activations in a text and measure how often they occur in a corpus"),
    "trace": (cmd_trace,
              "trace where each massive activation is born, erased and reborn (ledger, neurons, super weights)"),
    "intervene": (cmd_intervene, "the paper's Table 3: perplexity under zero/mean ablation and sink interventions"),
    "precision": (cmd_precision, "whether float16 / bfloat16 hold the model's activations: measured in float32, "
                  "then confirmed by running in each"),
    "mask": (cmd_mask, MASK_HELP),
    "dims": (cmd_dims, DIMS_HELP),
    "sinks": (cmd_sinks, "the sink census (levels and lifetimes), the sink's keys and values, and dormant heads"),
    "sink-circuit": (cmd_circuit, CIRCUIT_HELP),
    "train": (cmd_train, "train one MassiveLM from a preset (data parallel under torchrun)"),
    "train-compare": (cmd_train_compare,
                      "train small models with softmax, softmax1 and other attention variants and compare"),
    "tokenize": (cmd_tokenize, "tokenize a corpus once into a .bin token file that training reads by memmap"),
    "retrofit": (cmd_retrofit, RETROFIT_HELP),
    "quantize": (cmd_quantize, QUANTIZE_HELP),
    "effects": (cmd_effects, EFFECTS_HELP),
    "tasks": (cmd_tasks, TASKS_HELP),
    "offswitch": (cmd_offswitch, OFFSWITCH_HELP),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="massive-lens",
        description="Find, trace and test massive activations and attention sinks in language models. "
        "Every command runs offline on the default model (SmolLM2-135M-Instruct) unless --model names another.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmd = {name: sub.add_parser(name, help=text, description=text) for name, (_, text) in COMMANDS.items()}
    corpus_help = "text file, 'hf:NAME[:CONFIG[:SPLIT]]', or omitted for the offline default text"
    for name in ("report", "scan", "trace", "intervene", "precision", "sinks", "mask", "dims"):
        _model_args(cmd[name], several=name == "report")
        cmd[name].add_argument("--corpus", default=None, help=corpus_help)
    for name in ("scan", "trace", "sinks"):
        cmd[name].add_argument("--text", default=EXAMPLE_TEXT, help="text to inspect token by token")
    for name in ("scan", "trace"):
        _criterion_args(cmd[name])
    for name, seq_len in (("scan", 256), ("intervene", 128)):
        cmd[name].add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per sequence (default {seq_len})")
        cmd[name].add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default 4)")
    _report_args(cmd["report"])
    cmd["scan"].add_argument("--max-tokens", type=int, default=16_384, help="tokens to scan (default 16384)")
    cmd["scan"].add_argument("--csv", default=None, help="also write the frequency table to this CSV file")
    cmd["trace"].add_argument("--dim", type=int, default=None, help="trace this residual dimension")
    cmd["trace"].add_argument("--pos", type=int, default=None, help="trace this token position")
    cmd["trace"].add_argument("--top-neurons", type=int, default=5, help="neurons listed per birth (default 5)")
    cmd["trace"].add_argument("--verify", action="store_true", help="zero the named neurons and super weights, measure")
    cmd["intervene"].add_argument("--calibration", default=None,
                                  help="text file (other text than --corpus) where means are measured")
    cmd["intervene"].add_argument("--n-seqs", type=int, default=32, help="evaluation sequences (default 32)")
    prec = cmd["precision"]
    prec.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated dtypes to check (default both)")
    prec.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    prec.add_argument("--n-seqs", type=int, default=4, help="sequences (default 4)")
    prec.add_argument("--tolerance", type=float, default=0.01,
                      help="largest relative perplexity change still called safe (default 0.01)")
    prec.add_argument("--no-confirm", dest="confirm", action="store_false",
                      help="verdict from the float32 measurement alone (no run in each dtype)")
    add_mask_arguments(cmd["mask"])
    add_dims_arguments(cmd["dims"])
    sinks = cmd["sinks"]
    sinks.add_argument("--only", default=",".join(SINK_ANALYSES),
                       help=f"comma-separated analyses (default all: {','.join(SINK_ANALYSES)})")
    sinks.add_argument("--seq-len", type=int, default=128, help="tokens per corpus sequence (default 128)")
    sinks.add_argument("--n-seqs", type=int, default=8, help="corpus sequences (default 8)")
    sinks.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                       help="save each result here (massive_lens.load reads it back)")
    train = cmd["train-compare"]
    train.add_argument("--variants", default="softmax,softmax1", help="comma-separated attention variants")
    train.add_argument("--preset", default="smoke", help="smoke, cpu, gpu-small or gpu-gpt2 (default smoke)")
    train.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    train.add_argument("--out-dir", "--out", dest="out_dir", default="runs/train-compare",
                       help="output folder for logs, CSVs and plots")
    train.add_argument("--until-step", type=int, default=None, help="stop early at this step (resumable)")
    tok = cmd["tokenize"]
    tok.add_argument("data", help=corpus_help.replace(", or omitted", ", or 'default'"))
    tok.add_argument("out", help="output .bin file (a .json description is written beside it)")
    tok.add_argument("--tokenizer", default="default", choices=TOKENIZERS,
                     help="'default' (the default model's) or 'byte'")
    one = cmd["train"]
    one.add_argument("preset", help="smoke, cpu, gpu-small or gpu-gpt2")
    one.add_argument("out_dir", help="run folder (checkpoints, log.csv, run.json); an existing run resumes")
    one.add_argument("overrides", nargs="*", help="TrainConfig fields as key=value (Python literals or strings)")
    tok.add_argument("--max-chars", type=int, default=None, help="stop after this many characters")
    retrofit_arguments(cmd["retrofit"])
    quantize_arguments(cmd["quantize"])
    effects_arguments(cmd["effects"])
    circuit_arguments(cmd["sink-circuit"])
    tasks_arguments(cmd["tasks"])
    offswitch_arguments(cmd["offswitch"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        code = COMMANDS[args.command][0](args)  # None, or an exit code (tasks page --check: 1 if it differs)
    except MassiveLensError as exc:
        print(f"massive-lens {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's code for SIGINT, no traceback
        print(f"massive-lens {args.command}: interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
