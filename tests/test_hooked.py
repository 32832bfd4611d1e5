"""HookedTransformer (TransformerLens 3.x) beside TransformerBridge: the same hook names and
the same numbers, weight processing detected, TL-style models passed through, ``name=``.

The tests marked ``tl3`` need TransformerLens 3.x (``make test-tl3`` installs it, with
SAELens, in a second environment); under TransformerLens 4.x they skip and the 4.x
behaviour (``backend="hooked"`` refused with a clear message) is tested instead.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from helpers import WIKITEXT_TEST, WIKITEXT_VALID, needs_wikitext, tiny_lm, untouched

from massive_lens import (
    MassiveLensError,
    decompose_attention,
    find_massive,
    load_model,
    run_interventions,
    trace_origin,
)
from massive_lens.core.model_view import ModelView
from massive_lens.models import byte_tokenizer
from massive_lens.models.backends import hooked_class

HAS_HOOKED = hooked_class() is not None
tl3 = pytest.mark.skipif(not HAS_HOOKED, reason="needs TransformerLens 3.x (HookedTransformer); the installed "
                         "TransformerLens 4.x removed it: run `make test-tl3`")
TEXT = "The quick brown fox jumps over the lazy dog. Then, it sleeps; the dog does not.\nThe end."
REL = 1e-4


def assert_frames_close(a: pd.DataFrame, b: pd.DataFrame, rel: float = REL) -> None:
    """Same rows and columns; numbers equal to ``rel`` of each column's largest value."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b) > 0
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number):
            x, y = x.astype(float), y.astype(float)
            scale = max(np.nanmax(np.abs(y)) if np.isfinite(y).any() else 0.0, 1e-12)
            assert np.array_equal(np.isnan(x), np.isnan(y)), col
            ok = ~np.isnan(y)
            assert np.abs(x[ok] - y[ok]).max(initial=0.0) <= rel * scale, (col, np.abs(x[ok] - y[ok]).max())
        else:
            assert list(x) == list(y), col


def hf_tiny(family: str):
    """A random Hugging Face model of a family (and the byte tokenizer), seeded; its biases are
    random too (Hugging Face initialises them to zero, which would hide a misplaced bias)."""
    tok = byte_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if family == "gpt2":
        hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **ids))
    else:
        config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                                 "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]
        hf = model_cls(config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128, **ids))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return hf.eval(), tok


# --------------------------------------------------------------------------- any TransformerLens


def test_tl_style_model_passes_through_and_is_named():
    model = tiny_lm()
    assert load_model(model) is model
    named = load_model(tiny_lm(), name="my-lm")
    assert ModelView(named).name == "my-lm"
    assert find_massive(named, "Hi. Yo").summary().startswith("my-lm")


def test_name_sets_the_printed_name():
    hf, tok = hf_tiny("llama")
    model = load_model(hf, tokenizer=tok, name="lab-llama", backend="bridge")
    assert model.cfg.model_name == "lab-llama"
    assert find_massive(model, TEXT).summary().startswith("lab-llama")


def test_bad_backend():
    with pytest.raises(MassiveLensError, match="unknown backend 'tl'"):
        load_model(tiny_lm(), backend="tl")


@pytest.mark.skipif(HAS_HOOKED, reason="TransformerLens 3.x is installed: backend='hooked' works here")
def test_hooked_on_tl4_is_a_clear_error():
    hf, tok = hf_tiny("llama")
    with pytest.raises(MassiveLensError, match="needs TransformerLens 3.x.*backend='bridge'"):
        load_model(hf, tokenizer=tok, backend="hooked")
    assert load_model(hf, tokenizer=tok).__class__.__name__ == "TransformerBridge"  # the default on 4.x


# --------------------------------------------------------------------------- TransformerLens 3.x


@tl3
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_tiny_hooked_matches_bridge(family):
    """Converted by TransformerLens's own functions, with no processing: the same logits and
    massive activations as the bridge over the same Hugging Face model."""
    hf, tok = hf_tiny(family)
    tokens = torch.tensor([[tok.bos_token_id, *tok("Hello there. Bye", add_special_tokens=False).input_ids]])
    hooked = load_model(hf, tokenizer=tok, backend="hooked", name=f"tiny-{family}")
    assert type(hooked).__name__ == "HookedTransformer" and hooked.cfg.model_name == f"tiny-{family}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the bridge takes over the HF model: said and expected
        bridge = load_model(hf, tokenizer=tok, backend="bridge")
    with torch.no_grad():
        torch.testing.assert_close(hooked(tokens), bridge(tokens), rtol=1e-4, atol=1e-4)
    views = ModelView(hooked), ModelView(bridge)
    batch = views[0].full_batch(tokens)
    last = views[0].n_layers - 1
    for hook in ("hook_resid_post", "hook_resid_mid", "attn.hook_pattern", "attn.hook_z", "attn.hook_out",
                 "mlp.hook_post", "mlp.hook_out", "ln2.hook_in", "ln2.hook_out", "ln2.hook_scale"):
        ours, theirs = (view.activation(batch, view.hook_name(last, hook)) for view in views)
        torch.testing.assert_close(ours, theirs, rtol=REL, atol=REL * float(theirs.abs().max()), msg=hook)
    with pytest.raises(MassiveLensError, match="already a HookedTransformer"):
        load_model(hooked, backend="bridge")
    assert load_model(hooked) is hooked


@tl3
def test_sae_lens_beside_massive_lens():
    """Both libraries import in one environment, and find_massive runs on a HookedTransformer."""
    if importlib.util.find_spec("sae_lens") is None:
        pytest.skip("sae-lens is not installed (make test-tl3 installs it)")
    import sae_lens
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    assert sae_lens.__version__
    cfg = HookedTransformerConfig(n_layers=2, d_model=32, n_ctx=128, d_head=8, n_heads=4, d_mlp=64, d_vocab=259,
                                  act_fn="gelu", normalization_type="LN", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(cfg, tokenizer=byte_tokenizer()).eval()
    with torch.no_grad():
        model.blocks[0].mlp.b_out[5] = 500.0  # a planted massive dim at every position
    with untouched(model):
        result = find_massive(model, TEXT)
    assert set(result.to_frame().dim) == {5}
    assert load_model(model) is model


@tl3
def test_processed_hooked_transformer_warns():
    """TransformerLens's default processing is detected (cfg and weights), and the warning says
    what each step changes."""
    hf, tok = hf_tiny("gpt2")
    model = load_model(hf, tokenizer=tok, backend="hooked")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelView(model)  # unprocessed: no warning
    model.load_and_process_state_dict(model.state_dict())  # from_pretrained's defaults: every step on
    with pytest.warns(UserWarning, match="processed weights.*fold_ln.*center_writing_weights.*center_unembed.*"
                                         "fold_value_biases.*from_pretrained_no_processing"):
        ModelView(model)


@tl3
def test_alias_hooks_are_read_only_where_computed():
    hf, tok = hf_tiny("llama")
    view = ModelView(load_model(hf, tokenizer=tok, backend="hooked"))
    assert {"blocks.0.attn.hook_out", "blocks.1.ln2.hook_out", "blocks.1.ln2.hook_in"} <= view.hook_names
    batch = view.tokenize("Hi there.")
    seen = view.activation(batch, "blocks.1.mlp.hook_in")
    with torch.no_grad():
        assert seen.shape[-1] == view.d_model
    with pytest.raises(MassiveLensError, match="read-only on a HookedTransformer"):
        view.forward(batch, [("blocks.0.ln2.hook_out", lambda x, hook: x * 0)])


@tl3
@pytest.mark.slow
@needs_wikitext
def test_default_model_hooked_gives_the_bridges_numbers(default_model):
    """The issue's check: find_massive, the trace_origin ledger, decompose_attention and a small
    Table 3 on the default model as a HookedTransformer equal the bridge's to 1e-4 (relative)."""
    hooked = default_model if type(default_model).__name__ == "HookedTransformer" else load_model(backend="hooked")
    bridge = load_model(backend="bridge")
    assert type(hooked).__name__ == "HookedTransformer" and type(bridge).__name__ == "TransformerBridge"
    for model in (hooked, bridge):
        assert ModelView(model).name == "SmolLM2-135M-Instruct"
    results = {}
    for kind, model in (("hooked", hooked), ("bridge", bridge)):
        with untouched(model):
            results[kind] = dict(
                massive=find_massive(model, TEXT).to_frame(),
                ledger=trace_origin(model, TEXT).ledger,
                # both on the pattern (a HookedTransformer has no fused-kernel path; the LSE path's own
                # exactness is tests/test_lse.py's): the constancy of a head's near-zero term (norm 1e-5,
                # a head with all its attention on the sink) is rounding noise that differs between kernels
                attention=decompose_attention(model, TEXT, attention="eager").to_frame(),
                table=run_interventions(model, WIKITEXT_TEST, calibration=WIKITEXT_VALID, seq_len=32, n_seqs=2,
                                        batch_size=2, calibration_seqs=2, progress=False,
                                        settings=["original", "zero", "sink_attention_removed"]).to_frame(),
            )
    for key in results["bridge"]:
        assert_frames_close(results["hooked"][key], results["bridge"][key])


@tl3
@pytest.mark.heavy  # a whole report
def test_quick_report_on_a_hooked_transformer(tmp_path):
    """The report runs on a HookedTransformer: a planted massive activation is found and traced
    to its neuron, and the model is left as it was."""
    from helpers import plant_massive

    from massive_lens.report import write_report

    hf, tok = hf_tiny("llama")
    model = load_model(hf, tokenizer=tok, backend="hooked", name="tiny-hooked")
    plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=tok.bos_token_id, trigger_dim=3)
    with untouched(model):
        html = write_report(model, out_dir=tmp_path, quick=True, progress=False).read_text()
    assert "tiny-hooked" in html and "born in MLP 1 (neuron 5" in html
