"""Issue 28's speed rows: CPU-time ratios, on one torch thread, of ``trace_origin`` (64 and 128 tokens;
every massive activation, and one given target) and of ``decompose_attention`` (sinks given and found) and
``sink_census`` (128 tokens) to a plain forward pass; issue 40's ``sink_circuit`` (128 tokens, the split
without the causal check); issue 50's ``sink_attention``, ``dormant_heads`` and ``find_sinks`` (sinks found,
128 tokens), ``sink_kv`` (sinks found and given, 128 tokens), and the attention analyses with
``attention="eager"``; ``sink_strength``, ``compression_valley`` (``ablate=None``) and ``sink_dependence``'s
untouched pass (``heads=[]``, two sequences, against a forward of both) at 128 tokens; ``offswitch``
(``precision=False``) at 128 tokens.

``python scripts/speed_ratios.py default 7`` (the model, then the repeats; ``qwen2.5-coder-1.5b 3``; a third
argument, e.g. ``trace_origin``, times only those comma-separated cases and their baselines).
Prints JSON: the median CPU seconds of every case (interleaved, one interpreter) and the ratios.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks`
from benchmarks.harness import median_times
from massive_lens import load_model, trace_origin
from massive_lens.attention import (
    decompose_attention,
    dormant_heads,
    find_sinks,
    sink_attention,
    sink_census,
    sink_circuit,
    sink_kv,
)
from massive_lens.core.corpora import token_batches
from massive_lens.core.model_view import ModelView
from massive_lens.effects import compression_valley
from massive_lens.handover import offswitch
from massive_lens.interventions import sink_dependence, sink_strength


def main(name: str, repeats: int, only: str | None = None) -> dict:
    torch.set_num_threads(1)  # CPU time is steady on one thread (spinning threads count under load)
    model = load_model(None if name == "default" else name)
    view = ModelView(model)
    two = next(token_batches(view, None, seq_len=128, batch_size=2))[:2, :128]
    tokens = two[:1]
    short = tokens[:, :64]

    def forward(t: torch.Tensor) -> None:
        with torch.no_grad():
            model(t.to(view.input_device))

    target = trace_origin(model, short).targets.iloc[0]  # the given-target case traces the first one found
    target128 = trace_origin(model, tokens).targets.iloc[0]
    cases = {"forward64": lambda: forward(short), "trace_origin": lambda: trace_origin(model, short),
             "trace_origin given": lambda: trace_origin(model, short, dim=int(target.dim), pos=int(target.pos)),
             "forward128": lambda: forward(tokens),
             "trace_origin 128": lambda: trace_origin(model, tokens),
             "trace_origin given 128": lambda: trace_origin(model, tokens, dim=int(target128.dim),
                                                            pos=int(target128.pos)),
             "decompose given": lambda: decompose_attention(model, tokens, sinks=[0]),
             "decompose found": lambda: decompose_attention(model, tokens),
             "sink_census": lambda: sink_census(model, tokens),
             "sink_circuit": lambda: sink_circuit(model, tokens),
             "sink_attention": lambda: sink_attention(model, tokens),
             "dormant_heads": lambda: dormant_heads(model, tokens),
             "find_sinks": lambda: find_sinks(model, tokens),
             "sink_kv": lambda: sink_kv(model, tokens), "sink_kv given": lambda: sink_kv(model, tokens, sinks=[0]),
             "decompose found eager": lambda: decompose_attention(model, tokens, attention="eager"),
             "sink_census eager": lambda: sink_census(model, tokens, attention="eager"),
             "sink_attention eager": lambda: sink_attention(model, tokens, attention="eager"),
             "dormant_heads eager": lambda: dormant_heads(model, tokens, attention="eager"),
             "forward128x2": lambda: forward(two),
             "sink_strength": lambda: sink_strength(model, tokens, pos=[0, 1]),
             "sink_dependence": lambda: sink_dependence(model, two, heads=[], seq_len=128, n_seqs=2, progress=False),
             "compression_valley": lambda: compression_valley(model, tokens, seq_len=128, n_seqs=1, ablate=None),
             "offswitch": lambda: offswitch(model, tokens, precision=False)}
    base = {"trace_origin": "forward64", "trace_origin given": "forward64", "trace_origin 128": "forward128",
            "trace_origin given 128": "forward128", "decompose given": "forward128",
            "decompose found": "forward128", "sink_census": "forward128", "sink_circuit": "forward128",
            **{k: "forward128" for k in ("sink_attention", "dormant_heads", "find_sinks", "sink_kv", "sink_kv given",
                                         "decompose found eager",
                                         "sink_census eager", "sink_attention eager", "dormant_heads eager",
                                         "sink_strength", "compression_valley", "offswitch")},
            "sink_dependence": "forward128x2"}
    if only:  # these cases and their baselines only
        keep = set(only.split(","))
        if keep - set(base):
            raise SystemExit(f"unknown cases {sorted(keep - set(base))}; choose from {sorted(base)}")
        cases = {k: f for k, f in cases.items() if k in keep or k in {base[c] for c in keep if c in base}}
    s = median_times(cases, repeats, clock=time.process_time)
    ratios = {k: s[k] / s[b] for k, b in base.items() if k in s}
    return {"model": view.name, "repeats": repeats, "cpu_seconds": s, "ratios": ratios}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None), indent=1))
