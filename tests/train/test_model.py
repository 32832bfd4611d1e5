"""MassiveLM: TransformerLens-style interface, weights, tokenization, analyses run on it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_lm

from massive_lens.errors import MassiveLensError
from massive_lens.train.model import MassiveLM, MassiveLMConfig


def test_cfg_and_weight_shapes_follow_transformer_lens():
    for style in ("llama", "gpt2"):
        model = tiny_lm(style=style)
        c = model.cfg
        assert (c.normalization_type, c.gated_mlp) == (("RMS", True) if style == "llama" else ("LN", False))
        assert c.positional_embedding_type == ("rotary" if style == "llama" else "standard")
        assert c.n_key_value_heads is None and c.d_vocab == len(model.tokenizer)
        attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
        assert attn.W_Q.shape == attn.W_K.shape == attn.W_V.shape == (c.n_heads, c.d_model, c.d_head)
        assert attn.W_O.shape == (c.n_heads, c.d_head, c.d_model)
        assert mlp.W_in.shape == (c.d_model, c.d_mlp) and mlp.W_out.shape == (c.d_mlp, c.d_model)
        assert (mlp.W_gate is not None) == c.gated_mlp
        assert (mlp.b_out is None) == (attn.b_O is None) == (attn.b_V is None) == (style == "llama")


def test_forward_return_types_and_stop_at_layer():
    model = tiny_lm()
    tokens = model.to_tokens(["The cat sat.", "Hi"])
    logits, loss = model(tokens, return_type="both")
    assert logits.shape == (2, tokens.shape[1], model.cfg.d_vocab)
    assert model(tokens, return_type=None) is None
    torch.testing.assert_close(model(tokens, return_type="loss"), loss)
    _, cache = model.run_with_cache(tokens)
    resid = model(tokens, stop_at_layer=1)
    torch.testing.assert_close(resid, cache["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(model("The cat sat."), model(tokens[:1]))  # strings are tokenized


def test_padding_mask_gives_each_sequence_its_own_loss():
    model = tiny_lm()
    tokens = model.to_tokens(["The cat sat on the mat.", "Hi there"])
    mask = torch.ones_like(tokens)
    mask[1, len(model.to_tokens("Hi there")[0]):] = 0
    padded = model(tokens, attention_mask=mask)
    alone = model(model.to_tokens("Hi there"))
    n = alone.shape[1]
    torch.testing.assert_close(padded[1, :n], alone[0], rtol=1e-4, atol=1e-5)


def test_tokenization_round_trips():
    model = tiny_lm()
    assert model.to_str_tokens("Hi.") == ["<|bos|>", "H", "i", "."]
    ids = model.tokenizer("Hi.", add_special_tokens=False)["input_ids"]
    assert model.to_tokens("Hi.", prepend_bos=False).tolist() == [ids]
    assert model.to_string(model.to_tokens("Hi.", prepend_bos=False)[0]) == "Hi."


def test_hooks_can_edit_the_forward_pass():
    model = tiny_lm()
    tokens = model.to_tokens("The cat")

    def zero_attn(x, hook):
        return torch.zeros_like(x)

    edited = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", zero_attn)])
    assert not torch.allclose(edited, model(tokens))
    assert all(not h.fwd_hooks for h in model.hook_dict.values())  # removed afterwards


def test_massive_lens_analyses_run_on_massive_lm():
    from massive_lens import Criterion, find_massive, layer_profile

    model = tiny_lm()
    with torch.no_grad():  # plant a massive activation: dim 5 of BOS's embedding
        model.W_E[model.tokenizer.bos_token_id, 5] = 500.0
    found = find_massive(model, "The cat sat. The dog ran.", criterion=Criterion(100.0, 100.0)).to_frame()
    assert set(found["dim"]) == {5} and set(found["pos"]) == {0}
    assert len(layer_profile(model, ["One.", "Two."]).to_frame()) == model.cfg.n_layers


def test_bad_inputs_raise():
    with pytest.raises(MassiveLensError, match="divisible"):
        MassiveLMConfig(d_model=30, n_heads=4)
    with pytest.raises(MassiveLensError, match="d_vocab"):
        MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10))
    model = tiny_lm()
    with pytest.raises(MassiveLensError, match="n_ctx"):
        model(torch.zeros(1, 100, dtype=torch.long))
    with pytest.raises(MassiveLensError, match="return_type"):
        model(torch.zeros(1, 3, dtype=torch.long), return_type="probs")


def test_trace_origin_and_decompose_attention_run_on_massive_lm():
    from massive_lens.attention import decompose_attention
    from massive_lens.origin import trace_origin

    model = tiny_lm()
    with torch.no_grad():
        model.W_E[model.tokenizer.bos_token_id, 5] = 500.0
    trace = trace_origin(model, "The cat sat. The dog ran.", dim=5, pos=0)
    assert len(trace.to_frame()) > 0
    for style in ("llama", "gpt2"):
        parts = decompose_attention(tiny_lm(style=style), "The cat sat. The dog ran.")
        assert len(parts.to_frame()) > 0


@pytest.mark.parametrize("attention", ["softmax", "kv_bias", "gated"])
def test_grouped_query_attention_equals_mha_with_shared_kv_heads(attention):
    """A GQA model is exactly the MHA model whose K/V heads are copied to their query groups."""
    gqa = tiny_lm(attention=attention, n_heads=4, n_key_value_heads=2)
    mha = tiny_lm(attention=attention, n_heads=4)
    state = gqa.state_dict()
    for key, value in state.items():
        if key.split(".")[-1] in ("W_K", "W_V", "b_K", "b_V"):
            value = value.repeat_interleave(2, dim=0)
        state[key] = value
    mha.load_state_dict(state)
    tokens = gqa.to_tokens(["The cat sat. The dog ran.", "Hi"])
    _, cache = gqa.run_with_cache(tokens)
    assert gqa.blocks[0].attn.W_K.shape == (2, 32, 8)
    assert cache["blocks.0.attn.hook_k"].shape[2] == cache["blocks.0.attn.hook_v"].shape[2] == 2
    assert cache["blocks.0.attn.hook_pattern"].shape[1] == cache["blocks.0.attn.hook_z"].shape[2] == 4
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_decompose_attention_reconstructs_on_a_gqa_massive_lm():
    from massive_lens.attention import decompose_attention

    for style in ("llama", "gpt2"):  # gpt2 style has value biases on the kv heads
        model = tiny_lm(style=style, n_heads=4, n_key_value_heads=1)
        parts = decompose_attention(model, "The cat sat. The dog ran.", sinks=[0])
        assert parts.reconstruction_error < 1e-5


def test_bad_kv_head_count_raises():
    with pytest.raises(MassiveLensError, match="n_key_value_heads"):
        MassiveLMConfig(n_heads=4, n_key_value_heads=3)
