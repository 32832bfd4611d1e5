"""Which attention path is faster at a length: each attention analysis with ``attention="eager"``
and ``attention="lse"``, CPU time against a plain forward (the model's own, logits included), on
the default model, interleaved in one interpreter (median of ROUNDS).

    OMP_NUM_THREADS=1 python -m benchmarks.path_crossover 512 3    # LENGTH ROUNDS; prints JSON
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks.harness import median_times


def main(length: int, rounds: int) -> dict:
    from massive_lens import load_model
    from massive_lens.attention import decompose_attention, dormant_heads, find_sinks, sink_attention, sink_census
    from massive_lens.core.corpora import token_batches
    from massive_lens.core.model_view import ModelView

    torch.set_num_threads(1)
    model = load_model()
    tokens = next(token_batches(ModelView(model), None, seq_len=length, batch_size=1))[:1, :length]

    def forward() -> None:
        with torch.no_grad():
            model(tokens)

    cases = {"forward": forward}
    for name, fn in (("find_sinks", find_sinks), ("sink_attention", sink_attention), ("sink_census", sink_census),
                     ("dormant_heads", dormant_heads), ("decompose", decompose_attention)):
        for path in ("eager", "lse"):
            cases[f"{name} {path}"] = lambda fn=fn, path=path: fn(model, tokens, attention=path)
    s = median_times(cases, rounds, clock=time.process_time)
    return {"length": length, "cpu_seconds": s, "ratios": {k: s[k] / s["forward"] for k in s}}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2])), indent=1))
