"""Is sink mass a predictor of quantization damage on the package's trained variants? (issue 52)

    .venv/bin/python scripts/quant_trained_predictor.py train [NAME ...]    # train (or reuse) the models
    .venv/bin/python scripts/quant_trained_predictor.py measure [NAME ...]  # sink_predictor on each
    .venv/bin/python scripts/quant_trained_predictor.py table               # the docs' table, from the JSONs

The models: :func:`~massive_lens.train.taskrun.train_task` on Guo et al.'s Bigram-Backcopy (our small
version, :mod:`massive_lens.train.tasks`; its training loss is the next-token cross-entropy over every
position, the loss the quantization engine measures), one ``MassiveLM`` per attention variant and norm
placement in :data:`RUNS` (``NAME`` = ``<variant>-<norm>``, ``-h1`` for one head per layer), all with
the same seed (same batches), :data:`SHAPE` and the task runs' default schedule with :data:`STEPS`
steps. ``train`` writes each to ``runs/quant_trained/<name>/`` (git-ignored: the run's
``result.json``/parquet records, the weights as ``model.safetensors`` and ``settings.json``; seeded,
so the command rebuilds them) and skips a folder that already holds a model; it checks that the saved
weights reproduce the trained model's logits exactly.

``measure`` runs :func:`~massive_lens.quant.predictor.sink_predictor` on each saved model for every
setting in :data:`SETTINGS`: :data:`N_SEQS` held-out task sequences evaluated, :data:`N_SEQS` others
calibrating the static ranges (seeds :data:`EVAL_SEED`, :data:`CALIBRATION_SEED`; the training
batches use seed 0 and the run's own held-out batch seed -1). One JSON per model and setting goes to
``docs/quantization/granularity/trained_<name>_<setting>.json`` (summary, per-layer frame,
correlations, the training record, wall times).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_model, save_model

from massive_lens.quant.predictor import sink_predictor
from massive_lens.train.taskrun import build_model, train_task
from massive_lens.train.tasks import make_task
from massive_lens.train.tasksettings import TaskSettings

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "runs/quant_trained"
OUT = ROOT / "docs/quantization/granularity"
TASK = "bigram_backcopy"
TASK_OPTIONS = dict(seq_len=32)
SHAPE = dict(n_layers=12, d_model=64, n_heads=2)
STEPS = 500
SEED = 0
# <variant>-<norm>[-h1]: "-h1" has one head per layer (the sink-task page's shape, where a post-norm softmax
# head forms a first-token sink); the others SHAPE's heads
RUNS = ("softmax-pre", "softmax-post", "softmax1-pre", "learned_sink-pre", "gated-pre", "softmax-post-h1",
        "softmax1-post-h1")
SETTINGS = ("W8A8@tensor", "W4A4@tensor", "W4A4@token")
N_SEQS = 32
EVAL_SEED, CALIBRATION_SEED = -2, -3


def settings_of(name: str) -> TaskSettings:
    heads = 1 if name.endswith("-h1") else SHAPE["n_heads"]
    variant, norm = name.removesuffix("-h1").rsplit("-", 1)
    return TaskSettings.of(TASK, variant=variant, norm=norm, seed=SEED, steps=STEPS, eval_every=50,
                           task_options=TASK_OPTIONS, **{**SHAPE, "n_heads": heads})


def train(name: str) -> None:
    folder = MODELS / name
    if (folder / "model.safetensors").exists():
        print(f"{name}: reusing {folder}", flush=True)
        return
    settings = settings_of(name)
    run = train_task(settings, folder)
    save_model(run.model, str(folder / "model.safetensors"))
    (folder / "settings.json").write_text(json.dumps(settings.to_dict(), indent=1) + "\n")
    batch = make_task(TASK, **TASK_OPTIONS).sample(4, seed=EVAL_SEED, step=0)
    with torch.no_grad():
        same = torch.equal(run.model(batch.tokens), load(name)(batch.tokens))
    if not same:
        raise SystemExit(f"{name}: the saved weights do not reproduce the trained model's logits")
    r = run.result
    print(f"{name}: {r['seconds']:.0f} s, accuracy {r['accuracy']:.3f}, largest head sink mass {r['sink_mass']:.3f}",
          flush=True)


def load(name: str) -> torch.nn.Module:
    folder = MODELS / name
    settings = TaskSettings.from_dict(json.loads((folder / "settings.json").read_text()))
    model = build_model(settings)
    load_model(model, str(folder / "model.safetensors"))
    return model.eval()


def measure(name: str) -> None:
    model = load(name)
    task = make_task(TASK, **TASK_OPTIONS)
    tokens = task.sample(N_SEQS, seed=EVAL_SEED, step=0).tokens
    calibration = task.sample(N_SEQS, seed=CALIBRATION_SEED, step=0).tokens
    trained = json.loads((MODELS / name / "result.json").read_text())
    for setting in SETTINGS:
        start = time.time()
        p = sink_predictor(model, tokens, calibration=calibration, setting=setting, seq_len=tokens.shape[1],
                           n_seqs=N_SEQS)
        seconds = time.time() - start
        summary = p.summary().replace("MassiveLM", f"{TASK} {name}", 1)
        print(summary, f"\n({seconds:.0f} s)", flush=True)
        record = dict(task=TASK, run=name, setting=setting, n_seqs=N_SEQS, seq_len=int(tokens.shape[1]),
                      seconds=round(seconds, 1), train_seconds=round(trained["seconds"]),
                      accuracy=trained["accuracy"], max_head_sink_mass=trained["sink_mass"],
                      settings=trained["settings"], summary=summary,
                      frames=dict(layers=json.loads(p.to_frame().to_json(orient="records")),
                                  correlations=json.loads(p.correlations.to_json(orient="records"))))
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"trained_{name}_{setting.replace('@', '_')}.json").write_text(json.dumps(record, indent=1) + "\n")


def table() -> str:
    """The Markdown table of the docs: per model and setting, each predictor's rho [95% interval]."""
    rows = []
    records = [json.loads(path.read_text()) for path in OUT.glob("trained_*.json")]
    order = {(n, s): i for i, (n, s) in enumerate((n, s) for n in RUNS for s in SETTINGS)}
    for r in sorted(records, key=lambda r: order.get((r["run"], r["setting"]), len(order))):
        layers = pd.DataFrame(r["frames"]["layers"])
        cells = {f"{c['x']} vs {c['y']}": f"{c['rho']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"
                 for c in r["frames"]["correlations"]}
        top = layers.sort_values("damage", ascending=False).iloc[0]
        rows.append({"model": r["run"], "setting": r["setting"], "accuracy": f"{r['accuracy']:.3f}",
                     "sink mass (layers)": f"{layers.sink_mass.min():.2f}-{layers.sink_mass.max():.2f}",
                     "damage (nats, layers)": f"{layers.damage.min():+.1e} to {layers.damage.max():+.1e}",
                     "layers with damage != 0": int(((layers.damage_low > 0) | (layers.damage_high < 0)).sum()),
                     "most damaging layer": int(top.layer), **cells})
    frame = pd.DataFrame(rows)
    head = "| " + " | ".join(frame.columns) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "\n".join("| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["train", "measure", "table"])
    parser.add_argument("names", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    if args.action == "table":
        print(table())
        return
    for name in args.names:
        start = time.time()
        (train if args.action == "train" else measure)(name)
        print(f"{name}: {args.action} {time.time() - start:.0f} s wall", flush=True)


if __name__ == "__main__":
    main()
