"""End-of-run measurements of saved retrofitted models: W8A8 gap and kurtosis, and the low-bit grid.

    .venv/bin/python scripts/retrofit_lowbit.py JOB [JOB ...]

JOB is ``untouched`` (the pretrained model as loaded, a reference; results in
``docs/retrofit/untouched``) or ``<setting>_seed<s>``: the model saved in
``runs/retrofit_models/JOB/`` (by ``--save-models``) is measured on a bridge that computes its
variant (``analysis_bridge``; held dims stay held), and the results go next to the run's result,
as folders ``massive_lens.load`` reads:

* ``docs/retrofit/seeds/JOB/outliers``: :func:`~massive_lens.measure_outliers` (kurtosis, max
  inf-norm, W8A8 with static per-tensor activations);
* ``docs/retrofit/seeds/JOB/lowbit``: :func:`~massive_lens.quant.lowbit_grid` (W8A8, W4A16, W4A4;
  per-channel weights, per-token activations).

Both use the same 8 windows of 128 tokens of WikiText-2 test (BOS first): the first 4 are the windows
of the run's tracked evaluation (evaluated), the other 4 calibrate.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from massive_lens.core.corpora import data_file
from massive_lens.models import load_model
from massive_lens.quant import lowbit_grid, measure_outliers
from massive_lens.train.data import sample_batch, start_token, token_stream
from massive_lens.train.retrofit_parts import analysis_bridge, load_retrofitted

MODELS = Path("runs/retrofit_models")
RESULTS = Path("docs/retrofit/seeds")
SEQS, SEQ_LEN, SEED = 8, 128, 12345


def measure(job: str) -> None:
    """Measure one saved model (or the untouched one) and save the two results."""
    if job == "untouched":
        bridge = load_model()
        tokenizer, out = bridge.tokenizer, RESULTS.parent / job
    else:
        hf, tokenizer, meta = load_retrofitted(MODELS / job)
        hold = (meta["dims"], meta["hold_start"]) if meta.get("hold_start") is not None else None
        bridge, out = analysis_bridge(hf, tokenizer, hold=hold, name=job), RESULTS / job
    held = token_stream(data_file("wikitext-2/test.txt"), tokenizer)
    tokens = sample_batch(held, SEQS, SEQ_LEN, start_token(tokenizer), seed=SEED, step=0)
    report = measure_outliers(bridge, tokens)
    report.save(out / "outliers", overwrite=True)
    grid = lowbit_grid(bridge, tokens)
    grid.save(out / "lowbit", overwrite=True)  # written last: the runner's "measured" marker
    logging.info("%s\n%s", report.summary(), grid.summary())


def main(jobs: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    for job in jobs:
        measure(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
