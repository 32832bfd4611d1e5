"""The pass's ``max_attention`` want: each query's largest attention on one key, the same on both paths
and equal to the eager pattern's row maximum (at every query, and at a few given queries)."""

from __future__ import annotations

import pytest
import torch

from massive_lens import tiny_model
from massive_lens.core.attention_pass import attention_reading
from massive_lens.core.layer_attention import MAX_BLOCK, LayerAttention
from massive_lens.core.model_view import ModelView

TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps."


def _pattern_max(view, batch):
    seen = {}
    hooks = [(view.hook_name(layer, "attn.hook_pattern"),
              lambda p, hook, layer=layer: seen.__setitem__(layer, p.detach().float().amax(-1)))
             for layer in range(view.n_layers)]
    view.forward(batch, hooks)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("queries", [None, [0, 3, 7], "per layer"])
def test_max_attention_is_the_pattern_row_max_on_both_paths(family, queries):
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXT)
    expected = _pattern_max(view, batch)
    rows = {layer: None if layer == 0 else [layer, 3, 7] for layer in expected}  # a function: asked per layer
    for path in ("eager", "lse"):
        got = {}
        reader = attention_reading(view, lambda at, got=got: got.__setitem__(at.layer, at.max_attention), path=path,
                                   want={"max_attention"}, max_queries=rows.get if queries == "per layer" else queries)
        with reader:
            view.forward(batch, reader.hooks)
        assert set(got) == set(expected)
        for layer, top in expected.items():
            at = rows[layer] if queries == "per layer" else queries
            want = top if at is None else top[..., at]
            torch.testing.assert_close(got[layer], want, rtol=1e-5, atol=1e-6)


def test_max_attention_over_blocks_and_masks():
    """Several key blocks, a causal kernel with unsorted queries, and an explicit mask: each the softmax's max."""
    torch.manual_seed(0)
    n, d = MAX_BLOCK + 37, 8
    q, k, v = torch.randn(1, 4, n, d) * 3, torch.randn(1, 2, n, d) * 3, torch.randn(1, 2, n, d)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = causal & (torch.rand(n, n) > 0.3)
    mask[:, 0] = True
    for m, is_causal in ((None, True), (mask[None, None], False)):
        scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * d ** -0.5
        scores = scores.masked_fill(~(causal if m is None else m[0, 0]), float("-inf"))
        att = LayerAttention(0, q, k, v, v, torch.logsumexp(scores, -1), d ** -0.5, m, is_causal)
        pattern = scores.softmax(-1)
        torch.testing.assert_close(att.max_attention(), pattern.amax(-1), rtol=1e-5, atol=1e-6)
        rows = [n - 1, 5, MAX_BLOCK + 3, 0]
        torch.testing.assert_close(att.max_attention(rows), pattern.amax(-1)[..., rows], rtol=1e-5, atol=1e-6)
