"""Benchmarks of the attention analyses and interventions (called by ``massive_lens.bench``).

Each row compares two measurements taken interleaved in one run on the same tokens, so
machine load affects both alike: the median over ``repeats`` of the per-repeat time ratio.

- an intervention's perplexity run vs the plain perplexity run (goal <= 1.15);
- ``decompose_attention`` over all layers on 128 tokens vs one plain forward (goal <= 3).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from massive_lens.corpora import Corpus


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ratio(work: Callable[[], Any], base: Callable[[], Any], repeats: int) -> tuple[float, float, float]:
    work(), base()  # warm-up
    pairs = [(_timed(work), _timed(base)) for _ in range(repeats)]
    best_work, best_base = min(w for w, _ in pairs), min(b for _, b in pairs)
    return best_work / best_base, best_work, best_base


def bench_attention(model: Any = None, corpus: Corpus = None, calibration: Corpus = None, *,
                    n_seqs: int = 4, seq_len: int = 128, repeats: int = 3) -> list[dict]:
    """Rows ``{"name", "ratio", "goal", "detail"}`` (ratio = measured cost / baseline)."""
    from massive_lens import load_model
    from massive_lens._model_view import ModelView
    from massive_lens.attention import decompose_attention
    from massive_lens.evaluate import perplexity, sequences
    from massive_lens.interventions import bias_surgery, calibrate, fix_sink_term

    model = model if model is not None else load_model()
    tokens = sequences(model, corpus, seq_len, n_seqs)
    calib = calibrate(model, calibration if calibration is not None else corpus, seq_len=seq_len,
                      n_seqs=n_seqs, progress=False)
    plain = lambda: perplexity(model, tokens, batch_size=n_seqs, progress=False)  # noqa: E731
    rows = []
    for name, build in (("fix_sink_term", lambda: fix_sink_term(model, "mean", calibration=calib)),
                        ("bias_surgery", lambda: bias_surgery(model, calib))):
        hooks = build()
        ratio, t_work, t_base = _ratio(
            lambda: perplexity(model, tokens, batch_size=n_seqs, hooks=hooks, progress=False), plain, repeats)  # noqa: B023
        rows.append(dict(name=f"intervention perplexity run ({name}) / plain perplexity run", ratio=ratio, goal=1.15,
                         detail=f"{n_seqs}x{seq_len} tokens, {t_work:.2f}s vs {t_base:.2f}s (best of {repeats})"))
    one = tokens[:1]
    view = ModelView(model)

    def forward() -> None:
        with torch.no_grad():
            view.model(one.to(view.input_device))

    for label, sinks in (("sinks given", [0]), ("sinks found by find_massive", None)):
        ratio, t_work, t_base = _ratio(lambda: decompose_attention(model, one, sinks=sinks), forward, repeats)  # noqa: B023
        rows.append(dict(name=f"decompose_attention (all layers, {label}) / one forward", ratio=ratio, goal=3.0,
                         detail=f"{view.n_layers} layers, {one.shape[1]} tokens, {t_work:.2f}s vs {t_base:.2f}s"))
    return rows
