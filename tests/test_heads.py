"""Per-head attribution of the origin ledger (``OriginTrace.heads``): the head terms sum to the
ledger's attention terms on every tiny family (post-norm ones included), and a head planted to
write an entry is the one named."""

from __future__ import annotations

import pytest
import torch

from massive_lens import tiny_model, trace_origin

TEXT = "Hi there. Bye now, friend."


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gemma3"])
def test_heads_sum_to_the_attention_terms(arch):
    model = tiny_model(arch)
    trace = trace_origin(model, TEXT, dim=5, pos=3)
    attn = trace.ledger[trace.ledger.component == "attn"].set_index("layer").contribution
    assert not trace.heads.empty
    assert set(trace.heads.layer) == set(attn.index)
    n_heads = model.cfg.n_heads
    for layer, rows in trace.heads.groupby("layer"):
        assert set(rows["head"][rows["head"] >= 0]) == set(range(n_heads))
        total = float(rows.contribution.sum())
        assert total == pytest.approx(float(attn[layer]), rel=1e-4, abs=1e-5 * (1 + abs(float(attn[layer]))))
    assert trace.heads.first_token_attention.between(0, 1).all()
    assert (trace.heads.max_attention >= trace.heads.first_token_attention - 1e-6).all()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_planted_head_is_named(arch):
    """Only head ``h`` of layer 1 writes dim ``d`` (its W_O row for d, others zeroed), scaled so
    that the write is large: the heads frame gives it the whole term, and the story names it."""
    model = tiny_model(arch)
    layer, head, dim, pos = 1, 2, 7, 4
    o_proj = model.original_model.model.layers[layer].self_attn.o_proj
    d_head = model.cfg.d_head
    tokens = model.to_tokens(TEXT)
    z = {}

    def grab(act, hook):
        z["z"] = act[0, pos, head].detach().clone()

    model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", grab)])
    with torch.no_grad():
        o_proj.weight[dim] = 0.0
        o_proj.weight[dim, head * d_head:(head + 1) * d_head] = 200.0 * z["z"] / z["z"].norm() ** 2
    trace = trace_origin(model, tokens, dim=dim, pos=pos)
    rows = trace.heads[(trace.heads.layer == layer) & (trace.heads["head"] >= 0)]
    top = rows.loc[rows.contribution.abs().idxmax()]
    assert int(top["head"]) == head and float(top.share) == pytest.approx(1.0, abs=1e-3)
    assert (rows[rows["head"] != head].contribution.abs() < 1e-4 * abs(float(top.contribution))).all()
    story = trace.summary()
    assert f"attn {layer} (head {head}:" in story, story
