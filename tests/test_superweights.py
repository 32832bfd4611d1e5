"""verify_super_weights (issue 49): the detector's candidates against the damage each one does.

Known answer: a planted model whose detector ranks a harmless weight first (``plant_misranked``);
the interaction arithmetic against an independent computation; the model unchanged after every
call, a failing one included; bad inputs refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from planting import CULPRIT, DECOY, SINK_DIM, TEXT, bos_tokens, plant_misranked

import massive_lens.origin.superweights as sw
from massive_lens import MassiveLensError, perplexity, tiny_model, trace_origin
from massive_lens.origin import SuperWeightCheck, verify_super_weights


@pytest.fixture(scope="module")
def planted():
    return plant_misranked(tiny_model("llama"))


@pytest.fixture(scope="module")
def corpus(planted):
    return bos_tokens(planted, TEXT, 32, 8)


@pytest.fixture(scope="module")
def trace(planted, corpus):
    return trace_origin(planted, corpus[:1], dim=SINK_DIM, pos=0)


@pytest.fixture(scope="module")
def check(planted, trace, corpus):
    with untouched(planted):
        return verify_super_weights(planted, trace, corpus, progress=False)


def test_the_detectors_top_row_is_not_the_damaging_one(check):
    c = check.candidates.set_index("neuron")
    assert c.loc[DECOY, "detector_rank"] == 1 and c.loc[CULPRIT, "detector_rank"] == 2
    assert c.loc[DECOY, "contribution"] > c.loc[CULPRIT, "contribution"] > 0
    assert c.loc[CULPRIT, "verified"] and c.loc[CULPRIT, "low"] > 0 and c.loc[CULPRIT, "damage_rank"] == 1
    assert not c.loc[DECOY, "verified"] and c.loc[DECOY, "damage_rank"] == 2
    assert abs(c.loc[DECOY, "loss_delta"]) < 0.01 * c.loc[CULPRIT, "loss_delta"]
    text = check.summary()
    assert "NOT the most damaging" in text and "#2" in text and "within noise" not in text
    assert "verified (zeroing raises the loss, paired 95% interval above 0): 1 of 2" in text
    assert set(check.candidates.hf_param) == {"model.layers.0.mlp.down_proj.weight"}
    assert set(check.candidates.hf_row) == {SINK_DIM} and set(check.candidates.hf_col) == {DECOY, CULPRIT}


def test_a_single_ablation_matches_an_independent_perplexity_run(planted, check, corpus):
    base = perplexity(planted, corpus, progress=False).per_seq.double()
    weight = planted.blocks[0].mlp.W_out
    saved = weight[CULPRIT, SINK_DIM].item()
    with torch.no_grad():
        weight[CULPRIT, SINK_DIM] = 0.0
    try:
        alone = perplexity(planted, corpus, progress=False).per_seq.double()
    finally:
        with torch.no_grad():
            weight[CULPRIT, SINK_DIM] = saved
    row = check.candidates.index[check.candidates.neuron == CULPRIT][0]
    assert check.candidates.loc[row, "loss_delta"] == pytest.approx(float((alone - base).mean()), rel=1e-5)
    torch.testing.assert_close(check.per_seq[row].double(), alone - base, rtol=1e-5, atol=1e-6)


def test_the_interaction_is_both_against_each_alone(planted, check, corpus):
    assert len(check.pairs) == 1  # two candidates: one pair
    p = check.pairs.iloc[0]
    c = check.candidates
    assert (p.delta_a, p.delta_b) == (c.loss_delta[p.a], c.loss_delta[p.b])
    both = check.per_seq[len(c)].double()
    assert p.delta_ab == pytest.approx(float(both.mean()), rel=1e-6)
    per_seq = both - check.per_seq[p.a].double() - check.per_seq[p.b].double()
    assert p.interaction == pytest.approx(float(per_seq.mean()), rel=1e-6, abs=1e-9)
    assert p.interaction == pytest.approx(p.delta_ab - p.delta_a - p.delta_b, rel=1e-5, abs=1e-7)
    assert p.low <= p.interaction <= p.high
    assert p.verdict == ("sub-additive" if p.high < 0 else "super-additive" if p.low > 0 else "additive")
    # independently: both weights zeroed by hand
    base = perplexity(planted, corpus, progress=False).per_seq.double()
    weight = planted.blocks[0].mlp.W_out
    saved = weight[[DECOY, CULPRIT], SINK_DIM].clone()
    with torch.no_grad():
        weight[[DECOY, CULPRIT], SINK_DIM] = 0.0
    try:
        together = perplexity(planted, corpus, progress=False).per_seq.double()
    finally:
        with torch.no_grad():
            weight[[DECOY, CULPRIT], SINK_DIM] = saved
    assert p.delta_ab == pytest.approx(float((together - base).mean()), rel=1e-5)


def test_top_k_and_pairs_bound_the_runs(planted, trace, corpus):
    one = verify_super_weights(planted, trace, corpus, top_k=1, pairs=0, progress=False)
    assert one.candidates.neuron.tolist() == [DECOY] and one.pairs.empty and len(one.per_seq) == 1


def test_the_model_is_restored_when_a_run_fails(planted, trace, corpus, monkeypatch):
    calls = []

    def failing(*args, **kwargs):
        calls.append(float(planted.blocks[0].mlp.W_out[DECOY, SINK_DIM].detach()))
        if len(calls) == 2:  # the first ablated run: its weight is zeroed now
            raise RuntimeError("interrupted")
        return perplexity(*args, **kwargs)

    monkeypatch.setattr(sw, "perplexity", failing)
    with untouched(planted), pytest.raises(RuntimeError, match="interrupted"):
        verify_super_weights(planted, trace, corpus, progress=False)
    assert calls[1] == 0.0 and calls[0] != 0.0


def test_contract_and_no_candidates():
    model = tiny_model("llama")
    trace = trace_origin(model, "Hi.", dim=3, pos=0)  # no MLP write at this entry: nothing to verify
    check = verify_super_weights(model, trace, "Some text to read. " * 30, seq_len=16, n_seqs=2, progress=False)
    assert isinstance(check, SuperWeightCheck) and check.candidates.empty and "nothing to verify" in check.summary()
    assert check.plot() is not None


def test_bad_inputs(planted, trace, corpus):
    with pytest.raises(MassiveLensError, match="top_k"):
        verify_super_weights(planted, trace, corpus, top_k=0)
    with pytest.raises(MassiveLensError, match="pairs"):
        verify_super_weights(planted, trace, corpus, pairs=True)
    with pytest.raises(MassiveLensError, match="OriginTrace"):
        verify_super_weights(planted, trace.neurons, corpus)
    with pytest.raises(MassiveLensError, match="at least 2"):
        verify_super_weights(planted, trace, corpus[:1], progress=False)
    other = tiny_model("gpt2")
    with pytest.raises(MassiveLensError, match="not of"):
        verify_super_weights(other, trace, corpus)
    fresh = tiny_model("llama")  # same name, other weights: the trace does not describe it
    with pytest.raises(MassiveLensError, match="changed since it was traced"):
        verify_super_weights(fresh, trace, corpus, progress=False)
