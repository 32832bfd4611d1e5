"""The LSE-path analyses' CPU time against a plain SDPA forward, interleaved in one interpreter.

Each round calls the SDPA forward, ``decompose_attention``, ``sink_attention`` and ``sink_census``
in turn on the same model and tokens (the offline default text at ``LENGTH`` tokens); the ratio
is the minimum over rounds of each call's CPU time over the forward's minimum. One interpreter
and interleaving make the ratio less sensitive to a shared machine's load than separate runs.

    OMP_NUM_THREADS=1 python -m benchmarks.lse_ratios 2048 3    # LENGTH ROUNDS; prints JSON
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main(argv: list[str]) -> None:
    import massive_lens as ml
    from massive_lens.core.corpora import token_batches
    from massive_lens.core.lse import lse_run
    from massive_lens.core.model_view import ModelView

    length, rounds = (int(a) for a in argv[:2])
    model = ml.load_model()
    view = ModelView(model)
    one = next(token_batches(view, None, seq_len=length, batch_size=1))

    def sdpa() -> None:
        with lse_run(view, implementation="sdpa"), torch.no_grad():
            model(one)

    calls = {"sdpa_forward": sdpa, "decompose_attention": lambda: ml.decompose_attention(model, one),
             "sink_attention": lambda: ml.sink_attention(model, one), "sink_census": lambda: ml.sink_census(model, one)}
    sdpa(), ml.decompose_attention(model, one[:, :32]), ml.sink_census(model, one[:, :32])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.process_time()
            call()
            times[name].append(time.process_time() - start)
    best = {name: min(t) for name, t in times.items()}
    print(json.dumps({"length": length, "cpu_seconds": times,
                      "ratio": {name: best[name] / best["sdpa_forward"] for name in best}}))


if __name__ == "__main__":
    main(sys.argv[1:])
