"""The architecture conformance matrix (used by ``test_matrix.py``, which also writes
``docs/architectures.md``): every decoder-only architecture the installed TransformerLens
bridge supports, as a tiny random model with a planted massive activation, through every
analysis.

The architectures are enumerated, not listed by hand: TransformerLens's
``SUPPORTED_ARCHITECTURES`` that transformers registers as causal LMs (the multimodal
``...ForConditionalGeneration`` wrappers are left out: their text decoders are covered).
Each tiny model is built offline from its Hugging Face config class (``SHAPE``), wrapped in a
bridge, and planted: BOS's embedding becomes a one-hot on ``TRIGGER_DIM`` and

- a dense MLP in block ``PLANT_LAYER``: neuron ``NEURON`` is wired to read ``TRIGGER_DIM`` and
  write ``DIM``, its weight solved so that the residual after that block holds ``VALUE``;
- a mixture of experts stored as transformers' experts module: the router sends BOS to expert
  ``EXPERT``, whose neuron ``NEURON`` is wired the same way (no other expert writes ``DIM``);
- another MLP, or where the residual does not keep that value: a forward hook on the Hugging
  Face MLP module adds the value at position 0 (a known component writing a known value; no
  neurons to name);
- no MLP at all (state-space and recurrent blocks): BOS's embedding carries the value.

A clean copy of the Hugging Face model (eager attention, never wrapped, the planted weights
loaded) is the independent reference for hidden states, attention weights and the loss.

The vision transformers among the bridge's architectures (``matrix_vit.py``) run through the
same checks on images, the ``[CLS]`` token in BOS's place; they get their own table.

A cell is ``✓`` when the analysis ran and its numbers were checked exact; else the reason:
the :class:`MassiveLensError` the analysis raised (it must name the model, and so the
architecture), or the warning the result carries about itself. Any other exception, or a
wrong number, fails the test.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from helpers import untouched
from matrix_circuit import ANALYSES as CIRCUIT_ANALYSES
from matrix_offswitch import ANALYSES as OFFSWITCH_ANALYSES
from matrix_sinks import ANALYSES as SINK_ANALYSES
from matrix_vit import cls_trigger, images, is_vision, tiny_vit
from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from massive_lens import MassiveLensError, decompose_attention, find_massive, perplexity, sink_attention, trace_origin
from massive_lens.core.criterion import Criterion, massive_mask
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import (
    ablate_massive,
    bias_surgery,
    calibrate,
    fix_sink_term,
    patch_sink_from,
    remove_sink_attention,
)
from massive_lens.models import byte_tokenizer, wrap_hf_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
LAYERS, PLANT_LAYER, NEURON, DIM, TRIGGER_DIM, VALUE = 3, 1, 5, 7, 3, 5000.0
EXPERT = 2  # the routed expert whose neuron NEURON is planted, in a mixture of experts
TEXT = "Hi there. Bye now."
CALIB = "The river runs to the sea. Birds sing at dawn, and the town wakes."
CRITERION = Criterion()
TOL = 1e-4  # relative, float32

# Shape of every tiny model, in the standard Hugging Face config names (each config maps them
# to its own through ``attribute_map``); only fields the config class has are passed.
SHAPE: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, max_position_embeddings=256, ffn_dim=128, n_inner=128,
    rotary_dim=8,  # GPT-J / CodeGen: the rotary part of the 16-wide heads
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    top_k_experts=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    shared_intermediate_size=64, n_shared_experts=1, n_group=1, topk_group=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # the linear-attention and state-space layers of hybrids
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_dt_rank=8, mamba_chunk_size=16,
    hidden_size_per_layer_input=16,
)
# Config fields whose defaults encode the default depth (a fact of the Hugging Face config
# classes, not of massive_lens): rebuilt for LAYERS layers.
DEPTH_FIELDS: dict[str, Callable[[int], Any]] = {"attention_types": lambda layers: [[["global"], layers]]}


def decoder_architectures() -> list[str]:
    """TransformerLens's supported architectures that transformers builds as causal LMs."""
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return sorted(a for a in SUPPORTED_ARCHITECTURES
                  if a in causal and "ConditionalGeneration" not in a and hasattr(transformers, a))


class Unbuildable(Exception):
    """transformers (or the bridge) cannot build this architecture's tiny model offline."""


def tiny_hf(arch: str, layers: int = LAYERS, eager: bool = False) -> Any:
    """A seeded random Hugging Face model of ``arch`` with the shape of ``SHAPE`` (a vision
    transformer: of ``matrix_vit.VISION_SHAPE``)."""
    if is_vision(arch):
        return tiny_vit(arch, layers, eager)
    tok = byte_tokenizer()
    cls = getattr(transformers, arch)
    known = cls.config_class().to_dict()
    rename = getattr(cls.config_class, "attribute_map", {}) or {}
    fields = {k: v for k, v in SHAPE.items()
              if rename.get(k, k) in known and not isinstance(known[rename.get(k, k)], (list, dict))}
    fields["num_hidden_layers"] = layers
    if "vocab_size_per_layer_input" in known:
        fields["vocab_size_per_layer_input"] = len(tok)
    if known.get("head_dim") is not None and "qk_rope_head_dim" not in known:
        fields["head_dim"] = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    if "kv_lora_rank" in known:  # latent attention has no grouped keys and values
        fields["num_key_value_heads"] = SHAPE["num_attention_heads"]
    fields.update({name: value(layers) for name, value in DEPTH_FIELDS.items() if name in known})
    pad = known.get("pad_token_id")
    fields.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=pad if isinstance(pad, int) and pad < len(tok) else tok.pad_token_id)
    config = cls.config_class(**fields)
    if eager:  # only the eager implementation returns attention weights
        config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).eval()


@dataclass
class Built:
    arch: str
    model: Any  # the planted bridge
    ref: Any  # a clean, never wrapped Hugging Face copy with the same (planted) weights
    planted: str  # "neuron", "expert", "module", "embed" or "none"
    tokens: torch.Tensor  # [1, pos], BOS first (a vision transformer: pixel_values of one image)
    calib_tokens: torch.Tensor  # [2, pos], BOS first (pixel_values of two images)


@functools.cache
def build(arch: str) -> Built:
    """The planted tiny model of ``arch`` (built once per test session)."""
    tok = byte_tokenizer()
    bos = [tok.bos_token_id]
    vision = is_vision(arch)
    if vision:
        tokens, calib_tokens = images(1), images(2, seed=2)
    else:
        tokens = torch.tensor([bos + tok(TEXT, add_special_tokens=False)["input_ids"]])
        calib = tok(CALIB, add_special_tokens=False)["input_ids"]
        calib_tokens = torch.tensor([bos + calib[:23], bos + calib[23:46]])
    errors = []
    for layers in (LAYERS, 4):  # a hybrid whose first three layers are all linear attention needs a 4th
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf = tiny_hf(arch, layers)
                model = wrap_hf_model(hf, None if vision else tok, name=f"tiny-{arch}")
                model(tokens if vision else torch.tensor([[tok.bos_token_id, 72, 105]]))
            break
        except Exception as exc:  # noqa: BLE001 - any failure to build is a reason to skip
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    else:
        raise Unbuildable(errors[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tiny_hf(arch, model.cfg.n_layers, eager=True)
        try:
            planted = plant(model, ref, tokens)
        except Exception:  # noqa: BLE001 - e.g. a residual hook that never fires (a linear-attention block)
            planted = "none"
        state = {k.replace("._original_component", ""): v for k, v in model.original_model.state_dict().items()}
        missing = ref.load_state_dict(state, strict=False).missing_keys
    if missing:
        raise Unbuildable(f"the bridge's weights do not map back onto the Hugging Face model: {missing[:3]}")
    return Built(arch, model, ref, planted, tokens, calib_tokens)


# --------------------------------------------------------------------------- planting


def _dense_weights(model: Any, layer: int) -> dict[str, torch.Tensor] | None:
    """``W_in``/``W_gate``/``W_out``/``b_in`` of a dense MLP, when they are views of the live
    Hugging Face weights (an edit must reach the model)."""
    mlp = getattr(model.blocks[layer], "mlp", None)
    try:
        found = {k: getattr(mlp, k, None) for k in ("W_in", "W_gate", "W_out", "b_in")}
    except Exception:  # noqa: BLE001 - a bridge that cannot expose the weights
        return None
    w_in, w_out = found["W_in"], found["W_out"]
    if not isinstance(w_in, torch.Tensor) or not isinstance(w_out, torch.Tensor):
        return None
    if w_in.shape[-1] != w_out.shape[0] or (found["W_gate"] is not None and found["W_gate"].shape != w_in.shape):
        return None
    live = {p.untyped_storage().data_ptr() for p in model.original_model.parameters()}
    if any(w is not None and w.untyped_storage().data_ptr() not in live for w in found.values()):
        return None
    return {k: v for k, v in found.items() if v is not None}


def _resid(model: Any, tokens: torch.Tensor, layer: int) -> float:
    """``resid_post[0, 0, DIM]`` of ``layer``."""
    seen = {}

    def grab(x, hook):
        seen["x"] = float(x[0, 0, DIM])

    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_post", grab)])
    return seen["x"]


def _solve(set_value: Callable[[float], None], measure: Callable[[], float]) -> None:
    """Set the one free weight so that ``measure()`` (affine in it) reads ``VALUE``."""
    set_value(0.0)
    r0 = measure()
    set_value(1.0)
    slope = measure() - r0
    set_value((VALUE - r0) / slope)


def _add_at_first(module: Any, args: Any, out: Any) -> Any:
    """Forward hook: add ``VALUE`` to ``DIM`` at position 0 of the module's output."""
    hidden = out[0] if isinstance(out, tuple) else out
    delta = torch.zeros_like(hidden)
    delta[..., 0, DIM] = VALUE
    return (hidden + delta, *out[1:]) if isinstance(out, tuple) else hidden + delta


def plant(model: Any, ref: Any, tokens: torch.Tensor) -> str:
    """Plant ``VALUE`` in ``DIM`` at BOS (a ViT's ``[CLS]``; see the module docstring); returns how."""
    if not hasattr(model, "blocks"):
        return "none"  # the bridge exposes no blocks (e.g. HRM's nested H/L stacks)
    if is_vision(getattr(model.cfg, "architecture", "") or ""):
        cls_trigger(model, TRIGGER_DIM)
    else:
        bos = model.tokenizer.bos_token_id
        with torch.no_grad():
            model.W_E[bos].zero_()
            model.W_E[bos, TRIGGER_DIM] = 1.0
    block = model.blocks[PLANT_LAYER]
    mlp = getattr(block, "mlp", None)
    weights = _dense_weights(model, PLANT_LAYER)
    if weights is None and mlp is not None and _plant_expert(model, tokens):
        return "expert"
    if weights is None and mlp is not None:  # hook the module whose output the residual adds
        writer = block.ln2_post if f"blocks.{PLANT_LAYER}.ln2_post.hook_out" in model.hook_dict else mlp
        inner = getattr(writer, "original_component", None) or writer
        inner.register_forward_hook(_add_at_first)
        name = next(n for n, m in model.original_model.named_modules() if m is inner)
        ref.get_submodule(name.replace("._original_component", "")).register_forward_hook(_add_at_first)
        return "module"
    if weights is None:
        def set_embed(a: float) -> None:
            with torch.no_grad():
                model.W_E[bos, DIM] = a

        _solve(set_embed, functools.partial(_resid, model, tokens, 0))
        return _kept(model, tokens, "embed")
    with torch.no_grad():
        for name in ("W_in", "W_gate"):
            if name in weights:
                weights[name][:, NEURON] = 0.0
                weights[name][TRIGGER_DIM, NEURON] = 3.0
        if "b_in" in weights:
            weights["b_in"][NEURON] = 0.0
        weights["W_out"][NEURON] = 0.0
    with torch.no_grad():
        weights["W_out"][:, DIM] = 0.0
    _solve_write(model, tokens, weights["W_out"][NEURON])
    return _kept(model, tokens, "neuron")


def _solve_write(model: Any, tokens: torch.Tensor, row: torch.Tensor) -> None:
    """Solve the planted neuron's output weight on ``DIM`` (``row[DIM]``) for ``VALUE``; under
    a post-MLP norm, which rescales the MLP output, the norm's weight on ``DIM`` instead."""
    measure = functools.partial(_resid, model, tokens, PLANT_LAYER)
    target = row
    if f"blocks.{PLANT_LAYER}.ln2_post.hook_out" in model.hook_dict:
        norm = model.blocks[PLANT_LAYER].ln2_post
        target = getattr(norm, "_original_component", norm).weight
        with torch.no_grad():
            row[DIM] = 1.0

    def set_value(a: float) -> None:
        with torch.no_grad():
            target[DIM] = a

    _solve(set_value, measure)


def _router(root: Any, experts: Any, d_model: int) -> torch.Tensor | None:
    """The router's ``[expert, d_model]`` weight: the one such matrix outside the experts."""
    inside = {id(p) for p in experts.module.parameters()}
    found = [p for p in root.parameters()
             if id(p) not in inside and tuple(p.shape) == (experts.n_experts, d_model)]
    return found[0] if len(found) == 1 else None


def _plant_expert(model: Any, tokens: torch.Tensor) -> bool:
    """Route BOS to expert ``EXPERT`` and wire its neuron ``NEURON`` to read ``TRIGGER_DIM`` and
    write ``DIM`` (solved for ``VALUE``), in a mixture of experts stored as transformers'
    experts module; False where that is not the case or the residual does not keep the value
    (the caller then hooks the block)."""
    from massive_lens.origin.experts import find_experts

    mlp = model.blocks[PLANT_LAYER].mlp
    experts = find_experts(model, mlp)
    if experts is None or experts.columns is None or experts.n_experts <= EXPERT or experts.width <= NEURON:
        return False
    router = _router(getattr(mlp, "original_component", mlp), experts, model.cfg.d_model)
    if router is None:
        return False
    ex = experts.module
    up = ex.gate_up_proj if ex.has_gate else ex.up_proj
    down = ex.down_proj
    with torch.no_grad():
        write = down[EXPERT][NEURON] if ex.is_transposed else down[EXPERT][:, NEURON]
        (down[..., DIM] if ex.is_transposed else down[:, DIM]).zero_()  # no other expert writes DIM
        if experts.shared_down is not None:
            experts.shared_down.weight[DIM] = 0.0
    for sign in (1.0, -1.0):  # the trigger dim's sign where the router reads it
        with torch.no_grad():
            router[:, TRIGGER_DIM] = 0.0
            router[EXPERT, TRIGGER_DIM] = 50.0 * sign
            for j in experts.columns[NEURON].tolist():
                row = up[EXPERT][:, j] if ex.is_transposed else up[EXPERT][j]
                row.zero_()
                row[TRIGGER_DIM] = 3.0 * sign
                if ex.has_bias:
                    (ex.gate_up_proj_bias if ex.has_gate else ex.up_proj_bias)[EXPERT, j] = 0.0
            write.zero_()
        try:
            _solve_write(model, tokens, write)
            if _kept(model, tokens, "expert") == "expert":
                return True
        except ZeroDivisionError:  # the router did not send BOS to the expert
            pass
    with torch.no_grad():  # not planted: hook the block instead
        write.zero_()
    return False


def _kept(model: Any, tokens: torch.Tensor, how: str) -> str:
    """``how``, or ``"none"`` when the residual stream does not keep the planted value (it is
    normalised after every block in a post-LN model such as BERT, or in RWKV's first block)."""
    return how if math.isclose(_resid(model, tokens, PLANT_LAYER), VALUE, rel_tol=0.01) else "none"


# --------------------------------------------------------------------------- the checks
#
# Each returns None (✓: it ran and its numbers are exact) or the warning the result gave about
# itself; a MassiveLensError passes through; a wrong number is an AssertionError.


def check_find_massive(b: Built) -> str | None:
    found = find_massive(b.model, b.tokens, criterion=CRITERION).to_frame()
    with torch.no_grad():
        hidden = b.ref(b.tokens, output_hidden_states=True).hidden_states
    n = b.model.cfg.n_layers
    expected = {}  # hidden_states[l + 1] is the residual after block l, except the last (final norm)
    for layer in range(n - 1):
        h = hidden[layer + 1].float()
        for _, pos, dim in massive_mask(h, CRITERION).nonzero().tolist():
            expected[layer, pos, dim] = float(h[0, pos, dim])
    got = {(int(r.layer), int(r.pos), int(r.dim)): float(r.value) for r in found.itertuples() if r.layer < n - 1}
    assert set(got) == set(expected), f"massive entries differ from transformers: {sorted(got)} vs {sorted(expected)}"
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=TOL), (key, got[key], value)
    assert (PLANT_LAYER, 0, DIM) in got or b.planted == "none", "the planted activation was not found"
    return None


@functools.cache
def _trace(arch: str) -> Any:
    b = build(arch)
    with untouched(b.model):
        return trace_origin(b.model, b.tokens, dim=DIM, pos=0)


def _warning(trace: Any, *words: str) -> str | None:
    return next((n for n in trace.notes if n.startswith("warning") and all(w in n for w in words)), None)


def check_ledger(b: Built) -> str | None:
    trace = _trace(b.arch)
    if trace.reconstruction_error >= TOL:  # allowed only when the trace says so itself
        note = _warning(trace, "ledger")
        assert note, f"the ledger misses the residual by {trace.reconstruction_error:.1e}, silently"
        return note
    rows = trace.ledger
    at_plant = rows[rows.layer == PLANT_LAYER].resid.iloc[-1]
    assert math.isclose(float(at_plant), _resid(b.model, b.tokens, PLANT_LAYER), rel_tol=TOL)
    births = trace.births
    if b.planted == "none":
        return None
    component, layer = ("embed", 0) if b.planted == "embed" else ("mlp", PLANT_LAYER)
    assert ((births.component == component) & (births.layer == layer)).any(), births
    return None


def check_neurons(b: Built) -> str | None:
    trace = _trace(b.arch)
    if b.planted == "embed":
        return "n/a: no MLP to plant a neuron in"
    if b.planted == "none":
        return "n/a: the residual stream does not keep a planted value (it is normalised)"
    rows = trace.neurons[trace.neurons.layer == PLANT_LAYER]
    if rows.empty:
        note = next((n for n in trace.notes if f"{PLANT_LAYER}" in n and ("neuron" in n or "dense" in n)), None)
        assert note, f"no neuron rows for the planted MLP, and no note says why: {trace.notes}"
        return note
    assert b.planted in ("neuron", "expert"), "neuron rows for an MLP whose value a hook planted"
    expert = EXPERT if b.planted == "expert" else -1
    unit = rows[(rows.neuron == NEURON) & (rows.expert == expert)]
    assert not unit.empty and bool(unit.named.iloc[0]), rows
    events = trace.events
    total = float(events[(events.layer == PLANT_LAYER) & (events.component == "mlp")].contribution.iloc[0])
    assert math.isclose(float(unit.contribution.iloc[0]), total, rel_tol=0.05)
    supers = trace.super_weights
    weight = supers[(supers.neuron == NEURON) & (supers.expert == expert)]
    assert len(weight) == 1, supers
    if b.planted == "expert":
        _check_expert_weight(b, weight.iloc[0])
    why = trace.why
    if why.empty:
        note = next((n for n in trace.notes if "why-this-token" in n), None)
        assert note, "no why-this-token rows, and no note says why"
        return note
    if b.planted == "neuron":  # the same block's attention is upstream only in a serial block
        same_block_attn = ((why.source == "attn") & (why.source_layer == PLANT_LAYER)).any()
        assert same_block_attn == (f"blocks.{PLANT_LAYER}.hook_resid_mid" in b.model.hook_dict)
    sums = why.groupby(["neuron", "input"]).agg(total=("contribution", "sum"), value=("value", "first"))
    for (neuron, inp), r in sums.iterrows():
        assert math.isclose(r.total, r.value, rel_tol=1e-3, abs_tol=1e-4), (neuron, inp, r.total, r.value)
    return None


def _check_expert_weight(b: Built, row: Any) -> None:
    """The super weight of the planted expert neuron is named as the checkpoint names it, and
    that entry of the model's parameter holds the value reported."""
    from massive_lens.origin.experts import find_experts

    experts = find_experts(b.model, b.model.blocks[PLANT_LAYER].mlp)
    fused = experts.module.is_transposed
    name = f"{experts.path}.down_proj[{EXPERT}]" if fused else f"{experts.path}.{EXPERT}.down_proj.weight"
    assert row.hf_param == name and name.startswith(f"model.layers.{PLANT_LAYER}."), (row.hf_param, name)
    assert (row.hf_row, row.hf_col) == ((NEURON, DIM) if fused else (DIM, NEURON))
    stored = experts.module.down_proj[EXPERT]
    assert float(stored[row.hf_row, row.hf_col]) == row.value


def check_decompose(b: Built) -> str | None:
    result = decompose_attention(b.model, b.tokens, sinks=[0])
    assert result.reconstruction_error < TOL, result.reconstruction_error
    return None


def check_sink_attention(b: Built) -> str | None:
    result = sink_attention(b.model, b.tokens, sinks=[0])
    with torch.no_grad():
        attentions = b.ref(b.tokens, output_attentions=True).attentions
    frame = result.to_frame()
    # one row set per layer that attends (a hybrid's linear-attention or state-space layers have none;
    # transformers then gives the attending layers' patterns only, or None for the others)
    view = ModelView(b.model)
    attending = [layer for layer in range(view.n_layers) if view.has_hook(layer, "attn.hook_pattern")]
    if len(attentions) != view.n_layers:
        assert len(attentions) == len(attending)
        attentions = dict(zip(attending, attentions, strict=True))
    else:
        attentions = dict(enumerate(attentions))
    assert sorted(frame.layer.unique()) == [layer for layer in attending if attentions[layer] is not None]
    for layer, pattern in attentions.items():
        if pattern is None:
            continue
        mass = pattern[0, :, 1:, 0].float().mean(-1)  # non-sink queries' attention to position 0
        got = torch.tensor(frame[frame.layer == layer].sink_mass.to_numpy(), dtype=torch.float32)
        err = float((got - mass).abs().max())
        assert err < TOL, f"sink mass of layer {layer} differs from transformers by {err:.1e}"
    return None


@functools.cache
def _calibration(arch: str) -> Any:
    """The calibration the interventions use, outlier dimensions included: in some architectures
    the plant reaches most tokens (a post-MLP norm's weight, solved for ``VALUE``, scales ``DIM``
    at every token; the planted neuron fires a little wherever ``TRIGGER_DIM`` is positive),
    which makes ``DIM`` an outlier dimension that the default calibration leaves out."""
    b = build(arch)
    return calibrate(b.model, b.calib_tokens, outliers="include", progress=False)


def _intervention(b: Built, make: Callable[[Any, Any], Any]) -> str | None:
    with untouched(b.model):
        calib = _calibration(b.arch)
        iv = make(b.model, calib)
        with torch.no_grad():
            base = b.model(b.tokens)
            with iv:
                edited = b.model(b.tokens)
            after = b.model(b.tokens)
    assert torch.isfinite(edited).all(), "non-finite logits under the intervention"
    assert torch.equal(base, after), "the model changed after the intervention"
    return None


INTERVENTIONS: dict[str, Callable[[Any, Any], Any]] = {
    "ablate_massive": lambda m, c: ablate_massive(m, "zero", calibration=c),
    "ablate (mean)": lambda m, c: ablate_massive(m, "mean", calibration=c),
    "control": lambda m, c: ablate_massive(m, "zero", calibration=c, control=True),
    "fix_sink_term": lambda m, c: fix_sink_term(m, "mean", calibration=c),
    "remove_sink_attention": lambda m, c: remove_sink_attention(m, calibration=c),
    "bias_surgery": lambda m, c: bias_surgery(m, calibration=c),
    "patch_sink_from": lambda m, c: patch_sink_from(m, "Bye now."),
}


def check_perplexity(b: Built) -> str | None:
    tokens = torch.cat([b.tokens, b.tokens])
    base = perplexity(b.model, tokens, progress=False)
    noop = perplexity(b.model, tokens, hooks=[("hook_embed", lambda x, hook: x)], progress=False)
    assert base.perplexity == noop.perplexity
    with torch.no_grad():
        loss = float(b.ref(tokens, labels=tokens).loss)
    assert math.isclose(base.loss, loss, rel_tol=1e-4), (base.loss, loss)
    return None


ANALYSES: dict[str, Callable[[Built], str | None]] = {
    "find_massive": check_find_massive,
    "trace_origin": check_ledger,
    "neurons": check_neurons,
    "decompose_attention": check_decompose,
    "sink_attention": check_sink_attention,
    **{name: functools.partial(_intervention, make=make) for name, make in INTERVENTIONS.items()},
    "perplexity": check_perplexity,
    **SINK_ANALYSES,
    **CIRCUIT_ANALYSES,
    **OFFSWITCH_ANALYSES,
}


def cell(arch: str, analysis: str) -> str:
    """``✓``, or the reason why not (see the module docstring); raises on a wrong number or an
    unexpected exception. ``not built: ...`` when the tiny model cannot be built."""
    try:
        b = build(arch)
    except Unbuildable as exc:
        return f"not built: {exc}"
    try:
        with warnings.catch_warnings(), untouched(b.model):
            warnings.simplefilter("ignore")
            note = ANALYSES[analysis](b)
    except MassiveLensError as exc:
        message = str(exc)
        assert arch in message, f"the error does not name the architecture: {message}"
        return shorten(message)
    return "✓" if note is None else shorten(note)


def shorten(message: str) -> str:
    """The first line of a message, the model's name dropped, fit for a table's footnote."""
    text = re.sub(r"tiny-\w+:?\s*(\(\w+\):\s*)?", "", message.splitlines()[0]).strip()  # and "(Arch): "
    text = text.split("; per-block hooks")[0].split(". Supported architecture")[0].replace("|", "/")
    return text if len(text) <= 300 else text[:300].rsplit(" ", 1)[0] + " …"


# --------------------------------------------------------------------------- docs/architectures.md

_HEAD = """# Supported architectures

Every decoder-only architecture that the installed TransformerLens bridge supports, run
through every analysis. This page is generated by the test suite (`tests/test_matrix.py`,
which fails when the page no longer matches what the library does); regenerate it with

```bash
MASSIVE_LENS_WRITE_MATRIX=1 pytest tests/test_matrix.py
```

The architectures are TransformerLens's own list (`SUPPORTED_ARCHITECTURES`) of those
that transformers builds as causal LMs ({versions}); none is chosen by hand. Each is a
tiny model built offline from its Hugging Face config class ({layers} layers, width {width},
a byte vocabulary, random weights) with a planted massive activation: a neuron of block
{plant} writes {value:,.0f} into one dimension at the first token (in a mixture of experts,
a neuron of expert {expert}, to which the router sends that token; where the experts are not
transformers' experts module, a hook on the block's output; where no block has an MLP, the
embedding).

**✓**: the analysis ran and its numbers were checked exact against an independent
computation: `find_massive` against plain transformers hidden states (every massive entry,
every value); `trace_origin`'s ledger reconstructs the residual and names the planted birth;
`neurons`: the planted neuron, its super weight, and a why-this-token split that sums to its
pre-activation (in a parallel block, without that block's attention); `decompose_attention`
reconstructs the attention output; `sink_attention` against transformers' attention weights;
each intervention builds, runs, and leaves the model bit-identical (calibrated with
`outliers="include"`: where a post-MLP norm or the planted neuron carries the plant to most
tokens, its dimension is an outlier dimension, which `calibrate` leaves out by default); `perplexity` is unchanged
under a no-op hook and equals transformers' loss; `sink_census` (at a threshold lowered to 0.1, so that random
weights have sinks to list) lists exactly the positions that transformers' attention weights make sinks, in as
many layers, with the same peak mass; `sink_kv` and `dormant_heads`: the attention on the sink per head against
transformers' attention weights, and where the attention has its own `v_proj` / `o_proj`, the sink's value norm
(and the others' median) against `v_proj`'s output and each head's output norm against `o_proj`'s input times
that head's columns; `null_mass` (the attention to a learned sink logit, issue 51) against transformers' eager
attention with sinks on the eager and the LSE path, and `gate_census` against the sigmoid of the gate half of
`q_proj`'s output. **✗ [n]**: a named limitation, the error
(a `MassiveLensError`) or the warning the analysis itself gives, quoted below.
**– [n]**: not applicable to this tiny model.
"""

_VISION = """## Vision transformers

The architectures of the same list whose Hugging Face class reads images (`pixel_values`):
ViT and DeiT, with and without a classifier head. Each tiny model reads 32x32 images in 8x8
patches; the planted neuron fires at the `[CLS]` token, and the inputs are random images.
The analyses take `pixel_values` where they take text (see [vision.md](vision.md)); what
needs text (a tokenizer, a corpus) says so.
"""


def _marker(value: str) -> str:
    return "–" if value.startswith("n/a") else "✗"


def render(results: dict[tuple[str, str], str], versions: str) -> str:
    """The markdown page of a complete set of cells."""
    archs = sorted({a for a, _ in results})
    built = [a for a in archs if not results[a, "find_massive"].startswith("not built")]
    decoders, vision = [a for a in built if not is_vision(a)], [a for a in built if is_vision(a)]
    notes: dict[str, int] = {}
    lines = [_HEAD.format(versions=versions, layers=LAYERS, width=SHAPE["hidden_size"], plant=PLANT_LAYER,
                          value=VALUE, expert=EXPERT)]
    n_decoders = sum(not is_vision(a) for a in archs)
    counts = ", ".join(f"`{a}` {sum(results[x, a] == '✓' for x in decoders)}" for a in ANALYSES)
    lines += [f"{n_decoders} architectures, {len(decoders)} built. ✓ per analysis: {counts}.", ""]
    lines += _table(decoders, results, notes)
    if vision:
        lines += ["", _VISION, *_table(vision, results, notes)]
    lines += ["", "## Why not", ""]
    lines += [f"{n}. {text}" for text, n in notes.items()]
    lines += ["", "## Not built", "",
              "transformers (or the bridge) cannot build these tiny models offline; their tests are skipped.", ""]
    lines += [f"- `{a}`: {results[a, 'find_massive'].removeprefix('not built: ')}" for a in archs if a not in built]
    return "\n".join(lines) + "\n"


def _table(archs: list[str], results: dict[tuple[str, str], str], notes: dict[str, int]) -> list[str]:
    """The rows of ``archs``; a cell that is not ✓ points to its footnote in ``notes`` (added)."""
    lines = ["| architecture | " + " | ".join(f"`{a}`" for a in ANALYSES) + " |",
             "|---" * (len(ANALYSES) + 1) + "|"]
    for arch in archs:
        cells = []
        for analysis in ANALYSES:
            value = results[arch, analysis]
            if value != "✓":
                notes.setdefault(value, len(notes) + 1)
            cells.append("✓" if value == "✓" else f"{_marker(value)} [{notes[value]}]")
        lines.append(f"| `{arch}` | " + " | ".join(cells) + " |")
    return lines


def parse(text: str) -> dict[tuple[str, str], str]:
    """The cells of a page written by :func:`render`."""
    notes = dict(re.findall(r"^(\d+)\. (.*)$", text, flags=re.M))
    cells: dict[tuple[str, str], str] = {}
    for row in re.findall(r"^\| `(\w+)` \| (.*) \|$", text, flags=re.M):
        arch, rest = row
        for analysis, raw in zip(ANALYSES, rest.split(" | "), strict=True):
            if raw == "✓":
                cells[arch, analysis] = "✓"
                continue
            _, number = raw.split(" ")
            cells[arch, analysis] = notes[number.strip("[]")]
    for arch, reason in re.findall(r"^- `(\w+)`: (.*)$", text, flags=re.M):
        for analysis in ANALYSES:
            cells[arch, analysis] = f"not built: {reason}"
    return cells


def same(a: str, b: str) -> bool:
    """Two cells agree (the numbers in an error message are allowed to differ in rounding)."""
    def mask(s: str) -> str:
        return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", s)

    return mask(a) == mask(b)


def versions() -> str:
    from importlib.metadata import version

    return f"TransformerLens {version('transformer-lens')}, transformers {version('transformers')}"
