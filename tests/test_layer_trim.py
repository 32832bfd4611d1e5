"""The analyses that hold something of every layer across a pass hand glibc's freed transients back every few
layers at length (core.budget.LayerTrim; at 4,096 tokens on SmolLM2 sink_kv peaked at 1.3-1.5x the SDPA forward's
memory without, 0.8x with: docs/benchmarks.md issue 50 round 12), and never at short lengths, where each trim
would cost the next layer's page faults."""

from __future__ import annotations

import pytest
from helpers import untouched

import massive_lens.core.budget as budget
from massive_lens import decompose_attention, tiny_model
from massive_lens.attention import sink_circuit, sink_kv
from massive_lens.core.criterion import SinkRule
from massive_lens.core.model_view import ModelView

TEXT = "Hello there, world. The cat sat on the mat."


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(budget, "trim_allocator", lambda: calls.append(1))
    return calls


def test_every_nth_call_where_a_layer_is_large(trims):
    trim = budget.LayerTrim(4096, 576, every=3)
    for _ in range(7):
        trim()
    assert trim.active and len(trims) == 2
    trim.now()
    assert len(trims) == 3
    small = budget.LayerTrim(128, 576, every=1)  # 288 kB a layer: its transients are reused
    small()
    small.now()
    assert not small.active and len(trims) == 3


@pytest.mark.parametrize("analysis", ["sink_kv", "sink_kv given", "decompose_attention", "sink_circuit"])
def test_the_holding_analyses_trim_at_length(monkeypatch, trims, analysis):
    """With every layer counted as long (TRIM_BYTES 0) each holding analysis trims as it reads its layers; below
    TRIM_BYTES none does. sink_kv with its sinks given holds a few numbers a layer, and never trims."""
    import massive_lens.attention.circuit_split as circuit_split
    import massive_lens.attention.decompose as decompose
    import massive_lens.attention.kv as kv

    model = tiny_model("llama")
    n_layers = ModelView(model).n_layers
    for module in (kv, decompose, circuit_split):
        monkeypatch.setattr(module, "TRIM_EVERY", 1)
    run = {"sink_kv": lambda: sink_kv(model, TEXT), "sink_kv given": lambda: sink_kv(model, TEXT, sinks=[0]),
           "decompose_attention": lambda: decompose_attention(model, TEXT),
           "sink_circuit": lambda: sink_circuit(model, TEXT, heads=[(layer, 0) for layer in range(n_layers)],
                                                         rule=SinkRule(threshold=1e-6), progress=False)}[analysis]
    with untouched(model):
        run()
        assert not trims  # a short text: never
        monkeypatch.setattr(budget, "TRIM_BYTES", 0)
        run()
    if analysis == "sink_kv given":
        assert not trims
    elif analysis == "decompose_attention":  # each layer read, each split step, and once after the split
        assert len(trims) >= n_layers + 2
    else:
        assert len(trims) == n_layers
