"""decompose_attention's constancy statistics are read from factors (each head's share of the heads'
outputs and W_O), never from the per-head vectors: here they are computed from the vectors built out
of the model's own pattern, values and W_O, per head, text and query position, and must agree."""

from __future__ import annotations

import pytest
import torch

from massive_lens.attention import decompose_attention
from massive_lens.core.model_view import ModelView

TEXTS = ["The cat sat on the mat. It slept, and then it woke.", "Numbers: 1, 2, 3!"]  # padded: unequal lengths
STATS = ["norm", "rel_std_pos", "cos_pos", "rel_std_text", "cos_text"]


def _stats(vectors: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per head: the result's five statistics from ``vectors [batch head pos d_model]`` (float64),
    over the positions ``keep [batch pos]``, by their definitions."""
    per_text, means = [], []
    for b in range(vectors.shape[0]):
        x = vectors[b][:, keep[b]]  # [head n d_model]
        n = x.shape[1]
        norms = x.norm(dim=-1)
        mean = x.mean(1)
        spread = ((x - mean[:, None]).pow(2).sum(-1).mean(1)).sqrt() / mean.norm(dim=-1)
        unit = x / norms[..., None]
        cos = ((unit @ unit.transpose(1, 2)).sum((1, 2)) - n) / (n * (n - 1))  # mean over distinct pairs
        per_text.append(torch.stack([norms.mean(1), spread, cos], -1))
        means.append(mean)
    means = torch.stack(means)  # [text head d_model]
    grand = means.mean(0)
    across = (means - grand).pow(2).sum(-1).mean(0).sqrt() / grand.norm(dim=-1)
    unit = means / means.norm(dim=-1, keepdim=True)
    t = means.shape[0]
    cos_text = (torch.einsum("thd,shd->h", unit, unit) - t) / (t * (t - 1))
    return torch.cat([torch.stack(per_text).mean(0), torch.stack([across, cos_text], -1)], -1)  # [head 5]


@pytest.mark.parametrize("sinks", [None, [0, 4]])
def test_statistics_equal_those_of_the_vectors_built(tiny, sinks):
    view = ModelView(tiny)
    batch = view.tokenize(TEXTS)
    result = decompose_attention(tiny, TEXTS, sinks=sinks, attention="eager")
    names = {"attn.hook_pattern", "attn.hook_v"}
    _, cache = tiny.run_with_cache(batch.tokens, attention_mask=batch.mask,
                                   names_filter=lambda name: any(name.endswith(x) for x in names))
    keys = result.sink_mask.double()  # [batch key]
    keep = batch.mask.bool() & ~result.sink_mask
    frame = result.to_frame()
    for layer in result.layers:
        pattern = cache[view.hook_name(layer, "attn.hook_pattern")].double()  # [batch head query key]
        v = cache[view.hook_name(layer, "attn.hook_v")].double()
        v = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)  # [batch key head d_head]
        W_O = view.block(layer).attn.W_O.detach().double()  # [head d_head d_model]
        for term, weight in (("sink", keys), ("content", 1 - keys)):
            z = torch.einsum("bhqk,bk,bkhd->bhqd", pattern, weight, v)
            expected = _stats(torch.einsum("bhqd,hdm->bhqm", z, W_O), keep)
            got = frame[(frame["layer"] == layer) & (frame["term"] == term)].sort_values("head")[STATS]
            torch.testing.assert_close(torch.tensor(got.to_numpy()), expected, rtol=2e-4, atol=1e-5,
                                       msg=lambda m, layer=layer, term=term: f"layer {layer} {term}: {m}")
