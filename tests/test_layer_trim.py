"""At length the attention pass hands glibc's freed transients back every few layers (core.budget.LayerTrim in
core.pass_reader): what an analysis keeps of each layer lands between them, and without the trims they pile up
as resident memory nothing uses (at 4,096 tokens on SmolLM2 sink_kv peaked at 1.2-1.5x the SDPA forward's memory,
0.8x with them; at 8,192 trace_origin 1.4-1.6x, 0.7x: docs/benchmarks.md issue 50 round 12). Below TRIM_BYTES a
layer never trims: each trim would cost the next layer's page faults."""

from __future__ import annotations

import pytest
from helpers import untouched

import massive_lens.core.attention_pass as attention_pass
import massive_lens.core.budget as budget
import massive_lens.core.pass_reader as pass_reader
from massive_lens import decompose_attention, sink_attention, tiny_model, trace_origin
from massive_lens.attention import dormant_heads, sink_circuit, sink_kv
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
    for small in (budget.LayerTrim(128, 576, every=1), budget.LayerTrim(4096, 576, every=0)):
        small()  # 288 kB a layer, its transients reused; every 0: never
        small.now()
        assert not small.active and len(trims) == 3


ANALYSES = {
    "sink_kv": lambda model, n: sink_kv(model, TEXT),
    "sink_kv given": lambda model, n: sink_kv(model, TEXT, sinks=[0]),
    "decompose_attention": lambda model, n: decompose_attention(model, TEXT),
    "dormant_heads": lambda model, n: dormant_heads(model, TEXT),
    "sink_attention": lambda model, n: sink_attention(model, TEXT),
    "trace_origin": lambda model, n: trace_origin(model, TEXT, dim=0, pos=0),  # random weights: nothing massive
    "sink_circuit": lambda model, n: sink_circuit(model, TEXT, heads=[(layer, 0) for layer in range(n)],
                                                  rule=SinkRule(threshold=1e-6), progress=False),
}


@pytest.mark.parametrize("analysis", list(ANALYSES))
@pytest.mark.parametrize("attention", ["eager", "lse"])
def test_the_pass_trims_every_layer_at_length(monkeypatch, analysis, attention):
    """With TRIM_BYTES this text's layer (TRIM_EVERY 1), each pass an analysis runs trims once per
    attention layer it hands over, on either path; a short text never trims."""
    handed = []

    class Counted(budget.LayerTrim):
        def __call__(self):
            handed.append(self.active)
            super().__call__()

    model = tiny_model("llama")
    view = ModelView(model)
    n_layers, layer_bytes = view.n_layers, view.tokenize(TEXT).mask.numel() * view.d_model * 4
    monkeypatch.setattr(pass_reader, "LayerTrim", Counted)
    monkeypatch.setattr(pass_reader, "TRIM_EVERY", 1)
    monkeypatch.setattr(attention_pass, "LSE_FROM", 0 if attention == "lse" else 10 ** 9)
    with untouched(model):
        ANALYSES[analysis](model, n_layers)
        assert handed and not any(handed)  # a short text: handed over, never trimmed
        handed.clear()
        monkeypatch.setattr(budget, "TRIM_BYTES", layer_bytes)  # this text's layer reaches it
        ANALYSES[analysis](model, n_layers)
    assert handed and all(handed) and len(handed) % n_layers == 0
