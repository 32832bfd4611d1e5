"""Cost of :func:`massive_lens.trace_origin` relative to one plain forward pass.

Goal (issue 3): tracing one 64-token text without verification costs at most 2x a plain
forward pass. Both are timed interleaved in one run (median of ``repeats``), so machine load
affects them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from massive_lens._model_view import ModelView
from massive_lens.corpora import token_batches
from massive_lens.errors import MassiveLensError

GOAL = 2.0


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_origin(model: Any = None, seq_len: int = 64, repeats: int = 7) -> list[dict[str, Any]]:
    """Rows ``{"name", "ratio", "goal", "detail"}``: trace_origin time / plain forward time.

    >>> from massive_lens import tiny_model
    >>> rows = bench_origin(tiny_model("llama"), seq_len=16, repeats=1)
    >>> [r["goal"] for r in rows]
    [2.0, 2.0]
    """
    from massive_lens import load_model
    from massive_lens.origin import trace_origin

    model = load_model() if model is None else model
    view = ModelView(model)
    tokens = next(token_batches(view, None, seq_len=seq_len, batch_size=1))
    try:
        found = trace_origin(model, tokens).targets.iloc[0]
        every: dict[str, Any] = {}
    except MassiveLensError:  # nothing massive (a random tiny model): the largest entry at BOS
        every = {"pos": 0}
        found = trace_origin(model, tokens, **every).targets.iloc[0]
    runs: dict[str, Callable[[], Any]] = {
        "plain forward": lambda: _plain(model, tokens),
        "trace all massive": lambda: trace_origin(model, tokens, **every),
        "trace given dim/pos": lambda: trace_origin(model, tokens, dim=int(found.dim), pos=int(found.pos)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(_timed(fn))
    base = statistics.median(times["plain forward"])
    return [
        {"name": f"trace_origin, {name} ({seq_len} tokens, no verify) / plain forward",
         "ratio": statistics.median(times[name]) / base, "goal": GOAL,
         "detail": f"median of {repeats}: {statistics.median(times[name]) * 1e3:.0f} ms vs {base * 1e3:.0f} ms "
                   f"({view.name})"}
        for name in ("trace all massive", "trace given dim/pos")
    ]


def _plain(model: Any, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        model(tokens)
