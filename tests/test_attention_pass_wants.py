"""The pass's wants for sink_circuit (issue 50): the queries ``q``, the ``scores`` on the columns and each
query's log-sum-exp over the other keys (``rest_lse``) are the same on both paths and equal to what the
model's own hooks give (computed here from ``hook_rot_q``/``hook_attn_scores``, not through the pass);
the rotary cos/sin are the same on both paths (the kernel's from its module's inputs; where the kernel
misses them ``choose_path`` takes the eager path and the LSE path refuses them); where the columns take
nearly all of a query's attention ``rest_lse`` is exact; an ``AttentionEdit`` runs before the layer is read
(the pass reads the edited attention) and sees the queries and keys the scores came from; the LSE path
refuses edits."""

from __future__ import annotations

import pytest
import torch

from massive_lens import tiny_model
from massive_lens.core.attention_pass import LSE_FROM, attention_reading, choose_path
from massive_lens.core.layer_attention import LayerAttention
from massive_lens.core.model_view import ModelView
from massive_lens.core.pass_reader import AttentionEdit
from massive_lens.errors import MassiveLensError

TEXT = ["The quick brown fox jumps over the lazy dog, and then it sleeps.", "A deer feeds near the reeds."]
COLS = [0, 2]


def _read(view, batch, path, want, **kw):
    got = {}
    reader = attention_reading(view, lambda at: got.__setitem__(at.layer, at), path=path, batch=batch,
                               columns=COLS, want=want, **kw)
    with reader:
        view.forward(batch, reader.hooks)
    return got


def _hooks_say(view, batch):
    """Per layer (queries after rotary, the scores) from the model's own hooks."""
    seen: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for layer in range(view.n_layers):
        q = "attn.hook_rot_q" if view.has_hook(layer, "attn.hook_rot_q") else "attn.hook_q"
        for key, name in (("q", q), ("scores", "attn.hook_attn_scores")):
            hooks.append((view.hook_name(layer, name),
                          lambda x, hook, key=key, layer=layer: seen.__setitem__((layer, key), x.detach().float())))
    view.forward(batch, hooks)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_q_scores_rest_lse_on_both_paths(family):
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXT)  # padded: the second text's pad keys are no keys
    said = _hooks_say(view, batch)
    n = batch.mask.shape[1]
    for path in ("eager", "lse"):
        got = _read(view, batch, path, {"q", "scores", "rest_lse"})
        assert set(got) == set(range(view.n_layers))
        for layer, at in got.items():
            scores = said[layer, "scores"]
            seen = torch.ones(n, n, dtype=torch.bool).tril() & batch.mask[:, None, None, :]
            seen[..., COLS] = False
            rest = torch.logsumexp(scores.masked_fill(~seen, float("-inf")), -1)
            real = batch.mask[:, None, :].expand_as(rest) & torch.isfinite(rest)  # real queries that see another key
            torch.testing.assert_close(at.rest_lse.float()[real], rest[real], rtol=1e-5, atol=1e-4)
            causal = torch.ones(n, n, dtype=torch.bool).tril()[:, COLS] & batch.mask[:, None, :, None]
            torch.testing.assert_close(at.scores.float()[causal.expand_as(at.scores)],
                                       scores[..., COLS][causal.expand_as(at.scores)], rtol=1e-5, atol=1e-4)
            real_q = batch.mask[:, :, None, None].expand_as(at.q)
            torch.testing.assert_close(at.q.float()[real_q], said[layer, "q"][real_q], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt2"])
def test_rotary_on_both_paths(family):
    """The kernel's run hands each layer the (cos, sin) its module was called with: what the eager hooks
    show (none on gpt2); choose_path keeps the LSE path for them from LSE_FROM tokens."""
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXT[0])
    eager, lse = (_read(view, batch, path, {"rotary"}) for path in ("eager", "lse"))
    assert set(eager) == set(lse) == set(range(view.n_layers))
    for layer, at in eager.items():
        if family == "gpt2":
            assert at.rotary is None and lse[layer].rotary is None
            continue
        cos, sin = at.rotary
        assert cos.shape == sin.shape and cos.shape[-2] == batch.mask.shape[1]
        torch.testing.assert_close(cos.float() ** 2 + sin.float() ** 2, torch.ones_like(cos.float()))
        for a, b in zip(at.rotary, lse[layer].rotary, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    long = view.full_batch(torch.zeros(1, LSE_FROM, dtype=torch.long))
    assert choose_path(view, "auto", long, want={"q", "rotary"}) == "lse"


def test_rotary_the_kernel_misses_takes_the_eager_path():
    """A model whose attention module is not called with its rotary (planted: a pre-hook passes it by
    position) takes the eager path for want='rotary' and refuses 'lse' by name; other wants keep the kernel."""
    model = tiny_model("llama")

    def by_position(module, args, kwargs):
        if "position_embeddings" not in kwargs:
            return None
        states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        return (states, kwargs.pop("position_embeddings"), *args[1:]), kwargs

    for block in model.blocks:
        block.attn.original_component.register_forward_pre_hook(by_position, with_kwargs=True)
    view = ModelView(model)
    long = view.full_batch(torch.zeros(1, LSE_FROM, dtype=torch.long))
    assert choose_path(view, "auto", long, want={"q"}) == "lse"
    assert choose_path(view, "auto", long, want={"q", "rotary"}) == "eager"
    with pytest.raises(MassiveLensError, match="layer 0's attention rotates.*position_embeddings"):
        choose_path(view, "lse", long, want={"rotary"})
    with pytest.raises(MassiveLensError, match="layer 0's attention rotates"):
        attention_reading(view, None, path="lse", columns=COLS, want={"rotary"})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_edits_run_before_the_reading(family):
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXT[0])
    n = batch.mask.shape[1]
    fits = []

    def cut_sink(scores, q, k):  # the queries and keys given are the ones the scores came from
        group = q.shape[2] // k.shape[2]
        raw = torch.einsum("bqhe,bkhe->bhqk", q.float(), k.float().repeat_interleave(group, 2))
        causal = torch.ones(n, n, dtype=torch.bool).tril().expand_as(raw)
        c = (raw * scores.float())[causal].sum() / (raw * raw)[causal].sum()
        fits.append(float(((c * raw - scores.float())[causal]).abs().max() / scores.float()[causal].abs().max()))
        scores = scores.clone()
        scores[..., 1:, 0] = float("-inf")
        return scores

    got = _read(view, batch, "eager", set(), edits={1: AttentionEdit(scores=cut_sink)})
    assert max(fits) < 1e-5
    assert float(got[1].cols[0, :, 1:, 0].abs().max()) == 0.0  # the pass read the edited pattern
    assert float(got[0].cols[0, :, 1:, 0].min()) > 0.0  # and no other layer's
    flat = _read(view, batch, "eager", set(), edits={0: AttentionEdit(queries=lambda q: q * 0)})
    uniform = 1.0 / torch.arange(1, n + 1, dtype=torch.float32)  # zero queries: every key seen alike
    torch.testing.assert_close(flat[0].cols[0, :, :, 0].float(), uniform.expand(flat[0].cols.shape[1], -1))
    with pytest.raises(MassiveLensError, match="eager path only"):
        attention_reading(view, None, path="lse", columns=COLS, edits={0: AttentionEdit(queries=lambda q: q)})


def test_rest_lse_where_the_columns_take_nearly_all():
    """Where the columns take all but a sliver of a query's attention (1 - p below the float32 LSE's
    precision: the formula gives -inf), rest_lse is the other keys' log-sum-exp from their scores; elsewhere
    the formula stays within its precision (scores built here, the LSE as a float32 kernel gives it)."""
    gen = torch.Generator().manual_seed(0)
    n = 40
    q = torch.ones(1, 2, n, 1)
    k = torch.randn(1, 2, n, 1, generator=gen)
    k[0, 0, 0] = 60.0  # head 0: the first key takes all but ~1e-25 of every query's attention
    scores = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    att = LayerAttention(0, q, k, k, k, torch.logsumexp(scores, -1), 1.0, None, True)
    others = scores.clone()
    others[..., 0] = float("-inf")
    want = torch.logsumexp(others.double(), -1).float()
    got = att.rest_lse([0])
    torch.testing.assert_close(got[:, :, 1:], want[:, :, 1:], rtol=0, atol=1e-3)
    torch.testing.assert_close(got[:, 0, 1:], want[:, 0, 1:], rtol=1e-5, atol=1e-5)  # the exact rows
    assert got[0, 0, 0] == float("-inf")  # the first query sees no other key
