"""Is sink mass a predictor of quantization damage on the retrofitted SmolLM2 models? (issue 52)

    .venv/bin/python scripts/quant_retrofit_predictor.py measure MODELS [JOB ...] [--setting S]
    .venv/bin/python scripts/quant_retrofit_predictor.py table   # the docs' table, from the JSONs

``MODELS`` is the folder the retrofit runs save their models into (``--save-models``, a local run
output: ``runs/retrofit_models``); each ``JOB`` a subfolder ``<setting>_seed<s>`` (default: all),
or ``untouched`` (SmolLM2 itself, :func:`~massive_lens.load_model`). Each retrofitted model is read
back with :func:`~massive_lens.train.retrofit_parts.load_retrofitted` (safetensors) and measured on
a bridge that computes its attention variant, held dims held
(:func:`~massive_lens.train.retrofit_parts.analysis_bridge`), with
:func:`~massive_lens.quant.predictor.sink_predictor` at ``S`` (default ``W8A8@tensor``) on the
windows of the untouched model's run (``scripts/quant_granularity.py measure default predictor
--n-seqs 2 --seq-len 128``): the first 2 windows of 128 tokens of WikiText-2 test evaluated, the
first 2 of WikiText-2 valid calibrating; before measuring, the model's tokenizer is checked to cut
the same windows as the untouched model's. One JSON per model and setting goes to
``docs/quantization/granularity/retrofit_<job>_<S>.json`` (``@`` as ``_``; the untouched model's
``W8A8@tensor`` file reproduces ``default_predictor.json``); ``table`` reads them all.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

from massive_lens import load_model
from massive_lens.core.corpora import data_file, sequences
from massive_lens.core.model_view import ModelView
from massive_lens.quant.predictor import sink_predictor
from massive_lens.train.retrofit_parts import analysis_bridge, load_retrofitted

OUT = Path(__file__).resolve().parents[1] / "docs/quantization/granularity"
SETTING = "W8A8@tensor"  # the untouched model's run (default_predictor.json)
SETTINGS = (SETTING, "W4A4@tensor", "W4A4@token")  # the trained variants' three
N_SEQS, SEQ_LEN = 2, 128


def options() -> dict:
    return dict(corpus=str(data_file("wikitext-2/test.txt")), calibration=str(data_file("wikitext-2/valid.txt")),
                seq_len=SEQ_LEN, n_seqs=N_SEQS)


def same_windows(bridge: object) -> None:
    """The retrofitted model's tokenizer cuts the untouched model's evaluation windows."""
    reference = load_model()
    o = options()
    for text in (o["corpus"], o["calibration"]):
        mine = sequences(ModelView(bridge), text, SEQ_LEN, N_SEQS)
        theirs = sequences(ModelView(reference), text, SEQ_LEN, N_SEQS)
        if not torch.equal(mine, theirs):
            raise SystemExit(f"the retrofitted model's windows of {text} differ from the untouched model's")


def measure(models: Path, job: str, setting: str) -> None:
    if job == "untouched":
        model, meta, hold = load_model(), dict(setting="untouched", seed=0, variant="softmax"), None
    else:
        hf, tokenizer, meta = load_retrofitted(models / job)
        hold = (meta["dims"], meta["hold_start"]) if meta.get("hold_start") is not None else None
        model = analysis_bridge(hf, tokenizer, hold=hold, name=job)
        del hf
        same_windows(model)
    start = time.time()
    p = sink_predictor(model, **options(), setting=setting)
    seconds = time.time() - start
    print(p.summary(), f"\n({seconds:.0f} s)", flush=True)
    record = dict(job=job, setting=meta["setting"], seed=int(meta["seed"]), variant=meta.get("variant"),
                  held=hold is not None, quant_setting=setting, n_seqs=N_SEQS, seq_len=SEQ_LEN,
                  seconds=round(seconds), summary=p.summary(),
                  frames=dict(layers=json.loads(p.to_frame().to_json(orient="records")),
                              correlations=json.loads(p.correlations.to_json(orient="records"))))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"retrofit_{job}_{setting.replace('@', '_')}.json").write_text(json.dumps(record, indent=1) + "\n")


def row(record: dict) -> dict:
    layers = pd.DataFrame(record["frames"]["layers"])
    cells = {f"{c['x']} vs {c['y']}": f"{c['rho']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"
             for c in record["frames"]["correlations"]}
    top = layers.sort_values("damage", ascending=False).iloc[0]
    return {"model": record["job"], "setting": record["quant_setting"],
            "sink mass (layers)": f"{layers.sink_mass.min():.2f}-{layers.sink_mass.max():.2f}",
            "damage (nats, layers)": f"{layers.damage.min():+.3f} to {layers.damage.max():+.3f}",
            "layers with damage != 0": int(((layers.damage_low > 0) | (layers.damage_high < 0)).sum()),
            "most damaging layer": f"{int(top.layer)} ({top.damage:+.3f})", **cells}


def table() -> str:
    """The Markdown table: per model (the untouched one first) and setting, each predictor's rho
    [95% interval]."""
    records = [json.loads(path.read_text()) for path in OUT.glob("retrofit_*.json")]
    order = {s: i for i, s in enumerate(SETTINGS)}
    records.sort(key=lambda r: (r["job"] != "untouched", r["job"], order.get(r["quant_setting"], len(order))))
    frame = pd.DataFrame([row(r) for r in records])
    head = "| " + " | ".join(frame.columns) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in frame.itertuples(index=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["measure", "table"])
    parser.add_argument("models", nargs="?", type=Path, help="measure: the folder of saved retrofit models")
    parser.add_argument("jobs", nargs="*", help="measure: <setting>_seed<s> subfolders or 'untouched' (default: all)")
    parser.add_argument("--setting", default=SETTING)
    args = parser.parse_args()
    if args.action == "table":
        print(table())
        return
    if args.models is None:
        parser.error("measure needs the models folder")
    torch.set_num_threads(1)
    jobs = args.jobs or sorted(p.parent.name for p in args.models.glob("*/retrofit.json"))
    for job in jobs:
        start = time.time()
        measure(args.models, job, args.setting)
        print(f"{job} {args.setting}: {time.time() - start:.0f} s wall", flush=True)


if __name__ == "__main__":
    main()
