"""Training throughput of :class:`~massive_lens.train.MassiveLM` (no pretrained model needed).

Two cost ratios, each contender timed interleaved with the other:

* hooks idle: time per step of MassiveLM with its HookPoints (none attached) over the same
  model built with ``hook_points=False`` (plain identities);
* softmax1 over plain softmax, both fused.

Time is this process's CPU time on one torch thread (``clock="cpu"``), which other jobs on
a shared machine barely disturb (wall-clock ratios swung wildly under load);
``clock="wall"`` uses wall time and the current thread count.

>>> [r.name for r in rows(steps=1, repeats=1, n_layers=1, d_model=32, n_ctx=16, batch=2)]
['train: hooks idle / no hook points', 'train: softmax1 / softmax']
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.harness import Row, median_times
from massive_lens.train.model import MassiveLM, MassiveLMConfig

PAIRS = [  # name, goal (cost ratio), measured model, baseline model
    ("train: hooks idle / no hook points", 1.1, dict(), dict(hook_points=False)),
    ("train: softmax1 / softmax", 1.25, dict(attention="softmax1"), dict(attention="softmax")),
]


def _steps(model: MassiveLM, tokens: torch.Tensor, steps: int) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> None:
        for _ in range(steps):
            model(tokens, return_type="loss").backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def rows(steps: int = 5, repeats: int = 3, n_layers: int = 2, d_model: int = 128, n_ctx: int = 128,
         batch: int = 8, clock: str = "cpu") -> list[Row]:
    shape = dict(n_layers=n_layers, d_model=d_model, n_heads=max(1, d_model // 32), n_ctx=n_ctx)
    tokens = torch.randint(0, 256, (batch, n_ctx))
    n_tokens = steps * tokens.numel()

    def build(**fields: Any) -> MassiveLM:
        torch.manual_seed(0)
        return MassiveLM(MassiveLMConfig(**shape, **fields)).train()

    timer = time.process_time if clock == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    out = []
    try:
        if clock == "cpu":
            torch.set_num_threads(1)
        for name, goal, measured, baseline in PAIRS:
            seconds = median_times({"measured": _steps(build(**measured), tokens, steps),
                                    "baseline": _steps(build(**baseline), tokens, steps)}, repeats, clock=timer)
            t_a, t_b = seconds["measured"], seconds["baseline"]
            out.append(Row("train", name, t_a / t_b, goal,
                           f"{n_tokens / t_a:.0f} vs {n_tokens / t_b:.0f} tokens/s, {clock} time ({n_layers} "
                           f"layers, d_model {d_model}, {batch}x{n_ctx} tokens/step)"))
    finally:
        torch.set_num_threads(threads)
    return out
