"""perplexity and run_interventions: batching does not change the numbers, hooks and
interventions are applied and removed, and on the real model the paper's relations hold."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import WIKITEXT_TEST, WIKITEXT_VALID, needs_wikitext, untouched

from massive_lens import MassiveLensError, perplexity, run_interventions, tiny_model
from massive_lens.core import budget
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

TEXT = "It was the best of times, it was the worst of times. " * 30


def test_batching_does_not_change_losses():
    model = tiny_model("qwen2")
    with untouched(model):
        one = perplexity(model, TEXT, seq_len=16, n_seqs=5, batch_size=1, progress=False)
        many = perplexity(model, TEXT, seq_len=16, n_seqs=5, batch_size=4, progress=False)
    torch.testing.assert_close(one.per_seq, many.per_seq, rtol=1e-5, atol=1e-5)
    assert one.n_tokens == 5 * 15 and math.isclose(one.perplexity, math.exp(one.per_seq.mean()), rel_tol=1e-6)
    low, high = one.ci
    assert low <= one.perplexity <= high
    assert list(one.to_frame().columns) == ["seq", "loss", "perplexity", "accuracy"]


@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("share", [1e-9, 0.5, 100.0])
def test_each_pass_keeps_its_logits_under_a_share_of_the_weights(monkeypatch, share, sliced):
    """Passes of as many sequences as keep one pass's logits under the share, whether the head runs
    slice by slice (no pass holds its logits, but its activations grow with the batch) or not (no head found)."""
    from massive_lens.core import loss as loss_module

    model = tiny_model("llama")
    monkeypatch.setattr(budget, "LOGITS_SHARE", share)
    if not sliced:
        monkeypatch.setattr(loss_module, "output_head", lambda model: None)
    tokens = sequences(ModelView(model), TEXT, 16, 10)
    per_seq = 16 * model.cfg.d_vocab * 4  # float32 logits of one sequence
    fits = max(1, int(share * budget.weight_bytes(model)) // per_seq)
    seen: list[int] = []  # the batch size of every forward pass perplexity makes
    record = ("blocks.0.hook_resid_pre", lambda x, hook: seen.append(x.shape[0]))
    result = perplexity(model, tokens, hooks=[record], progress=False)
    want = budget.logit_batches(model, tokens)
    assert seen == [len(b) for b in want]
    assert max(seen) == min(fits, budget.MAX_BATCH) and sum(seen) == 10 == len(result.per_seq)
    reference = perplexity(model, tokens, batch_size=1, progress=False)
    torch.testing.assert_close(result.per_seq, reference.per_seq, rtol=1e-5, atol=1e-6)


def test_independent_loss_computation():
    model = tiny_model("gpt2")
    tokens = sequences(ModelView(model), TEXT, 16, 2)
    with torch.no_grad():
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert perplexity(model, tokens, progress=False).loss == pytest.approx(float(loss), rel=1e-5)


def test_hooks_and_interventions_are_applied_then_removed():
    from massive_lens.interventions import remove_sink_attention

    model = tiny_model("llama")
    base = perplexity(model, TEXT, seq_len=16, n_seqs=2, progress=False)
    with untouched(model):
        edited = perplexity(model, TEXT, seq_len=16, n_seqs=2, progress=False,
                            hooks=remove_sink_attention(model, calibration=TEXT[::-1]))
    assert edited.loss != base.loss
    assert perplexity(model, TEXT, seq_len=16, n_seqs=2, progress=False).loss == base.loss


@pytest.mark.parametrize("kwargs", [dict(n_seqs=0), dict(hooks=["not a hook"]), dict(batch_size=0),
                                    dict(seq_len=1)])
def test_bad_input(kwargs):
    with pytest.raises(MassiveLensError):
        perplexity(tiny_model("gpt2"), TEXT, progress=False, **{"seq_len": 16, "n_seqs": 2, **kwargs})


def test_unknown_setting():
    with pytest.raises(MassiveLensError, match="unknown settings"):
        run_interventions(tiny_model("gpt2"), TEXT, calibration=TEXT, settings=["zero", "half"], progress=False)


@pytest.mark.slow
@needs_wikitext
def test_default_model_table3_relations(default_model):
    """WikiText-2 test, calibrated on valid: zero destroys, mean and control keep perplexity."""
    with untouched(default_model):
        table = run_interventions(default_model, WIKITEXT_TEST, calibration=WIKITEXT_VALID, seq_len=64, n_seqs=4,
                                  batch_size=4, calibration_seqs=4, progress=False,
                                  settings=["original", "zero", "mean", "control"])
    r = table.to_frame().set_index("setting")
    assert r.loc["zero", "ratio"] > 10 and r.loc["zero", "ratio_low"] > 10
    assert abs(r.loc["mean", "ratio"] - 1) < 0.03
    assert abs(r.loc["control", "ratio"] - 1) < 0.05
    assert (r["ratio_low"] <= r["ratio"] + 1e-9).all() and (r["ratio"] <= r["ratio_high"] + 1e-9).all()
    assert "control" in table.summary()
