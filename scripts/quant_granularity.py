"""Quantization damage by granularity on a real model (issue 52): the runs behind docs/quantization.md.

    .venv/bin/python scripts/quant_granularity.py measure MODEL PART [--n-seqs N] [--seq-len L]
    .venv/bin/python scripts/quant_granularity.py show MODEL PART

``MODEL`` is a :func:`~massive_lens.load_model` name (``default``: SmolLM2-135M-Instruct); ``PART``:

* ``table``: :func:`~massive_lens.quant.granularity.granularity_table` (W8A8 and W4A4 at every
  granularity, the asymmetric per-group and the rotated W4A4, each with its kept-sinks twin; D_sink);
* ``outliers``: :func:`~massive_lens.quant.measure_outliers` (the per-tensor dispersion and underflow
  leaders, static per-tensor W8A8);
* ``float16-w8a8``, ``float16-w4a4``: :func:`~massive_lens.quant.float16.fewest_float16` for
  ``W8A8@tensor`` and ``W4A4@token`` (target x1.05);
* ``predictor``: :func:`~massive_lens.quant.predictor.sink_predictor` (``W8A8@tensor``).

Evaluation: the first ``N`` windows of ``L`` tokens of WikiText-2 test; calibration: the first ``N``
of WikiText-2 valid. Each part writes ``docs/quantization/granularity/<model>_<part>.json`` (the
summary, the tables, the command's options and its wall time); ``show`` prints it back.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from massive_lens import load_model
from massive_lens.core.corpora import data_file
from massive_lens.quant import measure_outliers
from massive_lens.quant.float16 import fewest_float16
from massive_lens.quant.granularity import granularity_table
from massive_lens.quant.predictor import sink_predictor

OUT = Path(__file__).resolve().parents[1] / "docs/quantization/granularity"
PARTS = ("table", "outliers", "float16-w8a8", "float16-w4a4", "predictor")


def run_part(model: object, part: str, options: dict, table: dict) -> tuple[str, dict]:
    if part == "table":
        r = granularity_table(model, **options, **table)
        return r.summary(), {"table": r.to_frame(), "ratios": r.ratios(), "arms": r.arms}
    if part == "outliers":
        r = measure_outliers(model, **options, per_channel=False)
        return r.summary(), {"layers": r.to_frame(), "worst": r.worst_tensors(5)}
    if part.startswith("float16"):
        setting = {"float16-w8a8": "W8A8@tensor", "float16-w4a4": "W4A4@token"}[part]
        r = fewest_float16(model, **options, setting=setting)
        return r.summary(), {"curve": r.to_frame(), "ranking": r.ranking.head(20)}
    r = sink_predictor(model, **options)
    return r.summary(), {"layers": r.to_frame(), "correlations": r.correlations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["measure", "show"])
    parser.add_argument("model")
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--n-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bases", default=None, help="table: comma-separated base settings (default W8A8,W4A4)")
    parser.add_argument("--granularities", default=None, help="table: comma-separated (default all four)")
    parser.add_argument("--extra", default=None, help="table: comma-separated extra settings ('' for none)")
    args = parser.parse_args()
    path = OUT / f"{args.model}_{args.part}.json"
    if args.action == "show":
        record = json.loads(path.read_text())
        print(record["summary"])
        return
    model = load_model() if args.model == "default" else load_model(args.model)
    options = dict(corpus=str(data_file("wikitext-2/test.txt")), calibration=str(data_file("wikitext-2/valid.txt")),
                   seq_len=args.seq_len, n_seqs=args.n_seqs)
    start = time.time()
    table = {k: [x for x in v.split(",") if x] for k, v in
             dict(bases=args.bases, granularities=args.granularities, extra=args.extra).items() if v is not None}
    summary, frames = run_part(model, args.part, options, table)
    seconds = time.time() - start
    print(summary, flush=True)
    print(f"{seconds:.0f} s", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    record = dict(model=args.model, part=args.part, n_seqs=args.n_seqs, seq_len=args.seq_len, seconds=round(seconds),
                  table_options=table,
                  summary=summary, frames={k: json.loads(v.to_json(orient="records")) for k, v in frames.items()})
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
