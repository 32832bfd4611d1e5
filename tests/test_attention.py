"""sink_attention and decompose_attention: exact reconstruction on every family (GQA, value
biases, Gemma's post-norm), constancy statistics, bad input, and the real default model."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError
from massive_lens.attention import decompose_attention, sink_attention
from massive_lens.attention.sinks import sink_term

TEXTS = ["The cat sat on the mat. It slept.", "Numbers: 1, 2, 3!"]  # unequal lengths: padding


def test_reconstruction_every_family(tiny):
    with untouched(tiny):
        for sinks in (None, [0, 3]):
            result = decompose_attention(tiny, TEXTS, sinks=sinks)
            assert result.reconstruction_error < 1e-4
            assert result.sink.shape == result.content.shape
            assert result.sink.shape[:2] == (tiny.cfg.n_layers, len(TEXTS))


def test_sinks_found_in_the_same_pass_split_as_when_given(tiny, monkeypatch):
    """decompose_attention finds the sinks in its own pass (keeping a few candidate key columns per
    layer): the terms equal those of a run given the same sinks; a sink outside the candidates
    costs a second pass and gives the same terms, never a wrong split."""
    import massive_lens.attention.decompose as module

    found = decompose_attention(tiny, TEXTS)
    given = decompose_attention(tiny, TEXTS, sinks=found.sinks)
    for name in ("sink", "content"):
        torch.testing.assert_close(getattr(found, name), getattr(given, name), rtol=1e-4, atol=1e-5)
    passes = []
    real = module.decompose_attention
    monkeypatch.setattr(module, "decompose_attention", lambda *a, **k: passes.append(k["sinks"]) or real(*a, **k))
    monkeypatch.setattr(module, "_candidates", lambda view, batch: torch.tensor([], dtype=torch.long))  # none kept
    again = real(tiny, TEXTS)
    assert len(passes) == 1 and torch.equal(passes[0].mask, found.sink_mask)  # the second pass, sinks given
    torch.testing.assert_close(again.sink, found.sink, rtol=1e-4, atol=1e-5)


def test_sink_term_matches_model_z_under_gqa(family):
    """With every key a 'sink', the sink term is the model's own z: checks the kv-head map."""
    from massive_lens import tiny_model

    model = tiny_model(family)
    _, cache = model.run_with_cache(torch.tensor([[256, 72, 105, 33, 10]]))
    pattern, v, z = (cache[f"blocks.1.attn.{h}"] for h in ("hook_pattern", "hook_v", "hook_z"))
    torch.testing.assert_close(sink_term(pattern, v, torch.ones(1, 5, dtype=torch.bool)), z)
    if v.shape[2] < pattern.shape[1]:  # GQA: repeating kv heads the wrong way breaks it
        wrong = torch.einsum("bhqk,bkhd->bqhd", pattern, v.repeat(1, 1, pattern.shape[1] // v.shape[2], 1))
        assert not torch.allclose(wrong, z)


def test_constancy_columns_and_ranges(tiny):
    frame = decompose_attention(tiny, TEXTS, layers=[0, 2], sinks=[0]).to_frame()
    assert list(frame.columns) == ["layer", "head", "term", "norm", "rel_std_pos", "cos_pos",
                                   "rel_std_text", "cos_text"]
    assert set(frame["layer"]) == {0, 2} and set(frame["term"]) == {"sink", "content"}
    assert frame["cos_pos"].between(-1.0001, 1.0001).all() and (frame["norm"] >= 0).all()


def test_sink_attention_frame(tiny):
    with untouched(tiny):
        result = sink_attention(tiny, TEXTS, sinks=[0])
    frame = result.to_frame()
    assert len(frame) == tiny.cfg.n_layers * tiny.cfg.n_heads
    assert frame["sink_mass"].between(0, 1).all() and 0 <= result.sink_metric <= 1
    assert "sink metric" in result.summary()


@pytest.mark.parametrize("kwargs", [dict(sinks=[99]), dict(sinks=[]), dict(threshold=1.5),
                                    dict(sinks=torch.ones(3, dtype=torch.bool))])
def test_bad_input(kwargs):
    from massive_lens import tiny_model

    model = tiny_model("llama")
    with pytest.raises(MassiveLensError):
        sink_attention(model, "Hello.", **kwargs)


def test_bad_layer():
    from massive_lens import tiny_model

    with pytest.raises(MassiveLensError, match="out of range"):
        decompose_attention(tiny_model("gpt2"), "Hi.", layers=7)


@pytest.mark.slow
def test_default_model_sink_is_a_constant_bias(default_model):
    texts = ["The history of the city begins in the Roman era, when a fort stood by the river.",
             "Photosynthesis converts light into chemical energy stored in sugar molecules."]
    with untouched(default_model):
        result = decompose_attention(default_model, texts)
        sinks = sink_attention(default_model, texts)
    assert result.reconstruction_error < 1e-4
    assert result.sink_mask[:, 0].all() and result.sink_source.startswith("positions with massive")
    frame = result.to_frame()
    late = frame[frame["layer"] > frame["layer"].max() // 2]
    sink, content = (late[late["term"] == t] for t in ("sink", "content"))
    # the sink term is nearly the same vector at every query and for every text; content is not
    assert sink["cos_pos"].median() > 0.9 and sink["cos_text"].median() > 0.9
    assert sink["cos_pos"].median() > content["cos_pos"].median() + 0.2
    assert sinks.sink_metric > 0.3 and sinks.to_frame()["sink_mass"].mean() > 0.3
