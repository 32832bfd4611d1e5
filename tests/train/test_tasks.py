"""The sink-forcing tasks: their data follows the rule, their accuracy measures it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from massive_lens.errors import MassiveLensError
from massive_lens.train.tasks import L1_TOLERANCE, make_task


def test_trigger_conditional_targets_are_the_prefix_average_at_triggers_and_zero_elsewhere():
    task = make_task("trigger_conditional", n_values=5, seq_len=40, trigger_prob=0.3)
    batch = task.sample(3, seed=1, step=2)
    assert (batch.tokens[:, 0] == task.bos).all() and batch.trigger.any()
    for row in range(3):
        for t in range(1, batch.tokens.shape[1]):
            prefix = [int(x) for x in batch.tokens[row, 1:t] if x < task.n_values]
            expected = torch.zeros(task.n_values)
            if batch.trigger[row, t]:
                assert batch.tokens[row, t] == task.trigger_id
                expected = torch.bincount(torch.tensor(prefix), minlength=task.n_values).float() / len(prefix)
            torch.testing.assert_close(batch.target[row, t], expected)
    assert not batch.scored[:, 0].any() and batch.scored[:, 1:].all()


def test_batches_are_a_pure_function_of_seed_and_step():
    for name in ("trigger_conditional", "bigram_backcopy"):
        task = make_task(name, seq_len=16)
        a, b = task.sample(4, seed=3, step=5), task.sample(4, seed=3, step=5)
        assert torch.equal(a.tokens, b.tokens)
        assert not torch.equal(a.tokens, task.sample(4, seed=3, step=6).tokens)
        assert not torch.equal(a.tokens, task.sample(4, seed=4, step=5).tokens)


def test_trigger_conditional_accuracy_is_the_share_of_positions_following_the_rule():
    task = make_task("trigger_conditional", n_values=4, seq_len=30, trigger_prob=0.3)
    batch = task.sample(4, seed=0, step=0)
    perfect = torch.zeros(*batch.tokens.shape, task.n_tokens)
    perfect[..., : task.n_values] = batch.target
    assert task.accuracy(perfect, batch) == dict(accuracy=1.0, accuracy_trigger=1.0, accuracy_other=1.0)
    assert float(task.loss(perfect, batch)) == 0
    silent = task.accuracy(torch.zeros_like(perfect), batch)  # outputs zero everywhere: ignores triggers
    assert silent["accuracy_trigger"] == 0 and silent["accuracy_other"] == 1 and silent["accuracy"] == 0.5
    leaky = perfect.clone()
    leaky[~batch.trigger, 0] += L1_TOLERANCE  # exactly at the tolerance: not followed
    assert task.accuracy(leaky, batch)["accuracy_other"] == 0


def test_bigram_backcopy_copies_the_token_before_each_trigger_and_follows_the_chain_elsewhere():
    task = make_task("bigram_backcopy", n_vocab=12, n_triggers=3, seq_len=200)
    chain = task.chain()
    np.testing.assert_allclose(chain.sum(1), 1)
    np.testing.assert_array_equal(chain, make_task("bigram_backcopy", n_vocab=12, n_triggers=3).chain())
    batch = task.sample(2, seed=0, step=0)
    x = batch.tokens[:, 1:]
    is_trigger = x >= task.n_vocab - task.n_triggers
    assert is_trigger.any() and not is_trigger[:, 0].any()
    after = is_trigger[:, 1:-1]
    assert torch.equal(x[:, 2:][after], x[:, :-2][after])  # the next token copies the one before the trigger
    counts = np.zeros_like(chain)
    for row in x.tolist():
        for a, b in zip(row, row[1:], strict=False):
            if a < task.n_vocab - task.n_triggers:
                counts[a, b] += 1
    assert (counts[chain == 0] == 0).all()  # ordinary steps only take the chain's transitions


def test_bigram_backcopy_accuracy_reads_the_rule_per_position():
    task = make_task("bigram_backcopy", n_vocab=10, n_triggers=2, seq_len=50)
    batch = task.sample(3, seed=0, step=0)
    logits = torch.zeros(*batch.tokens.shape, task.n_tokens)
    target = batch.target.clamp(min=0)
    logits.scatter_(-1, target[..., None], 5.0)
    assert task.accuracy(logits, batch)["accuracy"] == 1.0
    wrong = torch.zeros_like(logits)
    wrong.scatter_(-1, ((target + 1) % task.n_vocab)[..., None], 5.0)
    assert task.accuracy(wrong, batch)["accuracy"] == 0.0
    assert float(task.loss(logits, batch)) > 0


def test_unknown_task_or_option_raises():
    with pytest.raises(MassiveLensError, match="unknown task"):
        make_task("copy")
    with pytest.raises(MassiveLensError, match="bad option"):
        make_task("bigram_backcopy", vocab=3)


def test_task_tokenizer_round_trips_and_fits_the_model():
    task = make_task("bigram_backcopy", n_vocab=6, seq_len=8)
    tok = task.tokenizer()
    assert len(tok) == task.n_tokens and tok.bos_token_id == task.bos
    batch = task.sample(1, seed=0, step=0)
    assert tok(tok.decode(batch.tokens[0]))["input_ids"] == batch.tokens[0].tolist()


def _text_task(tmp_path, text: str, **options):
    path = tmp_path / "text.txt"
    path.write_text(text)
    return make_task("bigram_backcopy_paper", text=str(path), **options)


def test_paper_bigram_backcopy_reads_its_chain_and_triggers_from_the_text(tmp_path):
    text = "the cat sat on the mat; a tea set.\n" * 3
    task = _text_task(tmp_path, text, n_triggers=2, seq_len=120)
    alphabet = sorted(set(text))
    chain, first, triggers = task.language
    assert task.n_symbols == len(alphabet) and task.bos == len(alphabet) and task.n_tokens == len(alphabet) + 1
    counts = np.zeros((len(alphabet),) * 2)
    for a, b in zip(text, text[1:], strict=False):
        counts[alphabet.index(a), alphabet.index(b)] += 1
    np.testing.assert_allclose(chain, counts / counts.sum(1, keepdims=True))
    by_count = sorted(alphabet, key=lambda ch: -text.count(ch))
    assert sorted(alphabet[i] for i in triggers) == sorted(by_count[:2])  # the two most frequent characters
    assert first[triggers].sum() == 0 and first.sum() == pytest.approx(1)
    batch = task.sample(4, seed=2, step=1)
    assert torch.equal(batch.tokens, task.sample(4, seed=2, step=1).tokens)  # a pure function of seed and step
    assert not torch.equal(batch.tokens, task.sample(4, seed=3, step=1).tokens)
    x = batch.tokens[:, 1:]
    is_trigger = torch.isin(x, torch.from_numpy(triggers))
    assert is_trigger.any() and not is_trigger[:, 0].any() and (batch.tokens[:, 0] == task.bos).all()
    after = is_trigger[:, 1:-1]
    assert torch.equal(x[:, 2:][after], x[:, :-2][after])  # after a trigger: the token before it
    for a, b in zip(x[:, :-1][~is_trigger[:, :-1]].tolist(), x[:, 1:][~is_trigger[:, :-1]].tolist(), strict=True):
        assert chain[a, b] > 0  # elsewhere only the text's own bigrams


def test_paper_bigram_backcopy_accuracy_follows_the_rule_on_a_hand_made_sequence(tmp_path):
    # "abcb": b is the most frequent character (the trigger); the chain's best next: a->b, b->c, c->b
    task = _text_task(tmp_path, "abcb" * 6, n_triggers=1, seq_len=5)
    a, b, c, bos = 0, 1, 2, task.bos
    batch = task.rule(torch.tensor([[bos, a, b, c, b, a]]))
    assert batch.trigger.tolist() == [[False, False, True, False, True, False]]
    assert batch.target.tolist() == [[-1, b, a, b, c, -1]]  # after b: copy the token before it
    logits = torch.zeros(1, 6, task.n_tokens)
    logits[0, torch.arange(6), torch.tensor([a, b, a, b, c, a])] = 1.0
    assert task.accuracy(logits, batch) == dict(accuracy=1.0, accuracy_trigger=1.0, accuracy_other=1.0)
    bigram_only = torch.zeros_like(logits)  # the chain everywhere: right at c, wrong at the first trigger
    bigram_only[0, torch.arange(6), torch.tensor([a, b, c, b, c, a])] = 1.0
    assert task.accuracy(bigram_only, batch) == dict(accuracy=0.75, accuracy_trigger=0.5, accuracy_other=1.0)


def test_paper_bigram_backcopy_refuses_a_vocabulary_size_or_a_missing_text(tmp_path):
    with pytest.raises(MassiveLensError, match="n_vocab or text"):
        _text_task(tmp_path, "abc", n_vocab=5)
    with pytest.raises(MassiveLensError, match="neither a file"):
        make_task("bigram_backcopy_paper", text=str(tmp_path / "missing.txt")).chain()
    with pytest.raises(MassiveLensError, match="n_triggers"):
        _text_task(tmp_path, "abc", n_triggers=3)
