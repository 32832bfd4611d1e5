"""Attention variants: exact formulas, numerical stability, fused == explicit, hook shapes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_lm
from torch import nn

from massive_lens.errors import MassiveLensError
from massive_lens.train.model import MassiveLM, MassiveLMConfig
from massive_lens.train.variants import VARIANTS, VariantConfig, causal_scores, make_variant

H, D, M, B, T = 2, 8, 16, 2, 5
SLOT_VARIANTS = ("softmax1", "softmax_n", "learned_sink", "kv_bias", "k_bias")


class Hooks(nn.Module):
    """Stand-in for the attention layer: identity hooks that record what they saw."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, torch.Tensor] = {}

    def __getattr__(self, name):
        if name.startswith("hook_"):
            return lambda x, name=name: self.seen.setdefault(name, x)
        return super().__getattr__(name)


def qkv(scale: float = 1.0):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    return q * scale, k, v, torch.randn(B, T, M, generator=g)


def run(name: str, fused: bool, scale: float = 1.0, **options):
    variant = make_variant(VariantConfig(name, **options), H, D, M)
    q, k, v, x = qkv(scale)
    hooks = Hooks()
    z = variant(q, k, v, x, hooks, fused=fused)
    return variant, z, hooks.seen


def test_softmax1_equals_softmax_with_an_appended_zero_logit_and_zero_value():
    _, z, seen = run("softmax1", fused=False)
    q, k, v, _ = qkv()
    scores = causal_scores(q, k)
    padded = torch.cat([scores, torch.zeros(B, H, T, 1)], -1)
    weights = torch.softmax(padded, -1)[..., :T]
    torch.testing.assert_close(seen["hook_pattern"], weights)
    torch.testing.assert_close(z, (weights @ v).transpose(1, 2))
    # the formula itself: exp(x_i) / (1 + sum_j exp(x_j))
    e = scores.exp()
    torch.testing.assert_close(weights, e / (1 + e.sum(-1, keepdim=True)))


def test_softmax1_matches_torch_add_zero_attn():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(M, H, add_zero_attn=True, bias=False, batch_first=True)
    x = torch.randn(B, T, M)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    expected, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    split = lambda t: t.view(B, T, H, M // H).transpose(1, 2)  # noqa: E731
    variant = make_variant(VariantConfig("softmax1"), H, M // H, M)
    for fused in (True, False):
        z = variant(split(x @ w_q.T), split(x @ w_k.T), split(x @ w_v.T), x, Hooks(), fused=fused)
        torch.testing.assert_close(mha.out_proj(z.reshape(B, T, M)), expected)


def test_softmax_n_equals_n_zero_slots():
    _, z, seen = run("softmax_n", fused=False, n=3.0)
    q, k, v, _ = qkv()
    e = causal_scores(q, k).exp()
    torch.testing.assert_close(seen["hook_pattern"], e / (3 + e.sum(-1, keepdim=True)))


@pytest.mark.parametrize("name", ["softmax1", "softmax_n", "learned_sink", "softmax"])
@pytest.mark.parametrize("fused", [True, False])
def test_stays_finite_for_huge_logits(name, fused):
    _, z, seen = run(name, fused=fused, scale=1e4 * math.sqrt(D))
    assert torch.isfinite(z).all()
    if not fused:
        total = seen["hook_pattern"].sum(-1)
        if "hook_slot_pattern" in seen:
            total = total + seen["hook_slot_pattern"].sum(-1)
        torch.testing.assert_close(total, torch.ones_like(total))


def test_kv_bias_with_huge_key_puts_all_weight_on_the_slot():
    variant = make_variant(VariantConfig("kv_bias"), H, D, M)
    q, k, v, x = qkv()
    q = q.abs()
    with torch.no_grad():
        variant.k_slot.fill_(1e3)
    expected = variant.v_slot.detach()[:, 0][None, None].expand(B, T, H, D)
    for fused in (False, True):
        torch.testing.assert_close(variant(q, k, v, x, Hooks(), fused=fused), expected)
    hooks = Hooks()  # the explicit path shows the weights: all on the slot, none on the keys
    variant(q, k, v, x, hooks, fused=False)
    torch.testing.assert_close(hooks.seen["hook_slot_pattern"], torch.ones(B, H, T, 1))
    torch.testing.assert_close(hooks.seen["hook_pattern"], torch.zeros(B, H, T, T))


def test_learned_sink_logit_takes_the_weight():
    variant = make_variant(VariantConfig("learned_sink"), H, D, M)
    with torch.no_grad():
        variant.sink_logit.fill_(50.0)
    q, k, v, x = qkv()
    hooks = Hooks()
    z = variant(q, k, v, x, hooks, fused=False)
    assert hooks.seen["hook_slot_pattern"].min() > 0.999
    assert z.abs().max() < 1e-3  # the sink's value is zero


def test_clipped_softmax_gives_exact_zeros_and_ones():
    _, _, seen = run("clipped_softmax", fused=False, gamma=-0.1, zeta=1.1)
    pattern = seen["hook_pattern"]
    assert (pattern == 0).sum() > (pattern.shape[-1] * (pattern.shape[-1] - 1) // 2) * B * H
    assert pattern.min() >= 0 and pattern.max() <= 1
    assert (pattern[..., 0, 0] == 1).all()  # the first query's only key: clipped at exactly 1


def test_gate_zero_gives_zero_output():
    variant = make_variant(VariantConfig("gated"), H, D, M)
    with torch.no_grad():
        variant.W_G.zero_()
        variant.b_G.fill_(-1e4)
    q, k, v, x = qkv()
    assert (variant(q, k, v, x, Hooks()) == 0).all()


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "clipped_softmax"])
def test_fused_and_explicit_paths_agree(name):
    variant = make_variant(VariantConfig(name, n=2.5), H, D, M)
    for p in variant.parameters():  # non-trivial slot parameters
        nn.init.normal_(p, std=1.0)
    q, k, v, x = qkv()
    fused = variant(q, k, v, x, Hooks(), fused=True)
    explicit = variant(q, k, v, x, Hooks(), fused=False)
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)


def test_idle_hooks_take_the_fused_path_and_watched_hooks_the_explicit_one(monkeypatch):
    model = tiny_lm(attention="softmax1")
    calls = []
    original = type(model.blocks[0].attn.variant)._explicit
    monkeypatch.setattr(
        type(model.blocks[0].attn.variant), "_explicit",
        lambda self, *a: calls.append(1) or original(self, *a),
    )
    tokens = model.to_tokens("Hello. World")
    model(tokens)
    assert calls == []
    model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_post"))
    assert calls == []
    model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    assert len(calls) == model.cfg.n_layers


@pytest.mark.parametrize(
    "name, style", [(n, "llama") for n in VARIANTS] + [("softmax", "gpt2"), ("kv_bias", "gpt2")]
)
def test_every_variant_fires_its_hooks_with_documented_shapes(name, style):
    model = tiny_lm(attention=name, style=style)
    c = model.cfg
    tokens = model.to_tokens(["Hello. World", "Hi"])
    b, p = tokens.shape
    _, cache = model.run_with_cache(tokens)
    expected = {
        "hook_embed": (b, p, c.d_model),
        "blocks.0.hook_resid_pre": (b, p, c.d_model),
        "blocks.1.hook_resid_mid": (b, p, c.d_model),
        "blocks.1.hook_resid_post": (b, p, c.d_model),
        "blocks.0.hook_attn_out": (b, p, c.d_model),
        "blocks.0.hook_mlp_out": (b, p, c.d_model),
        "blocks.0.attn.hook_q": (b, p, c.n_heads, c.d_head),
        "blocks.0.attn.hook_k": (b, p, c.n_heads, c.d_head),
        "blocks.0.attn.hook_v": (b, p, c.n_heads, c.d_head),
        "blocks.0.attn.hook_z": (b, p, c.n_heads, c.d_head),
        "blocks.0.attn.hook_attn_scores": (b, c.n_heads, p, p),
        "blocks.0.attn.hook_pattern": (b, c.n_heads, p, p),
        "blocks.0.mlp.hook_pre": (b, p, c.d_mlp),
        "blocks.0.mlp.hook_post": (b, p, c.d_mlp),
        "blocks.0.ln1.hook_scale": (b, p, 1),
        "blocks.0.ln2.hook_scale": (b, p, 1),
        "ln_final.hook_scale": (b, p, 1),
    }
    if name in SLOT_VARIANTS:
        expected["blocks.0.attn.hook_slot_pattern"] = (b, c.n_heads, p, 1)
    for hook, shape in expected.items():
        assert tuple(cache[hook].shape) == shape, hook
    pattern = cache["blocks.1.attn.hook_pattern"]
    total = pattern.sum(-1)
    if name in SLOT_VARIANTS:
        total = total + cache["blocks.1.attn.hook_slot_pattern"].sum(-1)
    if name not in ("clipped_softmax", "relu"):  # relu weights need not sum to one
        torch.testing.assert_close(total, torch.ones_like(total))
    assert (pattern.triu(1) == 0).all()  # causal


def test_sink_token_is_a_real_position_zero():
    model = tiny_lm(attention="sink_token")
    tokens = model.to_tokens("Hi")
    assert tokens[0, 0] == model.sink_id and model.to_str_tokens("Hi")[0] == "<|sink|>"
    bare = tokens[:, 1:]
    torch.testing.assert_close(model(bare), model(tokens))  # forward prepends it when missing


def test_bad_variant_options_raise():
    with pytest.raises(MassiveLensError, match="unknown attention variant"):
        VariantConfig("softmax2")
    with pytest.raises(MassiveLensError, match="n > 0"):
        VariantConfig("softmax_n", n=0)
    with pytest.raises(MassiveLensError, match="gamma"):
        VariantConfig("clipped_softmax", gamma=0.5)
    with pytest.raises(MassiveLensError, match="style"):
        MassiveLM(MassiveLMConfig(style="mamba"))
