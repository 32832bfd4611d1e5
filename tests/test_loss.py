"""The next-token loss at the head, slice by slice (massive_lens.core.loss), against plain
cross-entropy on the full logits, on several families; the fall-backs to full logits."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError, perplexity, tiny_model
from massive_lens.core import loss as loss_module
from massive_lens.core.loss import NextTokenLoss
from massive_lens.train.model import MassiveLM, MassiveLMConfig

CASES = [("llama", {}, True), ("gpt2", {}, True), ("qwen2", {}, True), ("gemma3", {}, True),
         ("gemma3", {"final_logit_softcapping": 30.0}, False)]  # a final soft cap: the full logits


def _tokens(model, n=3, pos=40, seed=0):
    tokens = torch.randint(0, 250, (n, pos), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = model.tokenizer.bos_token_id
    return tokens


def _plain(logits, tokens):
    """Per-token loss, per-sequence loss and accuracy, argmax: one cross-entropy on the whole logits."""
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    hits = (logits[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean(1)
    return per_token, per_token.mean(1), hits, logits.argmax(-1)


@pytest.mark.parametrize(("family", "overrides", "exact"), CASES,
                         ids=[f"{c[0]}{'-capped' * bool(c[1])}" for c in CASES])
def test_chunked_loss_equals_the_full_logits(family, overrides, exact, monkeypatch):
    model = tiny_model(family, **overrides)
    tokens = _tokens(model)
    per_token, loss, acc, top1 = _plain(model(tokens), tokens)
    monkeypatch.setattr(loss_module, "head_positions", lambda d_vocab, weights: 7)  # several slices a sequence
    scorer = NextTokenLoss(model)
    sizes = []
    handle = scorer.head.register_forward_hook(lambda m, a, out: sizes.append(out.shape[:-1].numel()))
    try:
        with untouched(model):
            out = scorer(tokens, top1=True, per_token=True)
    finally:
        handle.remove()
    assert scorer.exact is exact
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.token_loss, per_token, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.accuracy, acc)
    assert torch.equal(out.top1, top1) and out.finite
    if exact:  # the head only ever saw a slice: the batch's logits were never made (the check's included)
        assert max(sizes) <= 7
    else:  # the full pass ran the head on the whole batch
        assert max(sizes) == tokens.numel()


def test_a_wrong_head_is_caught_by_the_check_and_the_full_logits_are_used(monkeypatch):
    model = tiny_model("llama")
    tokens = _tokens(model, n=2, pos=24)
    _, loss, _, _ = _plain(model(tokens), tokens)
    real = NextTokenLoss.logits
    monkeypatch.setattr(NextTokenLoss, "logits", lambda self, row, a, b: real(self, row, a, b) * 1.001)
    scorer = NextTokenLoss(model)
    assert not scorer.check(tokens)
    torch.testing.assert_close(scorer(tokens).loss, loss, rtol=1e-5, atol=1e-6)
    assert not NextTokenLoss(MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))).check(tokens)  # no head


def test_hooks_on_the_head_take_the_full_logits_for_that_call():
    model = tiny_model("gpt2")
    tokens = _tokens(model, n=2, pos=20)
    scale = [("unembed.hook_out", lambda x, hook: x * 2.0)]
    _, want, _, _ = _plain(model.run_with_hooks(tokens, fwd_hooks=scale), tokens)
    scorer = NextTokenLoss(model)
    by_name = NextTokenLoss(model, lambda x, hooks: model.run_with_hooks(x, fwd_hooks=list(hooks)))  # filters too
    with untouched(model):
        got = scorer(tokens, hooks=scale).loss
        by_filter = by_name(tokens, hooks=[(lambda name: name == "unembed.hook_out", scale[0][1])]).loss
    assert scorer.exact and by_name.exact  # the slices are exact; the call's hooks alone sent it to the full logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_filter, want, rtol=1e-5, atol=1e-6)


def test_perplexity_is_the_same_by_slices_and_from_full_logits(monkeypatch):
    model = tiny_model("qwen2")
    tokens = _tokens(model, n=5, pos=33)
    sliced = perplexity(model, tokens, progress=False)
    monkeypatch.setattr(loss_module, "output_head", lambda model: None)  # no head: the full logits
    full = perplexity(model, tokens, progress=False, batch_size=2)
    torch.testing.assert_close(sliced.per_seq, full.per_seq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sliced.accuracy_per_seq, full.accuracy_per_seq)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_edit_that_makes_the_logits_non_finite_is_refused_as_an_unedited_overflow_is(bad):
    """Issue 48: with an edit attached, NaN or inf logits gave an infinite perplexity silently; the
    unedited model's were refused. Both are refused now, and the message says which it was."""
    model = tiny_model("llama")
    tokens = _tokens(model, n=2, pos=12)
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"

    def poison(x, hook):
        x = x.clone()
        x[:, 3] = bad
        return x

    with untouched(model), pytest.raises(MassiveLensError, match="with the edit attached"):
        perplexity(model, tokens, hooks=[(last, poison)], progress=False)
    finite = perplexity(model, tokens, hooks=[(last, lambda x, hook: x * 0.5)], progress=False)
    assert torch.isfinite(finite.per_seq).all()  # a finite edit still gives its perplexity


def test_the_check_runs_a_few_positions_in_two_slices_or_more():
    """The check is one more forward of every call: on PROBE_POSITIONS positions of the first
    sequence (it ran on a whole 32-position slice before), the head still applied in slices."""
    model = tiny_model("llama")
    tokens = _tokens(model)
    scorer = NextTokenLoss(model)
    seen, sliced = [], []
    handles = [model.embed.register_forward_hook(lambda m, a, out: seen.append(out.shape[1])),
               scorer.head.register_forward_hook(lambda m, a, out: sliced.append(out.shape[-2]))]
    try:
        assert scorer.check(tokens)
    finally:
        for h in handles:
            h.remove()
    assert seen == [loss_module.PROBE_POSITIONS] < [tokens.shape[1]]
    assert len(sliced) >= 3 and max(sliced[1:]) < loss_module.PROBE_POSITIONS  # the full pass, then the slices


@pytest.mark.parametrize("start", [0, 5])
def test_the_first_call_checks_in_its_own_forward(start):
    """The first call of a scorer ran the check's forward (PROBE_POSITIONS tokens) and then its own: now one
    forward, in which only the first sequence's first positions (from start) go on past the head, and their
    logits (the model's) are compared with the head's first slice."""
    model = tiny_model("llama")
    tokens = _tokens(model)
    per_token, _, _, _ = _plain(model(tokens)[:, start:], tokens[:, start:])
    scorer = NextTokenLoss(model)
    seen, heads = [], []
    handles = [model.embed.register_forward_hook(lambda m, a, out: seen.append(out.shape[:2])),
               scorer.head.register_forward_hook(lambda m, a, out: heads.append(out.shape[:-1]))]
    try:
        with untouched(model):
            out = scorer(tokens, tokens[:, start:], start, per_token=True)
    finally:
        for h in handles:
            h.remove()
    assert scorer.exact and seen == [tokens.shape]  # one forward, of the whole batch
    assert heads[0] == (1, loss_module.PROBE_POSITIONS) and all(len(s) == 1 for s in heads[1:])  # then the slices
    torch.testing.assert_close(out.token_loss, per_token, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start", [0, 5])
def test_a_wrong_head_is_caught_by_the_first_call_which_reads_once_or_takes_the_full_logits(start, monkeypatch):
    model = tiny_model("qwen2")
    tokens = _tokens(model, n=2, pos=24)
    targets = tokens[:, start:]  # a prefix of start tokens, not scored
    per_token, _, _, _ = _plain(model(tokens)[:, start:], targets)
    real = NextTokenLoss.logits
    monkeypatch.setattr(NextTokenLoss, "logits", lambda self, row, a, b: real(self, row, a, b) * 1.001)
    seen = []
    handle = model.embed.register_forward_hook(lambda m, a, out: seen.append(out.shape[:2]))
    try:
        with untouched(model):
            once = NextTokenLoss(model)
            assert once(tokens, targets, start, once=True) is None and once.exact is False and len(seen) == 1
            again = once(tokens, targets, start, per_token=True)  # decided: the full logits, one forward
            assert len(seen) == 2
            second = NextTokenLoss(model)(tokens, targets, start, per_token=True)  # not once: a second forward
            assert len(seen) == 4
    finally:
        handle.remove()
    for out in (again, second):
        torch.testing.assert_close(out.token_loss, per_token, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, -1])
def test_one_non_finite_logit_anywhere_makes_the_call_not_finite(bad, where):
    model = tiny_model("gpt2")
    tokens = _tokens(model, n=2, pos=20)

    def one(x, hook):
        x = x.clone()
        x[where, where, where] = bad
        return x

    with untouched(model):
        assert not NextTokenLoss(model)(tokens, hooks=[("unembed.hook_out", one)], top1=True).finite
        assert NextTokenLoss(model)(tokens, top1=True).finite


def test_the_argmax_is_torchs_with_ties_nan_and_half_precision():
    """The argmax by NumPy (loss._argmax) is torch's: the first maximum, the first NaN; bfloat16 by torch."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = torch.randint(0, 4, (9, 13), generator=gen).float()  # many ties
        if trial % 3 == 0:
            logits = torch.randn(9, 13, generator=gen).double()
        if trial % 5 == 0:
            for _ in range(2):
                logits[int(torch.randint(0, 9, (1,), generator=gen)), int(torch.randint(0, 13, (1,), generator=gen))] \
                    = float("nan")
        logits = logits.to(torch.bfloat16) if trial % 4 == 0 else logits
        mine = loss_module._argmax(logits)
        assert mine.dtype == torch.long and torch.equal(mine, logits.argmax(-1)), trial
