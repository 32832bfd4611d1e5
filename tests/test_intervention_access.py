"""Interventions on bridges whose attention hooks differ (issue 13): a pattern fired after the
Hugging Face module used it (OPT), rotary hooks that never fire (GPT-NeoX), latent attention
(DeepSeek-V2) and no per-head values (JetMoE). Calibration reads what each gives, exactly;
an intervention that needs a missing piece refuses, naming the architecture, the layer and
the hook; the massive-activation edits work everywhere. Also: bad modes and calibration text
equal to the evaluation text."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import untouched
from matrix import build

from massive_lens import MassiveLensError, tiny_model
from massive_lens.interventions import (
    ablate_massive,
    bias_surgery,
    calibrate,
    fix_sink_term,
    remove_sink_attention,
    run_interventions,
)
from massive_lens.interventions.access import attention_access


def _calibrated(arch: str):
    b = build(arch)
    with untouched(b.model):
        return b, calibrate(b.model, b.calib_tokens, progress=False)


@pytest.mark.parametrize("arch", ["OPTForCausalLM", "LlamaForCausalLM"])
def test_calibration_reads_the_pattern_in_any_order(arch):
    """OPT fires hook_pattern after hook_z: the sink mass still matches transformers' attention
    weights, and the sink term is measured (finite)."""
    b, calib = _calibrated(arch)
    with torch.no_grad():
        attentions = b.ref(b.calib_tokens, output_attentions=True).attentions
    sinks = calib.sinks.mask.float()
    queries = 1.0 - sinks
    for layer in calib.attn_layers:
        mass = torch.einsum("bhqk,bk,bq->h", attentions[layer].float(), sinks, queries) / queries.sum()
        torch.testing.assert_close(calib.sink_mass[layer], mass, rtol=1e-4, atol=1e-6)
        assert torch.isfinite(calib.sink_z[layer]).all() and torch.isfinite(calib.sink_v[layer]).all()


@pytest.mark.parametrize(("arch", "refused", "match"), [
    ("OPTForCausalLM", [fix_sink_term, remove_sink_attention, bias_surgery], "fires"),
    ("GPTNeoXForCausalLM", [bias_surgery], "rotary embedding"),
    ("DeepseekV2ForCausalLM", [fix_sink_term, bias_surgery], r"\[batch, pos, head, d_head\]"),
    ("JetMoeForCausalLM", [fix_sink_term, bias_surgery], "has no such hook"),
])
def test_missing_pieces_are_named(arch, refused, match):
    b, calib = _calibrated(arch)
    with untouched(b.model):
        for build_it in refused:
            with pytest.raises(MassiveLensError, match=f"{arch}.*{match}"):
                build_it(b.model, calibration=calib)
        if not calib.dims:  # the planted dim is an outlier dimension over the run (OPT's tiny model): nothing to ablate
            assert calib.outlier_dims.numel()
            with pytest.raises(MassiveLensError, match="no token-specific massive activations"):
                ablate_massive(b.model, calibration=calib)
            return
        with torch.no_grad():
            base = b.model(b.tokens)
            with ablate_massive(b.model, calibration=calib):
                edited = b.model(b.tokens)
        assert torch.isfinite(edited).all() and not torch.equal(base, edited)


def test_access_probe():
    access = attention_access(build("OPTForCausalLM").model)[1]
    assert access.fires("pattern") and not access.before("pattern", "z") and access.key_hook == "k"
    neox = attention_access(build("GPTNeoXForCausalLM").model)[1]
    assert "rot_k" in neox.named and not neox.fires("rot_k") and neox.key_hook is None
    _, calib = _calibrated("GPTNeoXForCausalLM")
    assert all(torch.isnan(calib.sink_k[layer]).all() for layer in calib.attn_layers)  # never a wrong key
    assert all(torch.isfinite(calib.sink_z[layer]).all() for layer in calib.attn_layers)


@pytest.mark.parametrize("mode", [math.nan, math.inf, -math.inf, "median"])
def test_ablate_massive_refuses_bad_modes(mode):
    model = tiny_model("llama")
    with untouched(model), pytest.raises(MassiveLensError, match="finite number"):
        ablate_massive(model, mode, calibration="Some text. " * 20)


def test_calibration_equal_to_evaluation_text_is_refused():
    model, text = tiny_model("llama"), "The cat sat. A dog ran. " * 40
    with untouched(model), pytest.raises(MassiveLensError, match="shares 2 of its 2 sequences"):
        run_interventions(model, text, calibration=text, seq_len=16, n_seqs=2, calibration_seqs=2,
                          settings=["original"], progress=False)


def test_pattern_edit_probe_is_not_fooled_by_a_zero_padding_embedding():
    """Gemma's padding embedding is zero: a probe on padding tokens would see no effect of a
    pattern edit. On real tokens the edit applies, and remove_sink_attention changes the output."""
    from massive_lens.interventions.access import pattern_edits_apply

    b, calib = _calibrated("Gemma2ForCausalLM")
    assert all(pattern_edits_apply(b.model, layer) for layer in calib.attn_layers)
    assert not pattern_edits_apply(build("OPTForCausalLM").model, 1)
    with untouched(b.model), torch.no_grad():
        base = b.model(b.tokens)
        with remove_sink_attention(b.model, calibration=calib):
            edited = b.model(b.tokens)
    assert not torch.equal(base, edited)
