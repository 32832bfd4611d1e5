"""Outlier statistics, W8A8 simulation and the low-bit grid on MassiveLM and on a TransformerBridge."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import hook_count, tiny_lm, untouched

from massive_lens import load
from massive_lens.errors import MassiveLensError
from massive_lens.models import tiny_model
from massive_lens.quant import LowBitGrid, fake_quantized, lowbit_grid, measure_outliers
from massive_lens.quant.fake import fake_quant_activation, fake_quant_tokens, fake_quant_weight
from massive_lens.quant.settings import parse_bits
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM

TEXT = "The cat sat on the mat. The dog ran, and the bird flew.\n" * 40


@pytest.fixture(scope="module")
def bridge():
    model = tiny_model("llama", num_hidden_layers=2)
    # TransformerLens's bridge installs its own pre-hooks on the norms on the first hooked
    # run; take them as the baseline so the tests count only what we add.
    model.run_with_hooks(model.to_tokens("warm up"), fwd_hooks=[])
    return model


def test_weight_quantization_is_int8_symmetric():
    w = torch.randn(8, 16)
    q = fake_quant_weight(w)
    scale = w.abs().max() / 127
    levels = q / scale
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
    assert levels.abs().max() <= 127.0001
    per_channel = fake_quant_weight(w, (1,))
    assert (per_channel - w).abs().max() <= (q - w).abs().max() + 1e-7
    torch.testing.assert_close(per_channel.abs().amax(1), w.abs().amax(1))


def test_activation_quantization_clips_to_the_calibrated_range():
    x = torch.linspace(-3, 3, 101)
    q = fake_quant_activation(x, -1.0, 2.0)
    assert q.min() >= -1.0 - 1e-6 and q.max() <= 2.0 + 1e-6
    assert len(q.unique()) <= 256
    inside = (x > -1) & (x < 2)
    assert (q[inside] - x[inside]).abs().max() <= 3 / 255


@pytest.mark.parametrize("kind", ["massive_lm", "gqa_massive_lm", "bridge"])
def test_measure_outliers_restores_the_model(kind, bridge):
    model = {"massive_lm": lambda: tiny_lm(n_ctx=64), "bridge": lambda: bridge,
             "gqa_massive_lm": lambda: tiny_lm(n_heads=4, n_key_value_heads=2, n_ctx=64)}[kind]()
    with untouched(model):  # no hooks left, weights bit-identical
        report = measure_outliers(model, TEXT, seq_len=32, n_seqs=2)
    row = pd.Series(report.totals)
    assert len(report.to_frame()) == model.cfg.n_layers
    assert row.max_inf_norm > 0 and row.max_ratio > 1 and 0 <= row.sink_metric <= 1
    assert row.w8a8_loss != row.fp_loss  # quantization did something
    tokens = torch.randint(0, 200, (4, 32))  # FP loss (read off the statistics pass) = a plain loss
    with torch.no_grad():
        plain = float(model(tokens[:2], return_type="loss"))
    assert measure_outliers(model, tokens).fp_loss == pytest.approx(plain, rel=1e-5)
    assert abs(row.gap) < 0.5  # but an untrained tiny model has no outliers to hurt it
    assert "W8A8" in report.summary()


@pytest.mark.parametrize("kind", ["massive_lm", "bridge"])
def test_fake_quantized_restores_weights_and_hooks_after_an_exception(kind, bridge):
    model = tiny_lm(attention="gated", n_ctx=64) if kind == "massive_lm" else bridge
    tokens = model.to_tokens(["Calibration text.", "More of it."])
    n_hooks = hook_count(model)
    with torch.no_grad():
        full = model(tokens)
    with untouched(model), pytest.raises(RuntimeError, match="boom"):
        with fake_quantized(model, tokens, per_channel=False, include_head=True), torch.no_grad():
            assert not torch.allclose(model(tokens), full)  # each layer quantized while it runs
            assert hook_count(model) > n_hooks
            raise RuntimeError("boom")


def test_a_failing_calibration_also_restores(bridge):
    bad = torch.full((1, 4), 10**6)  # token ids out of range: the calibration pass raises
    with untouched(bridge), pytest.raises((IndexError, RuntimeError)):
        with fake_quantized(bridge, bad):
            pass


def test_planted_outlier_widens_the_w8a8_gap():
    """A huge activation in one residual dim stretches the int8 grid: the loss gap grows."""
    model = tiny_lm(n_ctx=64)
    clean = measure_outliers(model, TEXT, seq_len=32, n_seqs=2, per_channel=False)
    with torch.no_grad():  # a "massive activation": embedding dim 3 of every token is huge
        model.W_E[:, 3] = 2000.0
        model.blocks[0].ln1.w[3] = 0.0  # keep attention inputs sane, as real models do
    planted = measure_outliers(model, TEXT, seq_len=32, n_seqs=2, per_channel=False)
    assert planted.totals["max_ratio"] > 100 * clean.totals["max_ratio"]
    assert planted.to_frame()["kurtosis"].mean() > 10 * clean.to_frame()["kurtosis"].mean()


def test_bad_inputs_raise():
    with pytest.raises(MassiveLensError, match="hook_points"):
        with fake_quantized(MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2,
                                                      hook_points=False)), torch.zeros(1, 2).long()):
            pass
    with pytest.raises(MassiveLensError):
        with fake_quantized(object(), torch.zeros(1, 2).long()):
            pass


# --------------------------------------------------------------------------- the low-bit grid


def test_fewer_bits_round_coarser():
    w, x = torch.randn(16, 64), torch.randn(3, 5, 64)
    for quant, data in ((lambda t, b: fake_quant_weight(t, (1,), b), w), (fake_quant_tokens, x),
                        (lambda t, b: fake_quant_activation(t, float(t.min()), float(t.max()), b), x)):
        err8, err4 = ((quant(data, b) - data).abs().mean() for b in (8, 4))
        assert 0 < err8 < err4 / 4  # about 16x fewer levels
        assert len(quant(data, 4).reshape(-1, 64)[0].unique()) <= 16  # one row shares one scale
    levels = fake_quant_weight(w, (1,), 4) / (w.abs().amax(1, keepdim=True) / 7)
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)


def test_per_token_activations_confine_an_outlier_to_its_token():
    x = torch.randn(1, 6, 32)
    x[0, 0, 3] = 1000.0  # a massive activation at the first token
    per_token = (fake_quant_tokens(x, 8) - x).abs()[0, 1:].max()
    per_tensor = (fake_quant_activation(x, float(x.min()), float(x.max()), 8) - x).abs()[0, 1:].max()
    assert per_token < 0.05 < per_tensor  # the per-tensor grid's step is about 4 here


@pytest.mark.parametrize("per_token", [True, False])
def test_sixteen_bits_is_full_precision_and_four_bits_hurt_more(bridge, per_token):
    tokens = torch.randint(0, 200, (4, 32))
    with torch.no_grad():
        full = bridge(tokens)
        with untouched(bridge):
            with fake_quantized(bridge, tokens, w_bits=16, a_bits=None, per_token=per_token):
                assert torch.equal(bridge(tokens), full)
            errors = {}
            for w, a in ((8, 8), (4, 16), (4, 4)):
                with fake_quantized(bridge, tokens, w_bits=w, a_bits=a, per_token=per_token):
                    errors[w, a] = float((bridge(tokens) - full).abs().mean())
    assert 0 < errors[8, 8] < errors[4, 16] < errors[4, 4]


def test_lowbit_grid_result(bridge, tmp_path):
    tokens = torch.randint(0, 200, (4, 32))
    with untouched(bridge):
        grid = lowbit_grid(bridge, tokens, settings=["W16A16", "W8A8", "W4A16", "W4A4"])
    frame = grid.to_frame().set_index("setting")
    with torch.no_grad():
        plain = float(bridge(tokens[:2], return_type="loss"))
    assert grid.fp_loss == pytest.approx(plain, rel=1e-5)
    assert frame.loc["W16A16", "gap"] == 0.0
    assert (frame.loss - frame.fp_loss == frame.gap).all() and (frame.activations == "per-token").all()
    assert abs(frame.loc["W8A8", "gap"]) < abs(frame.loc["W4A4", "gap"])
    static = lowbit_grid(bridge, tokens, settings=["W8A8"], per_token=False)
    assert static.gaps()["W8A8"] == pytest.approx(measure_outliers(bridge, tokens).gap, abs=1e-6)  # one W8A8
    loaded = load(grid.save(tmp_path / "grid"))
    assert isinstance(loaded, LowBitGrid) and loaded.summary() == grid.summary()
    assert "W4A4" in grid.summary() and grid.plot() is not None


def test_bad_bit_widths_raise(bridge):
    assert parse_bits("w4a16") == (4, 16)
    for bad in ("W4", "W1A8", "W8A32", "int4"):
        with pytest.raises(MassiveLensError, match="W<bits>A<bits>"):
            parse_bits(bad)
    with pytest.raises(MassiveLensError, match="at least 2"), fake_quantized(bridge, w_bits=1, a_bits=None):
        pass
    with pytest.raises(MassiveLensError, match="calibration"), fake_quantized(bridge, a_bits=8):
        pass


def test_sink_statistics_from_the_pass_at_any_length(monkeypatch):
    """The first-token mass and sink metric come from the attention pass's reading of the loss forwards
    (issue 50): past LSE_FROM tokens on the kernel's path, equal to the eager pattern's (an independent
    first_token_mass over each layer's hook_pattern); the loss still matches a plain forward's."""
    import importlib

    from massive_lens.core.attention_pass import LSE_FROM
    from massive_lens.core.criterion import first_token_mass, sink_metric

    module = importlib.import_module("massive_lens.quant.outlier_stats")
    paths = []
    real = module.choose_path
    monkeypatch.setattr(module, "choose_path", lambda *a, **k: paths.append(real(*a, **k)) or paths[-1])
    model = tiny_model("llama", num_hidden_layers=2, max_position_embeddings=2 * LSE_FROM)
    tokens = torch.randint(1, model.cfg.d_vocab, (2, LSE_FROM + 8), generator=torch.Generator().manual_seed(0))
    with untouched(model):
        report = measure_outliers(model, tokens)
    assert paths == ["lse"]
    _, cache = model.run_with_cache(tokens[:1], names_filter=lambda name: name.endswith("hook_pattern"))
    mass = {layer: first_token_mass(cache[f"blocks.{layer}.attn.hook_pattern"]) for layer in range(2)}
    frame = report.to_frame()
    for layer, heads in mass.items():
        assert abs(float(frame.sink_mass[layer]) - float(heads.mean())) < 1e-5
        assert frame.sink_share[layer] == sink_metric(heads)
    with torch.no_grad():
        plain = float(model(tokens[:1], return_type="loss"))
    assert report.fp_loss == pytest.approx(plain, rel=1e-5)
