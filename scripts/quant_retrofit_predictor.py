"""Is sink mass a predictor of quantization damage on the retrofitted SmolLM2 models? (issue 52)

    .venv/bin/python scripts/quant_retrofit_predictor.py measure MODELS [JOB ...]  # sink_predictor per model
    .venv/bin/python scripts/quant_retrofit_predictor.py table                      # the docs' table

``MODELS`` is the folder the retrofit runs save their models into (``--save-models``, a local run
output: ``runs/retrofit_models``); each ``JOB`` a subfolder ``<setting>_seed<s>`` (default: all).
Each model is read back with :func:`~massive_lens.train.retrofit_parts.load_retrofitted`
(safetensors) and measured on a bridge that computes its attention variant, held dims held
(:func:`~massive_lens.train.retrofit_parts.analysis_bridge`), with
:func:`~massive_lens.quant.predictor.sink_predictor` at ``W8A8@tensor`` on the windows of the
untouched model's run (``scripts/quant_granularity.py measure default predictor --n-seqs 2
--seq-len 128``): the first 2 windows of 128 tokens of WikiText-2 test evaluated, the first 2 of
WikiText-2 valid calibrating. Before measuring, the model's tokenizer is checked to cut the same
windows as the untouched model's. One JSON per model goes to
``docs/quantization/granularity/retrofit_<job>_predictor.json``; ``table`` reads them beside the
untouched model's ``default_predictor.json``.
"""

from __future__ import annotations

import json
import sys
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
REFERENCE = OUT / "default_predictor.json"
SETTING = "W8A8@tensor"
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


def measure(models: Path, job: str) -> None:
    hf, tokenizer, meta = load_retrofitted(models / job)
    hold = (meta["dims"], meta["hold_start"]) if meta.get("hold_start") is not None else None
    bridge = analysis_bridge(hf, tokenizer, hold=hold, name=job)
    del hf
    same_windows(bridge)
    start = time.time()
    p = sink_predictor(bridge, **options(), setting=SETTING)
    seconds = time.time() - start
    print(p.summary(), f"\n({seconds:.0f} s)", flush=True)
    record = dict(job=job, setting=meta["setting"], seed=int(meta["seed"]), variant=meta.get("variant"),
                  held=hold is not None, quant_setting=SETTING, n_seqs=N_SEQS, seq_len=SEQ_LEN,
                  seconds=round(seconds), summary=p.summary(),
                  frames=dict(layers=json.loads(p.to_frame().to_json(orient="records")),
                              correlations=json.loads(p.correlations.to_json(orient="records"))))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"retrofit_{job}_predictor.json").write_text(json.dumps(record, indent=1) + "\n")


def row(name: str, record: dict) -> dict:
    layers = pd.DataFrame(record["frames"]["layers"])
    cells = {f"{c['x']} vs {c['y']}": f"{c['rho']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"
             for c in record["frames"]["correlations"]}
    top = layers.sort_values("damage", ascending=False).iloc[0]
    return {"model": name, "sink mass (layers)": f"{layers.sink_mass.min():.2f}-{layers.sink_mass.max():.2f}",
            "damage (nats, layers)": f"{layers.damage.min():+.3f} to {layers.damage.max():+.3f}",
            "layers with damage != 0": int(((layers.damage_low > 0) | (layers.damage_high < 0)).sum()),
            "most damaging layer": f"{int(top.layer)} ({top.damage:+.3f})", **cells}


def table() -> str:
    """The Markdown table: the untouched model, then each retrofitted one."""
    rows = [row("untouched SmolLM2", json.loads(REFERENCE.read_text()))]
    records = [json.loads(path.read_text()) for path in sorted(OUT.glob("retrofit_*_predictor.json"))]
    rows += [row(r["job"], r) for r in records]
    frame = pd.DataFrame(rows)
    head = "| " + " | ".join(frame.columns) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in frame.itertuples(index=False))


def main(argv: list[str]) -> int:
    if argv[:1] == ["measure"] and len(argv) >= 2:
        torch.set_num_threads(1)
        models = Path(argv[1])
        jobs = argv[2:] or sorted(p.parent.name for p in models.glob("*/retrofit.json"))
        for job in jobs:
            start = time.time()
            measure(models, job)
            print(f"{job}: {time.time() - start:.0f} s wall", flush=True)
        return 0
    if argv == ["table"]:
        print(table())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
