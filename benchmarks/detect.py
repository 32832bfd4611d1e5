"""Detection: find_massive and scan_corpus against one plain forward pass (time and memory),
and what a notebook would do without them (cache everything, then reduce)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Row, fit_batch, median_times, memory_in_subprocess
from massive_lens.core.model_view import ModelView
from massive_lens.detect import find_massive, scan_corpus

N_SEQS, SEQ_LEN = 4, 512
GOALS = {"find_massive": 1.1, "scan_corpus": 1.1, "run_with_cache": None}
MEMORY_GOAL = 1.2


def cases(model: Any, tokens: torch.Tensor) -> dict[str, Callable[[], Any]]:
    def plain() -> Any:
        with torch.no_grad():
            return model(tokens)

    def naive() -> Any:  # what a notebook would do: cache everything, then reduce
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
        return [cache[f"blocks.{i}.hook_resid_post"].abs().amax() for i in range(model.cfg.n_layers)]

    return {
        "plain_forward": plain,
        "find_massive": lambda: find_massive(model, tokens),
        "scan_corpus": lambda: scan_corpus(model, tokens, seq_len=tokens.shape[1], batch_size=len(tokens),
                                           max_tokens=None, progress=False),
        "run_with_cache": naive,
    }


def batch(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The sequences the detect cases read: up to ``N_SEQS`` of ``SEQ_LEN`` tokens (fewer on a
    large model, see :func:`~benchmarks.harness.fit_batch`)."""
    return tokens[: fit_batch(model, N_SEQS, SEQ_LEN), :SEQ_LEN]


def rows(model: Any, tokens: torch.Tensor, repeats: int = 5, memory: bool = True) -> list[Row]:
    """Time rows, and with ``memory`` a peak-memory row per case (a fresh subprocess each)."""
    tokens = batch(model, tokens)
    name_of_model = ModelView(model).name
    seconds = median_times(cases(model, tokens), repeats)
    peaks = {name: memory_in_subprocess("detect", name, name_of_model) for name in ["plain_forward", *GOALS]
             if memory}
    shape = f"{len(tokens)}x{tokens.shape[1]} tokens"
    out = []
    for name, goal in GOALS.items():
        out.append(Row("detect", f"{name} time / plain forward", seconds[name] / seconds["plain_forward"], goal,
                       f"{shape}; median {seconds[name]:.2f} s vs {seconds['plain_forward']:.2f} s", name_of_model))
        if peaks:
            out.append(Row("detect", f"{name} peak memory / plain forward", peaks[name] / peaks["plain_forward"],
                           MEMORY_GOAL if goal else None,
                           f"{peaks[name]:.0f} MB vs {peaks['plain_forward']:.0f} MB above the loaded model",
                           name_of_model))
    return out
