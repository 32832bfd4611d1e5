"""core.sparse_bool answers what torch's nonzero, sum and any answer, on any mask (sparse, dense, empty,
strided), and core.criterion.key_attention's kept bands give every call its own exact answer."""

from __future__ import annotations

import torch

from massive_lens.core import criterion, sparse_bool


def test_sparse_bool_equals_torch():
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 100, 300), (2, 7, 5), (3, 0, 4), (4,), (2, 3, 4, 5)]:
        for share in (0.0, 1e-3, 0.01, 0.3, 1.0):
            mask = torch.rand(shape, generator=gen) < share
            for m in (mask, mask.transpose(0, -1)):  # strided too
                assert torch.equal(sparse_bool.nonzero(m), m.nonzero()), (shape, share)
                for d in range(-m.ndim, m.ndim):
                    assert torch.equal(sparse_bool.count(m, d), m.sum(d)), (shape, share, d)
                    assert torch.equal(sparse_bool.any_along(m, d), m.any(d)), (shape, share, d)


def test_key_attention_bands_are_kept_per_mask_and_never_shared_out():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 3, 300, 300, generator=gen), -1)  # two key blocks
    masks = [None, torch.ones(2, 300, dtype=torch.bool), torch.arange(300)[None].expand(2, -1) < 250]

    def direct(valid):
        real = torch.ones(2, 300) if valid is None else valid.float()
        q, k = torch.arange(300)[:, None], torch.arange(300)[None]
        band = ((q > k) & (q <= k + criterion.SINK_QUERIES)).float()[None] * real[:, :, None]
        count = band.sum(1)
        return torch.einsum("bhqk,bqk->bhk", p, band) / count.clamp(min=1)[:, None], count

    for valid in masks * 2:  # each mask again after the others: the kept bands are the right ones
        mass, count = criterion.key_attention(p, valid)
        want_mass, want_count = direct(valid)
        assert torch.equal(count, want_count) and torch.allclose(mass, want_mass, atol=1e-6)
        count.fill_(-1)  # the caller's own: the next call is unchanged
    assert torch.equal(criterion.key_attention(p, masks[2])[1], direct(masks[2])[1])
