"""precision_check's cause and smallest fix (massive_lens.handover.rescale) on planted tiny models:
a massive activation past float16's range, written by an MLP neuron, in a pre-norm (Llama) and a
sandwich-norm (Gemma 3) model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import untouched
from planting import SINK_DIM, plant_sink

from massive_lens import MassiveLensError, tiny_model
from massive_lens.core.model_view import ModelView
from massive_lens.handover import precision_check
from massive_lens.handover.rescale import rescale_factor, rescale_hooks

TEXT = "Some text to read, and more of it. " * 10
BIG = 200_000.0  # past float16's 65,504, within reach of a scaled write


def _loss(model, tokens, hooks=()):
    with torch.no_grad():
        return float(model.run_with_hooks(tokens, return_type="loss", fwd_hooks=list(hooks)))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_rescale_hooks_scale_the_residual_and_keep_the_output(family):
    model = tiny_model(family)
    plant_sink(model, 3000.0)
    view = ModelView(model)
    tokens = model.to_tokens(TEXT)
    last = view.block_hook(view.n_layers - 1, "resid_post")
    seen = {}

    def grab(x, hook):
        seen["x"] = x.detach().clone()

    base = _loss(model, tokens, [(last, grab)])
    plain = seen["x"]
    with untouched(model):
        scaled_loss = _loss(model, tokens, [*rescale_hooks(view, 0.25), (last, grab)])
    # every residual value, the planted one included, a quarter; the loss the same (norms are scale-free
    # but for their eps, which weighs more on a smaller input: hence 2%, on a tiny model's small residual)
    torch.testing.assert_close(seen["x"][0, 0, SINK_DIM], plain[0, 0, SINK_DIM] * 0.25, rtol=0.02, atol=0)
    assert scaled_loss == pytest.approx(base, abs=5e-3)
    assert not math.isclose(float(plain[0, 0, SINK_DIM]), float(seen["x"][0, 0, SINK_DIM]))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_residual_overflow_is_named_and_rescaling_fixes_it_in_float16(family):
    model = tiny_model(family)
    plant_sink(model, BIG)
    # the weights fit: only the activation overflows
    assert float(model.blocks[0].mlp.W_out.detach().abs().max()) < 65504
    with untouched(model):
        check = precision_check(model, TEXT, seq_len=16, n_seqs=2)
    v = check.verdicts.set_index("dtype").loc["float16"]
    assert v.verdict == "unsafe"
    # the planted neuron's write is the first value past the range, and the run's first inf
    assert v.cause.startswith("|hook_mlp_out| reaches 200,000 > 65,504 at layer 0") and f"dim {SINK_DIM}" in v.cause
    # the factor is the largest power of two that brings the largest residual value under 65,504 / 2
    top = check.peaks.loc[check.peaks["kind"] != "scores", "max_abs"].max()
    assert v.rescale_factor == 2.0 ** -math.ceil(math.log2(top * 2 / 65504)) < 1
    assert v.rescale_ppl_ratio == pytest.approx(1.0, abs=0.01)  # measured in a float16 run
    assert v.smallest_fix.startswith("rescale") and f"{v.rescale_factor:g}" in v.smallest_fix
    assert "Smallest fix: rescale" in check.summary()
    safe = check.verdicts.set_index("dtype").loc["bfloat16"]
    assert safe.verdict == "safe" and safe.smallest_fix == "none needed" and safe.cause == ""


def test_without_a_residual_overflow_rescaling_is_not_offered():
    model = tiny_model("llama")
    check = precision_check(model, TEXT, seq_len=16, n_seqs=2)
    assert check.verdicts["smallest_fix"].tolist() == ["none needed", "none needed"]
    assert rescale_factor(check.peaks, 65504.0) == 1.0


def test_rescale_factor_and_bad_factors():
    peaks = check_peaks = __import__("pandas").DataFrame(dict(site=["hook_resid_post", "attn.hook_attn_scores"],
                                                              max_abs=[1000.0, 1e9]))
    assert rescale_factor(check_peaks, 65504.0) == 1.0  # attention scores do not scale with the residual
    assert rescale_factor(peaks.assign(max_abs=[70_000.0, 0.0]), 65504.0) == 1 / 4
    view = ModelView(tiny_model("llama"))
    for bad in (0, 1.5, -0.5, True, "0.5"):
        with pytest.raises(MassiveLensError, match="in \\(0, 1\\]"):
            rescale_hooks(view, bad)
