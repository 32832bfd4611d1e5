"""The matrix's column for ``sink_circuit`` (issue 40): on every tiny planted model, the logit on
the first token of every head of every attention layer, split into parts, must add up to the
attention scores the model computed (read here by a hook on ``attn.hook_attn_scores``, not
through the split's code), per head and on average over the queries; an architecture the split does not
cover raises a ``MassiveLensError`` that names why (the matrix records it).
"""

from __future__ import annotations

from typing import Any

from massive_lens.attention import sink_circuit
from massive_lens.core.criterion import SinkRule
from massive_lens.core.model_view import ModelView

TOL = 1e-4  # relative, float32
LOW = SinkRule(threshold=1e-6)  # every head of a random model passes: the split is what is checked


def check_circuit(b: Any) -> str | None:
    cfg = b.model.cfg
    heads = [(layer, h) for layer in range(cfg.n_layers) for h in range(cfg.n_heads)]
    circuit = sink_circuit(b.model, b.tokens, heads=heads, rule=LOW)
    assert (circuit.heads["check"] < TOL).all(), circuit.heads[circuit.heads["check"] >= TOL]
    view, seen = ModelView(b.model), {}
    hooks = [(view.hook_name(layer, "attn.hook_attn_scores"),
              lambda x, hook, layer=layer: seen.__setitem__(layer, x.detach()[0, :, 1:, 0].float()))
             for layer in range(cfg.n_layers)]
    view.forward(view.tokenize(b.tokens), hooks)
    sums = circuit.to_frame().query("side == 'key'").groupby(["layer", "head"])["contribution"].sum()
    for (layer, head), total in sums.items():
        scores = seen[layer][head]
        want = float(scores.mean())
        assert abs(total - want) <= TOL * max(1.0, float(scores.abs().max())), (layer, head, total, want)
    return None


ANALYSES = {"sink_circuit": check_circuit}
