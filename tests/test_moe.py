"""Mixture-of-experts MLPs in trace_origin (issue 13): neurons are (expert, neuron), weighted
by the router; super weights are named by expert as the checkpoints name them; shared experts
are handled. Each tiny model routes BOS to a planted expert neuron (see ``matrix.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import untouched
from matrix import DIM, EXPERT, NEURON, PLANT_LAYER, build

from massive_lens import trace_origin
from massive_lens.core.model_view import ModelView
from massive_lens.origin.capture import capture
from massive_lens.origin.experts import SHARED, unit_terms

ARCHS = ["MixtralForCausalLM",  # softmax top-k router, default gate
         "Qwen2MoeForCausalLM",  # a shared expert behind a sigmoid gate
         "GptOssForCausalLM",  # fused, transposed experts with biases and an interleaved custom gate
         "DeepseekV2ForCausalLM"]  # grouped routing, an ungated shared expert


@pytest.mark.parametrize("arch", ARCHS)
def test_planted_expert_neuron_is_named(arch):
    b = build(arch)
    assert b.planted == "expert"
    with untouched(b.model):
        trace = trace_origin(b.model, b.tokens, dim=DIM, pos=0)
    rows = trace.neurons[trace.neurons.layer == PLANT_LAYER]
    top = rows.iloc[0]
    assert (top.expert, top.neuron, bool(top.named)) == (EXPERT, NEURON, True)
    assert 0.0 < top.route <= 1.0 and math.isclose(top.contribution, top.route * top.post * top.w_out, rel_tol=1e-5)
    weight = trace.super_weights.iloc[0]
    assert (weight.expert, weight.neuron) == (EXPERT, NEURON)
    assert f"model.layers.{PLANT_LAYER}.mlp.experts" in weight.hf_param
    assert str(EXPERT) in weight.hf_param
    why = trace.why[(trace.why.expert == EXPERT) & (trace.why.neuron == NEURON)]
    assert set(why.input) == {"gate", "up"}
    for _, part in why.groupby("input"):
        assert math.isclose(part.contribution.sum(), part.value.iloc[0], rel_tol=1e-4, abs_tol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_neurons_sum_to_the_mlp_output(arch):
    """Every (expert, neuron) term, router-weighted, plus the shared expert and the biases,
    adds up to the MLP's output (``hook_mlp_out``) in every dim, at the planted token and at
    ordinary ones (two experts each)."""
    b = build(arch)
    view = ModelView(b.model)
    positions = torch.tensor([0, 3, 7])
    with untouched(b.model):
        cap = capture(view, view.tokenize(b.tokens), positions, None)
    plan = cap.plans[PLANT_LAYER]
    data = {k[4:]: v for k, v in cap.neuron_data[PLANT_LAYER].items() if k.startswith("moe_")}
    mlp_out = cap.layers["mlp"][PLANT_LAYER]
    shared = 0
    for i in range(len(positions)):
        assert (data["weights"][i] > 0).sum() >= 1
        for dim in range(view.d_model):
            units = unit_terms(plan.experts, data, i, dim, mlp_out[i])
            assert units is not None
            total = float(units.contribution.sum()) + units.bias
            assert math.isclose(total, float(mlp_out[i, dim]), rel_tol=1e-4,
                                abs_tol=1e-4 * float(mlp_out[i].abs().max())), (i, dim)
            shared += int((units.expert == SHARED).sum())
    assert (shared > 0) == (plan.experts.shared_down is not None)


def test_units_refuse_when_they_do_not_add_up():
    """A hook that scales the experts' output by 1.01 outside the experts: no silent rows."""
    b = build("MixtralForCausalLM")
    view = ModelView(b.model)
    experts = b.model.blocks[PLANT_LAYER].mlp.original_component.experts
    handle = experts.register_forward_hook(lambda module, args, out: out * 1.01)
    try:
        trace = trace_origin(b.model, b.tokens, dim=DIM, pos=0)
    finally:
        handle.remove()
    assert trace.neurons[trace.neurons.layer == PLANT_LAYER].empty
    assert any("do not add up" in n for n in trace.notes)
    assert view.model is b.model
