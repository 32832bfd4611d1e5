"""Attention: intervention perplexity runs against the plain perplexity run, and
``decompose_attention``, ``sink_census``, ``sink_kv`` and ``dormant_heads`` over all layers
against one plain forward pass, in this process's CPU time."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.harness import Row, fit_batch, median_times
from massive_lens.attention import decompose_attention, dormant_heads, sink_census, sink_kv
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import bias_surgery, calibrate, fix_sink_term
from massive_lens.metrics import perplexity

N_SEQS, SEQ_LEN = 4, 128
INTERVENTION_GOAL = 1.15  # issue 28
DECOMPOSE_GOAL = SINK_GOAL = 1.1  # issue 50: every attention analysis within 1.1x a plain forward (was 1.5, 1.3)
# issue 22's analyses, each against one forward pass (sinks given, as after a census: finding them is one more pass)
SINKS = {"sink_census": lambda model, one: sink_census(model, one),
         "sink_kv (sinks given)": lambda model, one: sink_kv(model, one, sinks=[0]),
         "dormant_heads (sinks given)": lambda model, one: dormant_heads(model, one, sinks=[0])}


def rows(model: Any, tokens: torch.Tensor, repeats: int = 3) -> list[Row]:
    view = ModelView(model)
    n = fit_batch(model, N_SEQS, SEQ_LEN)  # fewer sequences on a large model
    evaluate, calibration = tokens[:n, :SEQ_LEN], tokens[n:2 * n, :SEQ_LEN]
    calib = calibrate(model, calibration, seq_len=SEQ_LEN, n_seqs=len(calibration), progress=False)
    hooks = {"fix_sink_term": fix_sink_term(model, "mean", calibration=calib),
             "bias_surgery": bias_surgery(model, calibration=calib)}
    runs = {"plain": lambda: perplexity(model, evaluate, batch_size=n, progress=False)}
    for name, iv in hooks.items():
        runs[name] = lambda iv=iv: perplexity(model, evaluate, batch_size=n, hooks=iv, progress=False)
    one = evaluate[:1]

    def forward() -> None:
        with torch.no_grad():
            model(one.to(view.input_device))

    runs["forward"] = forward
    runs["decompose, sinks given"] = lambda: decompose_attention(model, one, sinks=[0])
    runs["decompose, sinks found in the same pass"] = lambda: decompose_attention(model, one)
    for name, call in SINKS.items():
        runs[name] = lambda call=call: call(model, one)
    seconds = median_times(runs, repeats, clock=time.process_time)  # CPU time: steady on a shared machine
    out = [Row("attention", f"intervention perplexity run ({name}) / plain perplexity run",
               seconds[name] / seconds["plain"], INTERVENTION_GOAL,
               f"{len(evaluate)}x{SEQ_LEN} tokens, median {seconds[name]:.2f} s vs {seconds['plain']:.2f} s", view.name)
           for name in hooks]
    for name in ("decompose, sinks given", "decompose, sinks found in the same pass"):
        out.append(Row("attention", f"decompose_attention (all layers, {name.split(', ')[1]}) / one forward",
                       seconds[name] / seconds["forward"], DECOMPOSE_GOAL,
                       f"{view.n_layers} layers, {one.shape[1]} tokens, median {seconds[name]:.2f} s vs "
                       f"{seconds['forward']:.2f} s", view.name))
    for name in SINKS:
        out.append(Row("attention", f"{name} (all layers) / one forward", seconds[name] / seconds["forward"], SINK_GOAL,
                       f"{view.n_layers} layers, {one.shape[1]} tokens, median {seconds[name]:.2f} s vs "
                       f"{seconds['forward']:.2f} s", view.name))
    return out
