"""Training-throughput benchmarks for MassiveLM (called from ``massive_lens.bench``).

Two ratios, each measured by interleaving the two contenders in one process (A, B, A,
B, ...) so machine noise hits both alike:

* hooks idle: tokens/s of MassiveLM with its HookPoints (none attached) over the same
  model built with ``hook_points=False`` (plain identities). Goal >= 0.9.
* softmax1 over plain softmax, both fused. Goal >= 0.8.

Each contender's time is its best round (the least disturbed by other processes). With
``clock="cpu"`` (the default) time is this process's CPU time with one torch thread, which
other jobs on a shared machine barely disturb; ``clock="wall"`` uses wall time and the
current thread count.

>>> rows = bench_training(steps=1, repeats=1, n_layers=1, d_model=32, n_ctx=16, batch=2)
>>> [r["name"] for r in rows]
['train: hooks idle vs no hook points', 'train: softmax1 vs softmax']
"""

from __future__ import annotations

import time
from typing import Any

import torch

from massive_lens.train.model import MassiveLM, MassiveLMConfig


def _trainer_step(model: MassiveLM, tokens: torch.Tensor) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(tokens, return_type="loss").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _interleaved(a: Any, b: Any, steps: int, repeats: int, clock: Any) -> tuple[float, float]:
    """Best (least disturbed) time of ``steps`` calls, over ``repeats`` interleaved rounds."""
    a(), b()  # warm-up
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((a, b)):
            t0 = clock()
            for _ in range(steps):
                fn()
            best[i] = min(best[i], clock() - t0)
    return best[0], best[1]


def bench_training(
    steps: int = 5, repeats: int = 3, n_layers: int = 2, d_model: int = 128,
    n_ctx: int = 128, batch: int = 8, clock: str = "cpu",
) -> list[dict[str, Any]]:
    """Rows ``{"name", "ratio", "goal", "detail"}``; ratio = tokens/s of the first over the second."""
    shape = dict(n_layers=n_layers, d_model=d_model, n_heads=max(1, d_model // 32), n_ctx=n_ctx)
    tokens = torch.randint(0, 256, (batch, n_ctx))
    n_tokens = steps * tokens.numel()

    def build(**fields: Any) -> MassiveLM:
        torch.manual_seed(0)
        return MassiveLM(MassiveLMConfig(**shape, **fields)).train()

    timer = time.process_time if clock == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    rows = []
    pairs = [
        ("train: hooks idle vs no hook points", 0.9, dict(), dict(hook_points=False)),
        ("train: softmax1 vs softmax", 0.8, dict(attention="softmax1"), dict(attention="softmax")),
    ]
    try:
        if clock == "cpu":
            torch.set_num_threads(1)
        for name, goal, first, second in pairs:
            t_a, t_b = _interleaved(_trainer_step(build(**first), tokens),
                                    _trainer_step(build(**second), tokens), steps, repeats, timer)
            rows.append(dict(
                name=name, ratio=t_b / t_a, goal=goal,
                detail=f"{n_tokens / t_a:.0f} vs {n_tokens / t_b:.0f} tokens/s, {clock} time "
                       f"({n_layers} layers, d_model {d_model}, {batch}x{n_ctx} tokens/step)",
            ))
    finally:
        torch.set_num_threads(threads)
    return rows
