"""scale_sink_attention (ZeroTuning) and its γ sweep: the edited pattern against the formula computed
here from the untouched pattern, γ = 1 as the identity, per-head γ touching only the named heads,
the sweep's pairing against γ = 1, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError, tiny_model
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import REGISTRY, scale_sink_attention, sink_scale_sweep
from massive_lens.interventions.sink_sweep import repeat_task
from massive_lens.metrics import perplexity

TEXT = "The cat sat on the mat. The dog ran, and the bird flew.\n" * 30


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _patterns(model, hooks=()):
    """Every layer's pattern on TEXT's first 120 characters, read in one pass just before and just
    after ``hooks`` (so each layer's edit is compared with the pattern it was given)."""
    view = ModelView(model)
    batch = view.tokenize(TEXT[:120])
    before, after = {}, {}

    def keep(into):
        return [(view.hook_name(layer, "attn.hook_pattern"),
                 lambda x, hook, layer=layer: into.__setitem__(layer, x.detach().clone()))
                for layer in range(view.n_layers)]

    view.forward(batch, [*keep(before), *hooks, *keep(after)])
    return before, after


@pytest.mark.parametrize("gamma", [0.25, 2.0])
def test_the_edited_pattern_is_the_renormalised_formula(model, gamma):
    with untouched(model):
        before, after = _patterns(model, scale_sink_attention(model, gamma).fwd_hooks)
    for layer, p in before.items():
        p0 = p[..., 0]
        denom = (1 - p0) + gamma * p0
        assert torch.allclose(after[layer][..., 0], gamma * p0 / denom, atol=1e-6)
        assert torch.allclose(after[layer][..., 1:], p[..., 1:] / denom[..., None], atol=1e-6)
        assert torch.allclose(after[layer].sum(-1), torch.ones_like(p0), atol=1e-5)
        assert torch.allclose(after[layer][:, :, 0], p[:, :, 0])  # the first token's own row: all on itself


def test_gamma_one_is_the_identity_and_per_head_gamma_touches_only_those_heads(model):
    plain = perplexity(model, TEXT, seq_len=16, n_seqs=2, progress=False)
    same = perplexity(model, TEXT, seq_len=16, n_seqs=2, hooks=scale_sink_attention(model, 1.0), progress=False)
    assert torch.allclose(plain.per_seq, same.per_seq, atol=1e-6)
    before, after = _patterns(model, scale_sink_attention(model, {(1, 0): 3.0}).fwd_hooks)
    for layer, p in before.items():
        changed = (after[layer] - p).abs().amax(dim=(0, 2, 3)) > 1e-6  # [head]
        assert changed.tolist() == [layer == 1 and h == 0 for h in range(p.shape[1])]


def test_the_registry_row_builds_and_halves_the_sink(model):
    row = REGISTRY["sink_attention_scaled"]
    assert not row.in_table3 and row.options == {"gamma": 0.5}
    iv = row.build(model, None)
    before, after = _patterns(model, iv.fwd_hooks)
    p0 = before[1][0, :, 1:, 0]
    assert torch.allclose(after[1][0, :, 1:, 0], 0.5 * p0 / (1 - 0.5 * p0), atol=1e-6)


@pytest.mark.parametrize(("gamma", "match"), [
    (0.0, "γ must be a finite number > 0"), (-1.0, "> 0"), (math.nan, "finite"), (True, "finite number"),
    ({}, "names no head"), ({(0, 99): 2.0}, "head 99 out of range"), ({(99, 0): 2.0}, "99"),
])
def test_bad_gammas_are_refused(model, gamma, match):
    with pytest.raises(MassiveLensError, match=match):
        scale_sink_attention(model, gamma)


def test_the_sweep_pairs_every_gamma_against_the_untouched_model(model):
    with untouched(model):
        sweep = sink_scale_sweep(model, TEXT, gammas=(0.5, 2.0), seq_len=16, n_seqs=3, repeat_len=5, repeat_seqs=3)
    f = sweep.to_frame().set_index(["gamma", "task"])
    base = f.xs(1.0, level="gamma")
    assert (base["ratio"] == 1.0).all() and (base["accuracy_change"] == 0.0).all()
    plain = perplexity(model, TEXT, seq_len=16, n_seqs=3, progress=False)
    half = perplexity(model, TEXT, seq_len=16, n_seqs=3, hooks=scale_sink_attention(model, 0.5), progress=False)
    assert f.loc[(0.5, "text"), "ratio"] == pytest.approx(math.exp(float((half.per_seq - plain.per_seq).mean())),
                                                          rel=1e-5)
    assert (f["ratio_low"] <= f["ratio"] + 1e-12).all() and (f["ratio"] <= f["ratio_high"] + 1e-12).all()
    helped = sweep.helps()
    assert ((helped["ratio_high"] < 1) | (helped["change_low"] > 0)).all()
    assert ("no γ helps" in sweep.summary()) == helped.empty


def test_the_repeat_task_repeats_a_run_after_the_first_token():
    tokens = torch.arange(100).reshape(4, 25)
    rep = repeat_task(tokens, 6, 3, seed=1)
    assert rep.shape == (3, 13) and (rep[:, 0] == tokens[0, 0]).all()
    assert torch.equal(rep[:, 1:7], rep[:, 7:]) and torch.isin(rep[:, 1:], tokens[:, 1:]).all()


@pytest.mark.parametrize(("options", "match"), [
    (dict(gammas=()), "at least one γ other than 1"), (dict(gammas=(1.0,)), "other than 1"),
    (dict(gammas=(0.0,)), "> 0"), (dict(repeat_len=1), "repeat_len >= 2"),
])
def test_bad_sweeps_are_refused(model, options, match):
    with pytest.raises(MassiveLensError, match=match):
        sink_scale_sweep(model, TEXT, seq_len=16, n_seqs=2, **options)
