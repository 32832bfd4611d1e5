"""Interventions: what each edits (checked against exact expectations on tiny and planted
models), that the model is always restored (hooks gone, weights identical, even when the
block raises), and bad input."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import plant_massive, untouched

from massive_lens import MassiveLensError, tiny_model
from massive_lens.interventions import (
    ablate_massive,
    bias_surgery,
    calibrate,
    fix_sink_term,
    patch_sink_from,
    remove_sink_attention,
)

CALIB = "The river runs to the sea. Birds sing at dawn, and the town wakes. " * 6
BOS = 256


@pytest.fixture(scope="module")
def calibrated_planted_llama():
    """A tiny llama whose layer-1 MLP writes 5000 into dim 7 at BOS (a known massive
    activation), and its calibration: ``(model, calibration)``."""
    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=5, dim=7, value=5000.0, trigger=BOS, trigger_dim=3)
    return model, calibrate(model, CALIB, seq_len=32, n_seqs=4, progress=False)


@functools.lru_cache(maxsize=1)
def _tokens() -> torch.Tensor:
    from massive_lens.core.model_view import ModelView

    return ModelView(tiny_model("llama")).tokenize("A bird sang, then flew.").tokens


def _run(model, intervention=None):
    with torch.no_grad():
        if intervention is None:
            return model(_tokens())
        with intervention:
            return model(_tokens())


def test_calibration_finds_the_planted_activation(calibrated_planted_llama):
    from massive_lens import find_massive
    from massive_lens.core.corpora import sequences
    from massive_lens.core.model_view import ModelView

    model, calib = calibrated_planted_llama
    assert calib.detect_layer == 1 and calib.dims[1].tolist() == [7]
    found = find_massive(model, sequences(ModelView(model), CALIB, 32, 4)).to_frame()
    expected = found[found["layer"] == 1]["value"].mean()  # BOS (5000) and weaker hits elsewhere
    assert calib.means[1].item() == pytest.approx(expected, rel=1e-4)
    assert calib.attn_layers == (2, 3)


def test_ablate_massive_edits_exactly_the_massive_entry(calibrated_planted_llama):
    model, calib = calibrated_planted_llama
    seen = {}
    probe = ("blocks.1.hook_resid_post", lambda x, hook: seen.setdefault("x", x.clone()))
    for mode, expected in (("zero", 0.0), ("mean", calib.means[1].item()), (123.0, 123.0)):
        seen.clear()
        iv = ablate_massive(model, mode, calibration=calib)
        with iv, model.hooks(fwd_hooks=[probe]):  # probe runs after the edit
            model(_tokens())
        assert seen["x"][0, 0, 7].item() == pytest.approx(expected, rel=1e-5)
    seen.clear()
    with ablate_massive(model, calibration=calib, control=True), model.hooks(fwd_hooks=[probe]):
        model(_tokens())
    assert seen["x"][0, 0, 7].item() == pytest.approx(5000.0, rel=1e-3)  # the control leaves it
    assert (seen["x"][0] == 0).sum().item() >= 1  # and zeroes one median-magnitude entry


def test_zeroed_sink_term_equals_unrenormalized_removal(calibrated_planted_llama):
    model, calib = calibrated_planted_llama
    a = _run(model, fix_sink_term(model, "zero", calibration=calib))
    b = _run(model, remove_sink_attention(model, renormalize=False, calibration=calib))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, _run(model))


def test_bias_slot_reproduces_a_bos_sink(family):
    """Unsuppressed, an explicit slot holding the BOS key/value is the BOS sink: same output."""
    model = tiny_model(family)
    if not model.cfg.default_prepend_bos:
        pytest.skip(f"{family} prepends no BOS, so its first token (the fallback sink) varies")
    calib = calibrate(model, CALIB, seq_len=32, n_seqs=2, progress=False)
    torch.testing.assert_close(_run(model, bias_surgery(model, calibration=calib, suppress=False)), _run(model),
                               rtol=1e-5, atol=1e-5)


def test_patch_from_same_text_is_identity():
    model = tiny_model("gpt2")
    same = patch_sink_from(model, "A bird sang, then flew.", positions=[0, 3])
    torch.testing.assert_close(_run(model, same), _run(model))
    assert not torch.allclose(_run(model, patch_sink_from(model, "Other words!", positions=[3])), _run(model))


@pytest.mark.parametrize("build", [
    lambda m, c: ablate_massive(m, "mean", calibration=c),
    lambda m, c: ablate_massive(m, calibration=c, control=True),
    lambda m, c: fix_sink_term(m, "mean", calibration=c),
    lambda m, c: remove_sink_attention(m, calibration=c),
    lambda m, c: bias_surgery(m, calibration=c),
    lambda m, c: patch_sink_from(m, "Another text."),
])
def test_model_restored_even_on_error(calibrated_planted_llama, build):
    model, calib = calibrated_planted_llama
    before = _run(model)
    with untouched(model):
        iv = build(model, calib)
        with pytest.raises(RuntimeError, match="boom"), iv:
            model(_tokens())
            raise RuntimeError("boom")
    torch.testing.assert_close(_run(model), before)


def test_calibrate_leaves_model_untouched(family):
    model = tiny_model(family)
    with untouched(model):
        calib = calibrate(model, CALIB, seq_len=16, n_seqs=2, progress=False)
    assert calib.sink_z.shape == (model.cfg.n_layers, model.cfg.n_heads, model.blocks[0].attn.W_Q.shape[-1])


def test_bad_input(calibrated_planted_llama):
    model, calib = calibrated_planted_llama
    with pytest.raises(MassiveLensError, match="mode"):
        ablate_massive(model, "median", calibration=calib)
    with pytest.raises(MassiveLensError, match="control"):
        ablate_massive(model, "mean", calibration=calib, control=True)
    with pytest.raises(MassiveLensError, match="mode"):
        fix_sink_term(model, "half", calibration=calib)
    with pytest.raises(MassiveLensError, match="no token-specific massive activations"):
        ablate_massive(tiny_model("gpt2"), calibration=CALIB)


def test_a_tables_calibration_is_reused(calibrated_planted_llama):
    """``table.calibration`` is the Calibration the table used: handing it back to an
    intervention reuses it (no second calibration pass) and gives the table's perplexity."""
    import massive_lens.interventions.assemble as assemble
    from massive_lens import perplexity, run_interventions
    from massive_lens.interventions import Calibration

    model, _ = calibrated_planted_llama
    text = "Summer is warm. Winter is cold. The cat sat on the mat, and the dog slept. " * 6
    table = run_interventions(model, text, calibration=CALIB, seq_len=32, n_seqs=2, calibration_seqs=4,
                              settings=["original", "mean"], progress=False)
    assert isinstance(table.calibration, Calibration) and table.calibration_source in table.summary()

    assert assemble.calibration_of(model, table.calibration) is table.calibration  # reused, not redone
    with untouched(model):
        fx = ablate_massive(model, "mean", calibration=table.calibration)
        loss = perplexity(model, text, seq_len=32, n_seqs=2, hooks=fx, progress=False).loss
    row = table.to_frame().set_index("setting").loc["mean"]
    # compared as losses (log-perplexities), float32 means of the same passes: a few float32 ulps
    assert loss == pytest.approx(math.log(float(row.perplexity)), rel=16 * torch.finfo(torch.float32).eps)
