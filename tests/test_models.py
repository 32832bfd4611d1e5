from __future__ import annotations

import json

import pytest
import torch

from massive_lens import MassiveLensError, load_model, tiny_model
from massive_lens.models import byte_tokenizer
from massive_lens.models.backends import default_backend
from massive_lens.models.cache import cache_is_valid, write_cache


def test_tiny_families_run(family):
    model = tiny_model(family, num_hidden_layers=2)
    assert model.cfg.n_layers == 2
    logits = model(model.to_tokens("Hello."))
    assert torch.isfinite(logits).all()


def test_tiny_is_seeded():
    a, b = tiny_model("llama", seed=3), tiny_model("llama", seed=3)
    assert torch.equal(a.W_E, b.W_E)
    assert not torch.equal(a.W_E, tiny_model("llama", seed=4).W_E)


def test_bad_names():
    with pytest.raises(MassiveLensError, match="choose one of"):
        tiny_model("bert")
    with pytest.raises(MassiveLensError, match="no GGUF file"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(MassiveLensError, match="load_model got a int"):
        load_model(3)
    with pytest.raises(MassiveLensError, match="unknown dtype"):
        load_model(tiny_model("llama"), dtype="float7")


def test_local_folder_and_hf_model_round_trip(tmp_path):
    """A folder saved with save_pretrained loads offline and computes the same logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = byte_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tokens = torch.tensor([[72, 101, 108, 108, 111]])
    with torch.no_grad():
        expected = hf(tokens).logits
    again = load_model(str(tmp_path))
    assert torch.allclose(again(tokens), expected, atol=1e-5)
    dispatched = load_model(str(tmp_path), device_map="auto")  # accelerate's dispatch path
    assert torch.allclose(dispatched(tokens), expected, atol=1e-5)
    assert next(load_model(str(tmp_path), dtype="bfloat16").parameters()).dtype == torch.bfloat16
    wrapped = load_model(hf, tokenizer=tok)
    assert torch.allclose(wrapped(tokens), expected, atol=1e-5)


def test_unknown_local_folder(tmp_path):
    with pytest.raises(MassiveLensError):
        load_model(str(tmp_path))


def test_cache_detects_half_written_files(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2))
    folder = tmp_path / "cache"
    write_cache(folder, hf, tok)
    assert cache_is_valid(folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # an interrupted copy
    assert not cache_is_valid(folder)
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit off
    assert not cache_is_valid(folder)
    weights.write_bytes(data)
    assert cache_is_valid(folder)
    (folder / "manifest.json").write_text(json.dumps({"version": -1, "files": {}}))
    assert not cache_is_valid(folder)


@pytest.mark.slow
def test_default_model(default_model):
    """The default backend: a HookedTransformer where TransformerLens 3.x offers it, else a bridge."""
    assert type(default_model).__name__ == {"hooked": "HookedTransformer", "bridge": "TransformerBridge"}[
        default_backend()]
    assert not default_model.training
    assert next(default_model.parameters()).dtype == torch.float32
    assert load_model(default_model) is default_model


def test_unsupported_architecture_lists_what_is_available():
    from transformers import CTRLConfig, CTRLLMHeadModel

    hf = CTRLLMHeadModel(CTRLConfig(vocab_size=259, n_embd=32, n_layer=1, n_head=2, dff=64))
    with pytest.raises(MassiveLensError, match="could not wrap.*Supported architecture"):
        load_model(hf, tokenizer=byte_tokenizer())
