"""Origin: :func:`massive_lens.trace_origin` (no verification) against one plain forward pass,
in this process's CPU time (other jobs on a shared machine barely move it; wall-clock ratios
swung by 0.3x under load).

>>> from massive_lens import tiny_model
>>> from massive_lens.core.corpora import token_batches
>>> from massive_lens.core.model_view import ModelView
>>> model = tiny_model("llama")
>>> tokens = next(token_batches(ModelView(model), None, seq_len=16, batch_size=1))
>>> [r.goal for r in rows(model, tokens, repeats=1)]
[2.0, 2.0]
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.harness import Row, median_times
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.origin import trace_origin

SEQ_LEN = 64
GOAL = 1.3  # issue 28


def rows(model: Any, tokens: torch.Tensor, repeats: int = 7) -> list[Row]:
    one = tokens[:1, :SEQ_LEN]
    try:
        found = trace_origin(model, one).targets.iloc[0]
        every: dict[str, Any] = {}
    except MassiveLensError:  # nothing massive (a random tiny model): the largest entry at BOS
        every = {"pos": 0}
        found = trace_origin(model, one, **every).targets.iloc[0]

    def plain() -> None:
        with torch.no_grad():
            model(one)

    seconds = median_times({
        "plain forward": plain,
        "trace all massive": lambda: trace_origin(model, one, **every),
        "trace given dim/pos": lambda: trace_origin(model, one, dim=int(found.dim), pos=int(found.pos)),
    }, repeats, clock=time.process_time)
    base = seconds["plain forward"]
    return [Row("origin", f"trace_origin, {name} ({one.shape[1]} tokens, no verify) / plain forward",
                seconds[name] / base, GOAL,
                f"median of {repeats}: {seconds[name] * 1e3:.0f} ms vs {base * 1e3:.0f} ms CPU time",
                ModelView(model).name)
            for name in ("trace all massive", "trace given dim/pos")]
