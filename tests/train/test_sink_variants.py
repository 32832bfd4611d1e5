"""The relu and vscale attention variants and the norm-placement axis of MassiveLMConfig."""

from __future__ import annotations

import pytest
import torch

from massive_lens.errors import MassiveLensError
from massive_lens.quant import fake_quantized
from massive_lens.train.layers import NORM_PLACEMENTS, MassiveLMConfig
from massive_lens.train.model import MassiveLM
from massive_lens.train.variants import VariantConfig, causal_scores, make_variant

H, D, M, B, T = 2, 8, 16, 2, 5


class Hooks(torch.nn.Module):
    def __getattr__(self, name):
        if name.startswith("hook_"):
            return lambda x: x
        return super().__getattr__(name)


def qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)] + [torch.randn(B, T, M, generator=g)]


@pytest.mark.parametrize("fused", [True, False])
def test_relu_attention_is_relu_of_the_logits_over_the_visible_keys(fused):
    q, k, v, x = qkv()
    z = make_variant(VariantConfig("relu"), H, D, M)(q, k, v, x, Hooks(), fused=fused)
    scores = q @ k.transpose(-1, -2) / D**0.5
    weights = torch.relu(scores).tril() / torch.arange(1, T + 1)[:, None]
    torch.testing.assert_close(z, (weights @ v).transpose(1, 2))


def test_relu_attention_outputs_zero_when_every_logit_is_negative():
    q, k, v, x = qkv()
    k = -q.mean(2, keepdim=True).expand_as(k) * 10  # every q . k < 0 for these q
    q = q.mean(2, keepdim=True).expand_as(q)
    z = make_variant(VariantConfig("relu"), H, D, M)(q, k, v, x, Hooks())
    assert z.abs().max() == 0
    softmax = make_variant(VariantConfig("softmax"), H, D, M)(q, k, v, x, Hooks())
    assert softmax.abs().max() > 0.1  # softmax must put its weight somewhere


def test_vscale_changes_only_the_value_gradient_by_the_number_of_queries_that_see_each_key():
    q, k, v, x = qkv()
    outs, grads = [], []
    for name in ("softmax", "vscale"):
        vv = v.clone().requires_grad_(True)
        z = make_variant(VariantConfig(name), H, D, M)(q, k, vv, x, Hooks())
        z.sum().backward()
        outs.append(z.detach())
        grads.append(vv.grad)
    torch.testing.assert_close(outs[0], outs[1])
    seen_by = torch.arange(T, 0, -1, dtype=torch.float32)
    torch.testing.assert_close(grads[1], grads[0] * (seen_by.mean() / seen_by)[:, None])


def test_post_norm_block_normalises_after_each_residual_add():
    block = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2, norm="post")).blocks[0]
    x = torch.randn(1, 4, 16) * 50
    mid = block.ln1(x + block.attn(x))
    torch.testing.assert_close(block(x), block.ln2(mid + block.mlp(mid)))
    rms = block(x).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)


def test_no_norm_block_has_no_norm_parameters_and_adds_plainly():
    block = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2, norm="none")).blocks[0]
    assert not [n for n, _ in block.named_parameters() if n.startswith("ln")]
    x = torch.randn(1, 4, 16)
    mid = x + block.attn(x)
    torch.testing.assert_close(block(x), mid + block.mlp(mid))


@pytest.mark.parametrize("norm", NORM_PLACEMENTS)
def test_fake_quantization_reads_each_sublayer_input_for_every_norm_placement(norm):
    model = MassiveLM(MassiveLMConfig(n_layers=2, d_model=16, n_heads=2, n_ctx=8, attention="gated", norm=norm))
    seen: set[int] = set()
    for module, weight, _ in model.quantization_sites():
        module.register_forward_pre_hook(lambda m, a, w=weight: seen.add(id(w)))  # returns None: input kept
    tokens = torch.randint(0, 200, (1, 8))
    full = model(tokens)
    assert len(seen) == len(model.quantization_sites())
    with fake_quantized(model, w_bits=4, a_bits=4, per_token=True):
        low = model(tokens)
    assert (low - full).abs().max() > 0
    torch.testing.assert_close(model(tokens), full)  # weights back


def test_bad_norm_placement_raises():
    with pytest.raises(MassiveLensError, match="norm must be one of"):
        MassiveLMConfig(norm="sandwich")


def test_causal_scores_are_what_relu_masks():
    q, k, _, _ = qkv()
    assert torch.isfinite(causal_scores(q, k)).sum(-1)[0, 0].tolist() == list(range(1, T + 1))
