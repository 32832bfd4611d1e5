"""The block variants of issue 13, each checked on its own tiny planted model (see
``matrix.py``): parallel attention + MLP blocks, post-sublayer norms only, OPT's flattened
MLP, BLOOM's embedding norm and ALiBi, and a decomposition that does not reconstruct."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import untouched
from matrix import DIM, NEURON, PLANT_LAYER, build

from massive_lens import MassiveLensError, decompose_attention, trace_origin

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)


def _trace(arch: str):
    b = build(arch)
    with untouched(b.model):
        return b, trace_origin(b.model, b.tokens, dim=DIM, pos=0)


@pytest.mark.parametrize("arch", ["GPTNeoXForCausalLM", "PhiForCausalLM", "GPTJForCausalLM"])
def test_parallel_block(arch):
    """Attention and MLP both read resid_pre: the ledger holds, the birth is the planted
    neuron, and "why this token" leaves the same block's attention out (and sums exactly)."""
    b, trace = _trace(arch)
    assert f"blocks.{PLANT_LAYER}.hook_resid_mid" not in b.model.hook_dict
    assert trace.reconstruction_error < 1e-4
    birth = trace.births.iloc[0]
    assert (birth.component, birth.layer) == ("mlp", PLANT_LAYER)
    assert NEURON in trace.neurons[trace.neurons.named].neuron.tolist()
    why = trace.why[trace.why.neuron == NEURON]
    upstream = set(zip(why.source, why.source_layer, strict=True))
    assert ("attn", PLANT_LAYER) not in upstream and ("attn", PLANT_LAYER - 1) in upstream
    for _, rows in why.groupby("input"):
        assert math.isclose(rows.contribution.sum(), rows.value.iloc[0], rel_tol=1e-4)


def test_post_norms_only():
    """OLMo 2: no pre-norms, post-norms after each sublayer; the MLP reads the raw residual."""
    b, trace = _trace("Olmo2ForCausalLM")
    assert "blocks.0.ln2.hook_in" not in b.model.hook_dict
    assert trace.reconstruction_error < 1e-4
    why = trace.why[trace.why.neuron == NEURON]
    assert set(why.input) == {"gate", "up"}
    for _, rows in why.groupby("input"):
        assert math.isclose(rows.contribution.sum(), rows.value.iloc[0], rel_tol=1e-4)


def test_opt_flattened_mlp():
    """OPT runs its MLP on [batch * pos, d_model]: the capture reshapes it back."""
    _, trace = _trace("OPTForCausalLM")
    assert trace.reconstruction_error < 1e-4 and NEURON in trace.super_weights.neuron.tolist()


def test_bloom_embedding_norm_and_alibi():
    """BLOOM normalises the embedding before block 0 (the embed term is what block 0 reads)
    and adds the residual inside its attention module (the decomposition reads the output
    projection's own hook, and reconstructs)."""
    b, trace = _trace("BloomForCausalLM")
    assert trace.ledger.contribution.iloc[0] == pytest.approx(float(trace.ledger.resid.iloc[0]))
    assert decompose_attention(b.model, b.tokens, sinks=[0]).reconstruction_error < 1e-4


def test_embedding_scale_after_the_embed_hook():
    """XGLM scales the embedding after ``hook_embed``: the embed term is read where block 0
    reads it, and a note says so."""
    _, trace = _trace("XGLMForCausalLM")
    embeds = trace.ledger[trace.ledger.component.isin(["embed", "pos_embed"])]
    assert embeds.contribution.sum() == pytest.approx(float(embeds.resid.iloc[-1]), rel=1e-5)
    assert any("embed term is read at blocks.0.hook_resid_pre" in n for n in trace.notes)


def test_decomposition_that_does_not_reconstruct_raises():
    """An attention output that is not pattern @ v @ W_O + b_O is refused, never returned."""
    b = build("LlamaForCausalLM")
    o_proj = b.model.blocks[1].attn.o.original_component
    handle = o_proj.register_forward_hook(lambda module, args, out: out + 1.0)
    try:
        with pytest.raises(MassiveLensError, match="misses the attention output of layer 1"):
            decompose_attention(b.model, b.tokens, sinks=[0])
    finally:
        handle.remove()
    assert decompose_attention(b.model, b.tokens, sinks=[0]).reconstruction_error < 1e-4


def test_mixture_of_experts_ledger_without_neurons():
    """A mixture of experts not stored as transformers' experts module (JetMoE; the others have
    (expert, neuron) rows, tests/test_moe.py): its ledger term is exact; no neuron rows, and a
    note says why."""
    _, trace = _trace("JetMoeForCausalLM")
    assert trace.reconstruction_error < 1e-4
    assert ((trace.births.component == "mlp") & (trace.births.layer == PLANT_LAYER)).any()
    assert trace.neurons.empty and any("not dense MLPs" in n for n in trace.notes)


def test_state_space_block_is_a_clear_error():
    b = build("MambaForCausalLM")
    with pytest.raises(MassiveLensError, match="MambaForCausalLM.*block 0"):
        trace_origin(b.model, b.tokens, dim=DIM, pos=0)
    assert torch.isfinite(b.model(b.tokens)).all()


@pytest.mark.parametrize(("arch", "live"), [("LlamaForCausalLM", True), ("OPTForCausalLM", False),
                                            ("GPTJForCausalLM", False), ("Gemma2ForCausalLM", True)])
def test_pattern_edits_apply_probe(arch, live):
    """Some bridges fire hook_pattern after the HF module used it: reading is exact, editing is
    not. The probe says which (for the interventions that edit the pattern); Gemma's zero
    padding embedding must not hide a live edit."""
    from massive_lens.interventions.access import pattern_edits_apply

    b = build(arch)
    with untouched(b.model):
        assert pattern_edits_apply(b.model, 1) is live
