"""dormant_heads on a planted tiny model: in layer DORMANT_LAYER the heads of the first half of the
kv heads put their attention on BOS (the planted sink of test_census) and read a value that is
exactly zero there, so their output vanishes; the other heads of that layer read a large value.
The analysis finds exactly the planted heads, on llama, gpt2 and qwen2."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from planting import SINK_DIM
from test_census import N_LAYERS, _tokens, plant_secondary

from massive_lens import tiny_model
from massive_lens.attention.dormant import dormant_heads
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.heads import zero_dormant_heads

DORMANT_LAYER, LOUD = 4, 50.0


def plant_dormant(model):
    """``plant_secondary``, then silence BOS's value for the first half of the kv heads of
    ``DORMANT_LAYER`` and make it loud for the others. Returns the dormant (layer, head) pairs."""
    plant_secondary(model)
    attn = model.blocks[DORMANT_LAYER].attn
    n_kv, n_heads = attn.W_V.shape[0], attn.W_Q.shape[0]
    with torch.no_grad():
        attn.W_V[: n_kv // 2, SINK_DIM] = 0.0
        attn.W_V[n_kv // 2:, SINK_DIM] *= LOUD
        if getattr(attn, "b_V", None) is not None:
            attn.b_V[: n_kv // 2] = 0.0
    group = n_heads // n_kv
    return [(DORMANT_LAYER, h) for h in range(n_heads) if h // group < n_kv // 2]


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def planted(request):
    model = tiny_model(request.param, num_hidden_layers=N_LAYERS)
    return model, plant_dormant(model)


def test_finds_exactly_the_planted_dormant_heads(planted):
    model, expected = planted
    with untouched(model):
        result = dormant_heads(model, _tokens(model), sinks=[0])
    assert result.heads(1.0) == expected and result.heads(0.01) == expected
    f = result.to_frame().set_index(["layer", "head"])
    assert (f.loc[expected, "sink_mass"] > 0.9).all() and (f.loc[expected, "norm_ratio"] < 0.05).all()
    assert "2 of" in result.summary() or f"{len(expected)} of" in result.summary()


def test_thresholds_matter(planted):
    """A stricter sink share than the planted heads reach finds none (the test can fail)."""
    model, expected = planted
    result = dormant_heads(model, _tokens(model), sinks=[0], sink_share=0.999)
    assert result.heads(0.01) == []
    assert result.plot().get_xlabel() == "attention on the sinks"


def test_bad_thresholds():
    with pytest.raises(MassiveLensError, match="sink_share"):
        dormant_heads(tiny_model("llama"), "Hi there.", sink_share=1.5)


def test_zero_dormant_heads_zeroes_exactly_them(planted):
    """The intervention finds the planted heads on calibration tokens, and running under it equals
    the model with those heads' W_O rows zeroed (an independent edit)."""
    model, expected = planted
    tokens = _tokens(model)
    with untouched(model):
        iv = zero_dormant_heads(model, calibration=tokens)
        assert iv.heads == expected
        with torch.no_grad(), iv:
            edited = model(tokens)
        plain = model(tokens)
    assert not torch.allclose(edited, plain)  # the heads' tiny outputs still change the logits a little
    layer = model.blocks[DORMANT_LAYER].attn
    saved = layer.W_O.detach().clone()
    try:
        with torch.no_grad():
            for _, h in expected:
                layer.W_O[h] = 0.0
            torch.testing.assert_close(model(tokens), edited, rtol=1e-5, atol=1e-5)
    finally:
        with torch.no_grad():
            layer.W_O.copy_(saved)


def test_zero_named_heads_and_bad_head():
    model = tiny_model("llama")
    assert zero_dormant_heads(model, heads=[(1, 0), (1, 0), (0, 2)]).heads == [(0, 2), (1, 0)]
    with pytest.raises(MassiveLensError, match="out of range"):
        zero_dormant_heads(model, heads=[(0, 99)])


def test_shares_and_random_control(planted):
    model, expected = planted
    tokens = _tokens(model)
    n = model.cfg.n_layers * model.cfg.n_heads
    share = len(expected) / n
    assert zero_dormant_heads(model, calibration=tokens, share=share).heads == expected
    drawn = [zero_dormant_heads(model, share=share, order="random", seed=s).heads for s in range(3)]
    assert all(len(d) == len(expected) for d in drawn) and len({tuple(d) for d in drawn}) > 1
    with pytest.raises(MassiveLensError, match="share"):
        zero_dormant_heads(model, share=0.0)


def test_an_empty_sink_mask_gives_no_sink_mass():
    """Sinks given as an all-False mask: no head puts attention on a sink (every mass 0, no dormant head), a table
    for every layer and head rather than an error out of the empty columns."""
    model = tiny_model("llama")
    text = ["Hello there, my friend.", "Bye now!"]
    n = len(ModelView(model).tokenize(text).tokens[0])
    result = dormant_heads(model, text, sinks=torch.zeros(2, n, dtype=torch.bool))
    frame = result.to_frame()
    assert len(frame) == 2 * model.cfg.n_layers * model.cfg.n_heads
    assert (frame["sink_mass"] == 0).all() and not frame["dormant"].any() and (frame["out_norm"] > 0).all()
