"""What the per-step recording costs: process CPU time per training step of the `cpu` preset's
model (4 layers x 128, 16 x 128 tokens, one torch thread) with and without the recorder, in
alternating blocks of 3 steps in one process (10 blocks each), medians.

    PYTHONPATH=. python docs/training_stability/overhead.py
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import torch

from massive_lens.train import get_preset
from massive_lens.train.model import MassiveLM, MassiveLMConfig
from massive_lens.train.recorder import StepRecorder
from massive_lens.train.trainer import make_optimizer


def step(model: MassiveLM, opt: Any, batch: torch.Tensor, rec: StepRecorder | None) -> None:
    with rec.watching() if rec else contextlib.nullcontext():
        loss = model(batch, return_type="loss")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if rec:
        rec.row(step=0, loss=float(loss.detach()), grad_norm=float(norm), lr=0.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    torch.set_num_threads(1)
    cfg = get_preset("cpu")
    for variant in ("softmax", "kv_bias"):
        torch.manual_seed(0)
        model = MassiveLM(MassiveLMConfig(**{**cfg.model, "attention": variant}))
        opt, batch = make_optimizer(model, cfg), torch.randint(0, 256, (16, 128))
        step(model, opt, batch, None)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(10):
            for name in ("without", "with"):
                with StepRecorder(model) if name == "with" else contextlib.nullcontext() as rec:
                    start = time.process_time()
                    for _ in range(3):
                        step(model, opt, batch, rec)
                    times[name].append((time.process_time() - start) / 3)
        with_, without = (sorted(times[k])[len(times[k]) // 2] for k in ("with", "without"))
        print(variant, json.dumps(dict(s_per_step_with=with_, s_per_step_without=without,
                                       overhead=with_ / without - 1)), flush=True)


if __name__ == "__main__":
    main()
