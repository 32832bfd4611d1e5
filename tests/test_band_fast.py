"""LayerAttention.band on a causal attention without a mask (the kernel's common case) selects the
band's entries without the mask's bias: it must equal key_attention of the explicit pattern, and a
NaN that reaches the band must still count as no attention (the entries' own rule)."""

from __future__ import annotations

import torch

from massive_lens.core.criterion import key_attention
from massive_lens.core.layer_attention import LayerAttention


def _attention(n: int, seed: int = 0) -> tuple[LayerAttention, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 4, n, 8, generator=gen) * 2, torch.randn(1, 2, n, 8, generator=gen) * 2
    scores = (q.view(1, 2, 2, n, 8) @ k[:, :, None].transpose(-1, -2)).view(1, 4, n, n) * 0.35
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return LayerAttention(0, q, k, k, k, lse, 0.35, None, True), torch.softmax(scores, -1)


def test_band_equals_key_attention_of_the_pattern():
    for n in (5, 64, 150):
        att, pattern = _attention(n, seed=n)
        valid = torch.ones(1, n, dtype=torch.bool)
        mass, count = att.band(valid)
        ref_mass, ref_count = key_attention(pattern, valid)
        torch.testing.assert_close(count, ref_count)
        torch.testing.assert_close(mass, ref_mass, rtol=1e-5, atol=1e-6)


def test_a_nan_in_the_band_counts_as_no_attention():
    att, _ = _attention(40)
    q = att.q.clone()
    q[0, 1, 20] = float("nan")  # one query of one head
    nan = LayerAttention(0, q, att.k, att.v, att.z, att.lse, att.scale, None, True)
    mass, _ = nan.band(torch.ones(1, 40, dtype=torch.bool))
    assert bool(torch.isfinite(mass).all())
    clean, _ = att.band(torch.ones(1, 40, dtype=torch.bool))
    torch.testing.assert_close(mass[:, 0], clean[:, 0])  # the other heads are untouched


def test_the_kept_band_masks_answer_each_mask_and_are_never_shared_out():
    att, pattern = _attention(150, seed=3)
    masks = [torch.ones(1, 150, dtype=torch.bool), torch.arange(150)[None] >= 40, torch.arange(150)[None] < 100]
    for valid in [masks[0], masks[0], masks[1], masks[0], masks[2], masks[1], masks[2]]:  # kept, then asked
        mass, count = att.band(valid)
        ref_mass, ref_count = key_attention(pattern, valid)
        torch.testing.assert_close(count, ref_count)
        torch.testing.assert_close(mass, ref_mass, rtol=1e-5, atol=1e-6)
        count.fill_(-1)  # the caller's own: the next call is unchanged
