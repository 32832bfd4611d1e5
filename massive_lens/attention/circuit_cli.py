"""``massive-lens sink-circuit``: the argparse wiring of :func:`~massive_lens.attention.sink_circuit`.

    massive-lens sink-circuit --corpus wiki.test.raw --out-dir circuit
    massive-lens sink-circuit --model qwen2.5-coder-1.5b --corpus wiki.test.raw --n-seqs 16

The split reads ``--text`` (default: the first ``--n-text`` sequences of the corpus); the causal
check runs on the ``--n-seqs`` corpus sequences after those (never the split's own) unless
``--no-causal``. With ``--out-dir`` the result
is saved there (``massive_lens.load`` reads it back) with its figure as ``sink_circuit.png``.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> args = parser.parse_args(["--heads", "3.1,4.0", "--no-causal"])
>>> _heads(args.heads), args.causal
([(3, 1), (4, 0)], False)
"""

from __future__ import annotations

import argparse

from massive_lens.attention.circuit import N_HEADS, sink_circuit
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.outputs import check_out_dir
from massive_lens.core.render import save_figure
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import load_model

HELP = "why the first token: each sink head's logit on it split exactly, and each part removed alone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``sink-circuit`` options to ``parser``."""
    parser.add_argument("--model", default=None, help="model name or path for load_model (default: the default model)")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
    parser.add_argument("--corpus", default=None, help="text file or 'hf:NAME' (default: the offline default text)")
    parser.add_argument("--text", default=None, help="text to split (default: the first --n-text corpus sequences)")
    parser.add_argument("--n-text", type=int, default=4, help="corpus sequences the split reads (default 4)")
    parser.add_argument("--heads", default=None, help="layer.head pairs, comma-separated (default: the top heads)")
    parser.add_argument("--n-heads", type=int, default=N_HEADS, help=f"top sink heads split (default {N_HEADS})")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--n-seqs", type=int, default=16, help="causal check: corpus sequences (default 16)")
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="the split only")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="refuse a causal check estimated (before it starts) to take longer than this")
    parser.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                        help="save the result and its figure here")


def _heads(spec: str | None) -> list[tuple[int, int]] | None:
    if spec is None:
        return None
    try:
        return [(int(a), int(b)) for a, b in (item.strip().split(".") for item in spec.split(",") if item.strip())]
    except ValueError as exc:
        raise MassiveLensError(f"--heads takes layer.head pairs such as 3.1,4.0, got {spec!r}") from exc


def cmd_circuit(args: argparse.Namespace) -> None:
    """Run :func:`sink_circuit` from parsed arguments and print its summary."""
    heads = _heads(args.heads)
    folder = check_out_dir(args.out_dir, "--out-dir") if args.out_dir is not None else None
    model = load_model(args.model, dtype=args.dtype)
    view = ModelView(model)
    # the split reads the first --n-text sequences and the causal check the next --n-seqs: never the same ones
    text = args.text if args.text is not None else sequences(view, args.corpus, args.seq_len, args.n_text)
    skip = 0 if args.text is not None else args.n_text
    corpus = sequences(view, args.corpus, args.seq_len, skip + args.n_seqs)[skip:] if args.causal else None
    if corpus is not None and len(corpus) == 0:
        raise MassiveLensError(f"the corpus gives no sequence of {args.seq_len} tokens after the {skip} the split "
                               "reads (--n-text): give more text, lower --n-text or --seq-len, or pass --no-causal")
    result = sink_circuit(model, text, heads=heads, n_heads=args.n_heads, corpus=corpus, max_seconds=args.max_seconds)
    print(result.summary())
    if folder is not None:
        print(f"\nwrote {result.save(folder / 'sink_circuit', overwrite=True)}")
        print(f"wrote {save_figure(result.plot(), folder / 'sink_circuit', formats=('png',))[0]}")
