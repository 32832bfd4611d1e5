"""sink_attention and decompose_attention: exact reconstruction on every family (GQA, value
biases, Gemma's post-norm), constancy statistics, bad input, and the real default model."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError
from massive_lens.attention import decompose_attention, sink_attention
from massive_lens.attention.sinks import SinkSet, sink_term

TEXTS = ["The cat sat on the mat. It slept.", "Numbers: 1, 2, 3!"]  # unequal lengths: padding


def test_reconstruction_every_family(tiny):
    with untouched(tiny):
        for sinks in (None, [0, 3]):
            result = decompose_attention(tiny, TEXTS, sinks=sinks)
            assert result.reconstruction_error < 1e-4
            assert result.sink.shape == result.content.shape
            assert result.sink.shape[:2] == (tiny.cfg.n_layers, len(TEXTS))


def test_terms_sum_to_the_models_own_attention_output(tiny):
    """sink + content + b_O against the attention output read from a cache of its own (the
    decomposition no longer keeps the output during its pass); an output that is not the heads'
    outputs through W_O is refused, in the pass that finds the sinks and given them."""
    from massive_lens.core.model_view import ModelView

    view = ModelView(tiny)
    batch = view.tokenize(TEXTS)
    result = decompose_attention(tiny, TEXTS, attention="eager")
    name = "attn.o.hook_out" if view.has_hook(0, "attn.o.hook_out") else "attn.hook_out"
    _, cache = tiny.run_with_cache(batch.tokens, attention_mask=batch.mask.long(),
                                   names_filter=lambda n: n.endswith(name))
    real = batch.mask[..., None]
    for i, layer in enumerate(result.layers):
        out = cache[view.hook_name(layer, name)]
        rebuilt = result.sink[i] + result.content[i] + result.bias[i]
        assert float(((rebuilt - out) * real).norm() / (out * real).norm()) < 1e-4
    shift = [(view.hook_name(1, n), lambda act, hook: act + 1.0) for n in {name, "attn.hook_out"}]
    for sinks in (None, [0]):
        for attention in ("auto", "eager"):
            with tiny.hooks(fwd_hooks=shift), pytest.raises(MassiveLensError, match="misses the attention output"):
                decompose_attention(tiny, TEXTS, sinks=sinks, attention=attention)


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
    none = torch.tensor([], dtype=torch.long)
    monkeypatch.setattr(module, "candidate_columns", lambda view, batch: none)  # no candidate column kept
    again = real(tiny, TEXTS)
    assert len(passes) == 1 and torch.equal(passes[0].mask, found.sink_mask)  # the second pass, sinks given
    torch.testing.assert_close(again.sink, found.sink, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["lse", "eager"])
def test_sink_attention_finds_and_measures_in_one_pass(tiny, monkeypatch, attention):
    """sink_attention with sinks=None finds them and reads their mass in one pass (a few candidate
    key columns kept per layer): the table equals a run given the same sinks; a sink outside the
    candidates costs a second pass, given the sinks, and gives the same table."""
    import massive_lens.attention.mass as module
    from massive_lens.core.lse import lse_support
    from massive_lens.core.model_view import ModelView

    if attention == "lse" and lse_support(ModelView(tiny)) is not None:
        pytest.skip("this family reads the eager pattern")
    found = sink_attention(tiny, TEXTS, attention=attention)
    given = sink_attention(tiny, TEXTS, sinks=found.sinks, attention=attention)
    pd.testing.assert_frame_equal(found.to_frame(), given.to_frame(), rtol=1e-5, atol=1e-6)
    passes = []
    real, real_from = module.sink_attention, module.sinks_from

    def with_a_sink_at_3(*args):  # the rule also finds position 3, outside the candidates
        s = real_from(*args)
        mask = s.mask.clone()
        mask[:, 3] = True
        return SinkSet(mask, s.kinds, s.source, s.by_attention, s.by_massive, s.attention)

    monkeypatch.setattr(module, "sink_attention", lambda *a, **k: passes.append(k["sinks"]) or real(*a, **k))
    monkeypatch.setattr(module, "candidate_columns", lambda view, batch: torch.tensor([], dtype=torch.long))
    monkeypatch.setattr(module, "sinks_from", with_a_sink_at_3)
    again = real(tiny, TEXTS, attention=attention)
    assert len(passes) == 1 and passes[0].mask[:, 3].all()  # the second pass, given the sinks
    pd.testing.assert_frame_equal(again.to_frame(), real(tiny, TEXTS, sinks=passes[0], attention=attention).to_frame())
    assert not again.to_frame()["sink_mass"].equals(found.to_frame()["sink_mass"])


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


def test_reductions_from_factors_equal_the_built_vectors():
    """The sink term's constancy sums are read from its factors (attention on a few sinks times
    their values): the same as from the vectors built."""
    from massive_lens.attention.constancy import reductions

    gen = torch.Generator().manual_seed(0)
    a, basis = torch.rand(2, 3, 7, 2, generator=gen), torch.randn(2, 3, 2, 16, generator=gen)
    keep = torch.rand(2, 7, generator=gen) > 0.3
    for got, want in zip(reductions(a, keep, basis=basis), reductions(a @ basis, keep), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
