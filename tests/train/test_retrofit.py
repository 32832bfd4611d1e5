"""Retrofit: attention swapped into a Hugging Face model, removal of massive activations, fine-tuning."""

from __future__ import annotations

import argparse
import dataclasses

import pandas as pd
import pytest
import torch
import transformers as tf
from helpers import needs_wikitext, untouched
from planting import BIRTH, SINK_DIM, TEXT, plant_sink

from massive_lens import find_massive, layer_profile, load, tiny_model
from massive_lens.errors import MassiveLensError
from massive_lens.train import MassiveLM, MassiveLMConfig, VariantConfig
from massive_lens.train.hf_attention import (
    attention_modules,
    bridge_hooks,
    load_into_bridge,
    plain_copy,
    swap_attention,
    variant_of,
)
from massive_lens.train.model import lm_loss
from massive_lens.train.retrofit import Retrofit, retrofit
from massive_lens.train.retrofit_cli import add_arguments, check_arguments
from massive_lens.train.retrofit_cli import main as cli_main
from massive_lens.train.retrofit_parts import (
    SLOT_NOISE,
    analysis_bridge,
    load_retrofitted,
    parse_setting,
    save_retrofitted,
    seed_slots,
    tracked_eval,
)

VARIANTS = [VariantConfig("softmax"), VariantConfig("softmax1"), VariantConfig("softmax_n", n=3),
            VariantConfig("learned_sink"), VariantConfig("kv_bias"), VariantConfig("k_bias")]


def _llama_twin(cfg: MassiveLMConfig, lm: MassiveLM) -> torch.nn.Module:
    """A Hugging Face Llama holding ``lm``'s weights (an independent implementation of the same net)."""
    h, kv, d, m = cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads, cfg.d_head, cfg.d_model
    config = tf.LlamaConfig(vocab_size=cfg.d_vocab, hidden_size=m, intermediate_size=cfg.d_mlp,
                            num_hidden_layers=cfg.n_layers, num_attention_heads=h, num_key_value_heads=kv,
                            head_dim=d, rms_norm_eps=cfg.eps, max_position_embeddings=cfg.n_ctx + 1,
                            rope_theta=cfg.rotary_base, tie_word_embeddings=False)
    hf = tf.LlamaForCausalLM(config).to(lm.W_E.dtype).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(lm.W_E)
        hf.model.norm.weight.copy_(lm.ln_final.w)
        hf.lm_head.weight.copy_(lm.W_U.T)
        for block, layer in zip(lm.blocks, hf.model.layers, strict=True):
            a, f = block.attn, block.mlp
            layer.input_layernorm.weight.copy_(block.ln1.w)
            layer.post_attention_layernorm.weight.copy_(block.ln2.w)
            for W, proj in ((a.W_Q, layer.self_attn.q_proj), (a.W_K, layer.self_attn.k_proj),
                            (a.W_V, layer.self_attn.v_proj)):
                proj.weight.copy_(W.permute(0, 2, 1).reshape(-1, m))
            layer.self_attn.o_proj.weight.copy_(a.W_O.reshape(-1, m).T)
            layer.mlp.gate_proj.weight.copy_(f.W_gate.T)
            layer.mlp.up_proj.weight.copy_(f.W_in.T)
            layer.mlp.down_proj.weight.copy_(f.W_out.T)
    return hf


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name + (f"{v.n}" if v.name == "softmax_n" else ""))
def test_swapped_variant_matches_massive_lm(variant):
    cfg = MassiveLMConfig(n_layers=2, d_model=32, n_heads=4, n_key_value_heads=2, n_ctx=24, init_range=0.3,
                          attention=variant)
    lm = MassiveLM(cfg).eval()
    with torch.no_grad():
        for block in lm.blocks:
            for p in block.attn.variant.parameters():
                p.normal_(0, 1.0)
    lm = lm.to(torch.float64)  # float64 on both sides: 1e-5 then measures the implementations, not rounding
    hf = swap_attention(_llama_twin(cfg, lm).to(torch.float64), variant)
    for block, module in zip(lm.blocks, attention_modules(hf), strict=True):
        module.ml_variant.load_state_dict(block.attn.variant.state_dict())
    tokens = torch.randint(0, cfg.d_vocab, (3, 20))
    expected = lm(tokens)
    assert torch.allclose(hf(tokens, use_cache=False).logits, expected, atol=1e-5, rtol=0)
    loss, rows = tracked_eval(hf, tokens, [0], lm_loss)  # the explicit (recording) path gives the same loss
    assert loss == pytest.approx(float(lm(tokens, return_type="loss")), abs=1e-5)
    has_slot = variant.name != "softmax"
    assert all((r["slot_mass"] > 0) == has_slot and 0 < r["first_mass"] < 1 for r in rows)
    hidden = hf(tokens, use_cache=False, output_hidden_states=True).hidden_states[1:-1]  # the last is normed
    for row, h in zip(rows, hidden, strict=False):  # top-1 and median per sequence, then averaged
        top, median = h.abs().flatten(1).amax(1), torch.stack([x.abs().flatten().median() for x in h])
        assert row["top1"] == pytest.approx(float(top.mean()), rel=1e-5)
        assert row["median"] == pytest.approx(float(median.mean()), rel=1e-5)
        assert row["ratio"] == pytest.approx(float((top / median).mean()), rel=1e-5)


@pytest.mark.parametrize("name", ["softmax1", "learned_sink", "kv_bias"])
def test_bridge_with_hooks_computes_the_swapped_model(name):
    bridge = tiny_model("llama")
    hf = swap_attention(plain_copy(bridge), name)
    with torch.no_grad():
        for module in attention_modules(hf):
            for p in module.ml_variant.parameters():
                p.normal_(0, 1.0)
    tokens = torch.tensor([[256, 72, 105, 33, 44, 50, 51]])
    assert variant_of(hf) == name
    with untouched(bridge):
        plain = bridge(tokens)
        load_into_bridge(bridge, hf)  # same weights as before: the bridge is unchanged
        with bridge.hooks(fwd_hooks=bridge_hooks(bridge, hf)):
            swapped = bridge(tokens)
    expected = hf(tokens, use_cache=False).logits
    assert torch.allclose(swapped, expected, atol=1e-5)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the slots matter
    analysed = analysis_bridge(hf, bridge.tokenizer)
    assert torch.allclose(analysed(tokens), expected, atol=1e-5)
    profile = layer_profile(analysed, tokens).to_frame()  # the analysis bridge reads the variant's stream
    hidden = hf(tokens, use_cache=False, output_hidden_states=True).hidden_states[1:-1]  # the last is normed
    assert torch.allclose(torch.tensor(profile.top1_mean[: len(hidden)].tolist()),
                          torch.tensor([float(h.abs().max()) for h in hidden]), rtol=1e-4)


def test_bad_settings_and_variants():
    assert parse_setting("kv_bias-removed-held").hold
    for bad in ("softmax", "gated-removed", "softmax-kept-held", "softmax-gone"):
        with pytest.raises(MassiveLensError):
            parse_setting(bad)
    with pytest.raises(MassiveLensError, match="cannot be swapped"):
        swap_attention(plain_copy(tiny_model("llama")), "gated")
    with pytest.raises(MassiveLensError, match="nothing in this .* is massive"):
        retrofit(tiny_model("llama"), ["softmax-removed"], steps=1, batch_size=1, seq_len=16, data=TEXT,
                 eval_data=TEXT, progress=False, measure=False)


@pytest.mark.heavy
def test_smoke_removal_swap_and_loss_falls(tmp_path):
    model = tiny_model("llama")
    plant_sink(model)
    models: dict = {}
    with untouched(model):
        result = retrofit(model, ["softmax-kept", "softmax1-removed", "kv_bias-removed-held"], steps=6,
                          batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, data=TEXT, eval_data=TEXT,
                          eval_every=3, eval_seqs=2, out_dir=tmp_path, progress=False, models=models,
                          save_models=tmp_path / "models")
    assert result.dims == [SINK_DIM] and BIRTH in set(result.super_weights.neuron)
    start = result.per_layer[result.per_layer.step == 0].groupby("setting").dims_max.max()
    assert start["softmax-kept"] > 1000 > 10 * start["softmax1-removed"]  # removal took the planted value away
    frame = result.to_frame().set_index("setting")
    assert (frame.val_loss < frame.val_loss_start).all()  # every setting learns
    assert frame.loc["kv_bias-removed-held", "slot_mass"] > 0 == frame.loc["softmax-kept", "slot_mass"]
    assert frame["gap"].notna().all()
    assert variant_of(models["softmax1-removed/seed0"]) == "softmax1"
    saved, _, meta = load_retrofitted(tmp_path / "models" / "kv_bias-removed-held_seed0")
    assert meta["hold_start"] == int(result.super_weights.layer.min()) and meta["dims"] == [SINK_DIM]
    assert variant_of(saved) == "kv_bias"
    loaded = load(tmp_path / "result")
    assert isinstance(loaded, Retrofit) and loaded.summary() == result.summary()
    parts = [dataclasses.replace(result, **{name: _rows_of(getattr(result, name), s)
                                            for name in ("curves", "per_layer", "finals")})
             for s in result.curves.setting.unique()]
    pd.testing.assert_frame_equal(Retrofit.merge(*parts).to_frame(), result.to_frame())
    with pytest.raises(MassiveLensError):
        Retrofit.merge()
    assert (tmp_path / "loss.png").is_file() and (tmp_path / "activations.png").is_file()


def _rows_of(frame, setting):
    return frame[frame.setting == setting]


@pytest.mark.slow
@needs_wikitext  # retrofit's default training and evaluation text
def test_default_model_few_steps(default_model, tmp_path):
    with untouched(default_model):
        result = retrofit(default_model, ["softmax-removed", "softmax1-removed"], steps=2, batch_size=2,
                          seq_len=64, eval_every=2, eval_seqs=2, measure=False, progress=False)
    assert result.dims and len(result.super_weights)
    frame = result.to_frame().set_index("setting")
    # the removal takes the first token's massive activation away at step 0 (the same dims can
    # stay large at other positions: docs/retrofit.md measures about 2,000 there)
    untouched_first = find_massive(default_model, "The history of the city begins here.").by_dim()
    untouched_first = float(untouched_first[untouched_first.pos == 0].value.abs().max())
    first = result.per_layer[result.per_layer.step == 0].first_max.max()
    assert first < 0.1 * untouched_first, (first, untouched_first)
    assert (frame.val_loss < frame.val_loss_start).all()


def test_a_seed_changes_the_slot_noise_and_nothing_else():
    bridge = tiny_model("llama")
    copies = {}
    for key, seed in (("a", 0), ("b", 0), ("c", 1)):
        hf = swap_attention(plain_copy(bridge), "learned_sink")  # starts at logit 0: no other randomness
        before = {k: v.clone() for k, v in hf.state_dict().items() if "ml_variant" not in k}
        seed_slots(hf, seed)
        after = hf.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())  # only the slots move
        slots = [p.detach().flatten() for m in attention_modules(hf) for p in m.ml_variant.parameters()]
        copies[key] = torch.cat(slots)
    assert torch.equal(copies["a"], copies["b"]) and not torch.allclose(copies["a"], copies["c"])
    noise = copies["c"] - copies["a"]
    assert 0.5 * SLOT_NOISE < float(noise.std()) < 3 * SLOT_NOISE


def test_saved_model_reads_back_with_its_variant(tmp_path):
    bridge = tiny_model("llama")
    hf = swap_attention(plain_copy(bridge), "learned_sink")
    seed_slots(hf, 3, scale=1.0)
    tokens = torch.tensor([[256, 72, 105, 33, 44, 50, 51]])
    folder = save_retrofitted(hf, tmp_path / "m", dict(setting="learned_sink-removed", seed=3), bridge.tokenizer)
    assert not [f for f in folder.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle")]
    back, tokenizer, meta = load_retrofitted(folder)
    assert meta == dict(setting="learned_sink-removed", seed=3, variant="learned_sink") and tokenizer is not None
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, use_cache=False).logits, hf(tokens, use_cache=False).logits)
    with pytest.raises(MassiveLensError, match="save_retrofitted"):
        load_retrofitted(tmp_path)


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_checks_its_arguments_before_training(tmp_path, capsys):
    empty, a_file = tmp_path / "empty.txt", tmp_path / "file"
    empty.write_text("")
    a_file.write_text("x")
    bad = {("--seeds", "x"): "comma-separated integers", ("--settings", ","): "empty",
           ("--settings", "softmax-gone"): "bad retrofit setting", ("--steps", "0"): "--steps 0",
           ("--seq-len", "1"): "at least 2", ("--data", str(empty)): "empty",
           ("--eval-data", str(tmp_path / "nowhere.txt")): "no such file", ("--out-dir", str(a_file)): "is a file",
           ("--model", str(tmp_path / "no_model_here")): "no such model folder"}
    for argv, message in bad.items():
        with pytest.raises(MassiveLensError, match=message):
            check_arguments(_args(*argv))
    assert check_arguments(_args("--seeds", "0,2", "--settings", "softmax-kept, softmax1-removed")) == (
        ["softmax-kept", "softmax1-removed"], [0, 2])
    assert cli_main(["--seeds", "x"]) == 2  # a message, no traceback
    err = capsys.readouterr().err
    assert "--seeds 'x'" in err and "Traceback" not in err


def test_retrofit_checks_length_against_context_and_data(tmp_path):
    model = tiny_model("llama")
    short = tmp_path / "short.txt"
    short.write_text("a b")
    for kwargs, message in ((dict(seq_len=model.cfg.n_ctx + 1), "context"), (dict(seq_len=1), "at least 2"),
                            (dict(seq_len=16, data=str(short)), "fewer than one sequence")):
        with pytest.raises(MassiveLensError, match=message):
            retrofit(model, ["softmax-kept"], steps=1, batch_size=1, eval_data=TEXT, progress=False,
                     measure=False, **{"data": TEXT, **kwargs})


def test_a_result_saved_before_per_layer_was_named_loads():
    """The committed runs behind docs/retrofit.md were saved with the per-layer table named
    ``layers``; they load with it as ``per_layer`` and merge with new results."""
    from pathlib import Path

    saved = sorted((Path(__file__).resolve().parents[2] / "docs" / "retrofit" / "seeds").glob("*/result"))
    if not saved:
        pytest.skip("no committed retrofit runs")
    old = load(saved[0])
    assert {"layer", "dims_max", "first_max"} <= set(old.per_layer.columns) and len(old.per_layer)
    merged = Retrofit.merge(old, old)
    assert len(merged.per_layer) == 2 * len(old.per_layer)
    assert merged.to_frame()[["setting", "seed"]].values.tolist() == old.to_frame()[["setting", "seed"]].values.tolist()
