"""Outlier statistics and W8A8 simulation on MassiveLM and on a TransformerBridge."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import hook_count, tiny_lm, untouched

from massive_lens.errors import MassiveLensError
from massive_lens.models import tiny_model
from massive_lens.quantize import (
    fake_quant_activation,
    fake_quant_weight,
    fake_quantized,
    measure_outliers,
)
from massive_lens.train.model import MassiveLM, MassiveLMConfig

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
