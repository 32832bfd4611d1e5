"""trace_origin: exact ledgers, planted birth/erasure/rebirth stories on every tiny family,
relations on the real default model, agreement with plain transformers hooks, and an
untouched model after every call, failing ones included."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import BIRTH, DIM, ERASE, REBIRTH, plant_story, untouched

import massive_lens.origin.capture as capture_module
import massive_lens.origin.targets as targets_module
import massive_lens.origin.verify as neu
from massive_lens import MassiveLensError, tiny_model
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView
from massive_lens.models import FAMILIES
from massive_lens.origin import trace_origin
from massive_lens.origin.neurons import EntryRanks

TEXT = "Hi there. Bye."
REAL_TEXT = "The capital of France is Paris. It is a large city with many museums."


def _ledger_ok(trace) -> None:
    for _, rows in trace.ledger.groupby(["pos", "dim"]):
        total = rows.contribution.astype("float64").cumsum()
        assert ((total - rows.resid).abs() / rows.resid.abs().max()).max() < 1e-4
    assert trace.reconstruction_error < 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def story_family(request) -> str:
    """The family of the planted story (module scope: one planted model and one trace per family)."""
    return request.param


@pytest.fixture(scope="module")
def planted_story(story_family):
    """A tiny model of ``story_family`` with the birth -> erasure -> rebirth story planted."""
    model = tiny_model(story_family)
    plant_story(model)
    return model


@pytest.fixture(scope="module")
def story_trace(planted_story):
    """The verified trace of the planted story, shared by the module (checked to leave no trace)."""
    with untouched(planted_story):
        return trace_origin(planted_story, TEXT, dim=DIM, pos=0, verify=True, prepend_bos=True)


# --------------------------------------------------------------------------- tiny families


def test_ledger_reconstructs_residual_on_random_models(tiny):
    with untouched(tiny):
        trace = trace_origin(tiny, TEXT, dim=7, pos=2)
    _ledger_ok(trace)
    assert not trace.targets.massive.any()  # traced although below the criterion
    assert list(trace.ledger.columns[:7]) == ["pos", "dim", "token", "layer", "component", "contribution", "resid"]
    assert set(trace.ledger.component) >= {"embed", "attn", "mlp"}


def test_planted_story_names_layers_and_kinds(story_trace):
    _ledger_ok(story_trace)
    events = story_trace.events[story_trace.events.component == "mlp"]
    assert [(r.layer, r.kind) for r in events.itertuples()] == [
        (BIRTH[0], "birth"), (ERASE[0], "erasure"), (REBIRTH[0], "rebirth")]
    assert len(story_trace.events) == 3  # nothing else writes DIM at BOS
    assert story_trace.targets.massive.all()
    assert story_trace.births.layer.tolist() == [BIRTH[0], REBIRTH[0]]
    assert story_trace.erasures.layer.tolist() == [ERASE[0]]
    assert story_trace.events.contribution.tolist() == pytest.approx([1000.0, -880.0, 2000.0], rel=1e-3)


def test_planted_story_names_neurons_and_super_weights(story_trace, planted_story):
    named = story_trace.neurons[story_trace.neurons.named]
    assert [(r.layer, r.neuron) for r in named.itertuples()] == [BIRTH, ERASE, REBIRTH]
    assert named.share.tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-3)
    # a gated MLP's up projection is reported per neuron; an ungated one (gpt2) has none
    assert named.up.notna().all() if planted_story.cfg.gated_mlp else named.up.isna().all()
    sw = story_trace.super_weights
    assert [(r.layer, r.neuron, r.dim) for r in sw.itertuples()] == [(*BIRTH, DIM), (*REBIRTH, DIM)]
    assert (sw["rank"] == 1).all() and (sw.zscore.abs() > 10).all()
    params = {n.replace("._original_component", ""): p for n, p in planted_story.original_model.named_parameters()}
    for r in sw.itertuples():  # the Hugging Face name points at the very weight
        hf = params[r.hf_param]
        assert float(hf[r.hf_row, r.hf_col].detach()) == pytest.approx(r.value)


def test_planted_why_this_token(story_trace):
    why = story_trace.why
    for _, group in why.groupby(["layer", "neuron", "input"]):
        assert group.contribution.sum() == pytest.approx(group.value.iloc[0], rel=1e-3, abs=1e-3)
    birth = why[(why.layer == BIRTH[0]) & (why.neuron == BIRTH[1])]
    assert not birth.empty
    for _, group in birth.groupby("input"):
        assert group.loc[group.contribution.idxmax(), "source"] == "embed"  # fires because of the BOS embedding
    reborn = why[(why.layer == REBIRTH[0]) & (why.neuron == REBIRTH[1])]
    top = reborn.loc[reborn.contribution.abs().idxmax()]
    assert (top.source, top.source_layer) == ("mlp", BIRTH[0])  # reads what the birth wrote


def test_planted_verification_shows_the_drop(story_trace, story_family):
    v = story_trace.verification.set_index(["scope", "intervention"])
    assert set(v.index.get_level_values(0)) == {f"MLP {BIRTH[0]}", f"MLP {REBIRTH[0]}", "all births"}
    for scope in (f"MLP {BIRTH[0]}", f"MLP {REBIRTH[0]}"):
        for kind in ("zero_neurons", "zero_super_weights"):
            assert abs(v.loc[(scope, kind), "remaining"]) < 0.1
    # pre-norm: nothing comes back; post-norm renormalises the erasure neuron's small write
    limit = 0.5 if story_family == "gemma3" else 0.05
    assert abs(v.loc[("all births", "zero_neurons"), "remaining_last"]) < limit
    assert "zeroing the named birth neurons" in story_trace.summary()


def test_planted_story_is_found_without_dim_and_pos(planted_story):
    trace = trace_origin(planted_story, TEXT, prepend_bos=True)
    assert (0, DIM) in set(zip(trace.targets.pos, trace.targets.dim, strict=True))
    assert trace.targets.massive.all()


def test_summary_plot_html(story_trace, story_family):
    text = story_trace.summary()
    assert f"dim {DIM}" in text and f"born in MLP {BIRTH[0]} (neuron {BIRTH[1]}: 100%)" in text
    assert f"cut to 12% by MLP {ERASE[0]}" in text and f"rewritten by MLP {REBIRTH[0]}" in text
    assert ("post-norm" in text) == (story_family == "gemma3")
    ax = story_trace.plot()
    assert ax.get_xlabel().startswith("layer") and ax.get_title()
    assert "<pre>" in story_trace._repr_html_()
    assert story_trace.to_frame().equals(story_trace.ledger)


def test_bad_input():
    model = tiny_model("llama")
    with untouched(model):
        with pytest.raises(MassiveLensError, match="d_model=64"):
            trace_origin(model, TEXT, dim=64, pos=0)
        with pytest.raises(MassiveLensError, match="out of range"):
            trace_origin(model, TEXT, dim=0, pos=99)
        with pytest.raises(MassiveLensError, match="pass dim= and pos="):
            trace_origin(model, TEXT)
        with pytest.raises(MassiveLensError, match="top_neurons"):
            trace_origin(model, TEXT, dim=0, pos=0, top_neurons=0)
    assert trace_origin(model, TEXT, pos=-1).targets.pos.tolist() == [len(TEXT)]  # largest dim at the last token


def test_restored_after_failures(monkeypatch):
    model = tiny_model("qwen2")
    plant_story(model)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # inside zero_super_weights, with the weights zeroed
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    original = neu.resid_at
    monkeypatch.setattr(neu, "resid_at", failing)
    with untouched(model), pytest.raises(RuntimeError, match="injected"):
        trace_origin(model, TEXT, dim=DIM, pos=0, verify=True, prepend_bos=True)

    def bad_hook(mask):
        def hook(post, hook):
            raise RuntimeError("hook failed")

        return hook

    monkeypatch.setattr(neu, "resid_at", original)
    monkeypatch.setattr(neu, "_mask_hook", bad_hook)
    with untouched(model), pytest.raises(RuntimeError, match="hook failed"):
        trace_origin(model, TEXT, dim=DIM, pos=0, verify=True, prepend_bos=True)


@pytest.mark.parametrize("scoped", [False, True])
def test_an_activation_changed_in_place_after_its_hook_is_captured_as_it_was(monkeypatch, scoped):
    """The capture keeps activations without copying them; one that the model changes in place
    later in the pass (its version counter moves) makes the pass run again with copies, so the
    capture holds the value the hook saw. Scoped (tracing every massive entry, the neuron-level
    activations kept at candidate positions): the change is seen when the layer is settled."""
    model = tiny_model("llama")
    view = ModelView(model)
    batch = view.tokenize(TEXT, None)
    seen = view.activation(batch, "blocks.0.mlp.hook_pre")[0]  # the gate pre-activation, copied at its hook
    real, copies = capture_module.capture, []
    monkeypatch.setattr(capture_module, "capture", lambda *a, **k: copies.append(k.get("copy", False)) or real(*a, **k))
    if scoped:  # positions 0 and 2 are the candidates, so layer 0 keeps those two rows
        two = torch.tensor([0, 2])
        monkeypatch.setattr(capture_module, "candidates",
                            lambda mag, scale, loose: torch.isin(torch.arange(mag.shape[1]), two)[None])
    every = torch.arange(batch.tokens.shape[1])
    criterion = Criterion() if scoped else None

    def pre(cap):
        return torch.stack([cap.row("pre", 0, i) for i in range(len(every)) if cap.covers(0, i)])

    kept = torch.tensor([0, 2]) if scoped else every
    assert torch.equal(pre(real(view, batch, every, criterion)), seen[kept]) and copies == []  # no second pass
    act_fn = model.original_model.model.layers[0].mlp.act_fn
    handle = act_fn.register_forward_pre_hook(lambda module, args: args[0].add_(1.0))  # after hook_pre fired
    try:
        cap = real(view, batch, every, criterion)
    finally:
        handle.remove()
    assert copies == [True]  # the second pass, with copies
    assert torch.equal(pre(cap), seen[kept])


def test_entry_ranks_match_counting_every_entry():
    """Super weights' ranks: the sorted tail (large values) and the full count (small ones) both
    give one plus the number of entries of larger magnitude, ties included."""
    m = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    m[3, 4], m[:10, 0] = 40.0, -2.5  # an outlier, and ties
    ranks, flat = EntryRanks(m), m.abs().flatten()
    values = [40.0, -40.0, 2.5, 3.0, 0.0, -0.01, 1.7, 100.0, *m.flatten()[::997].tolist()]
    assert [ranks.rank(v) for v in values] == [int((flat > abs(v)).sum()) + 1 for v in values]
    assert 0 < len(ranks.tail) < flat.numel() // 20 and any(abs(v) < ranks.floor for v in values)  # both ways
    wide = EntryRanks(m.double())  # counted by torch (NumPy's count reads float32 on the CPU)
    assert wide.array is None and [wide.rank(v) for v in values] == [ranks.rank(v) for v in values]


def _frames(trace) -> dict:
    return {k: getattr(trace, k) for k in ("targets", "ledger", "events", "neurons", "super_weights", "why", "heads",
                                           "attribution")}


def test_tracing_everything_on_the_default_model_keeps_mlp_activations_at_few_positions(default_model):
    """The point of the candidates: the d_mlp-wide activations of a trace-everything pass are kept
    at a few positions per layer, not at all of them (the memory that made the pass slow)."""
    view = ModelView(default_model)
    batch = view.tokenize(REAL_TEXT, None)
    seq = batch.tokens.shape[1]
    cap = capture_module.capture(view, batch, torch.arange(seq), Criterion())
    assert len(cap.kept) == view.n_layers  # every layer scoped
    for layer, rows in cap.kept.items():
        assert 2 * len(rows) <= seq and cap.at("post", layer).shape[0] == len(rows)


@pytest.mark.parametrize("candidates", ["none", "all"])
def test_tracing_everything_keeps_neurons_at_candidates_and_refills_the_rest(monkeypatch, candidates, default_model,
                                                                             real_trace):
    """Tracing every massive entry keeps the neuron-level activations only at candidate positions;
    with no candidate at all a second pass (sliced at the traced positions) reads them, and with
    every position a candidate nothing is scoped: the trace is the same either way, on the
    default model (position 0 becomes a candidate at an early layer there). The every-position
    capture is forced (a mixture of experts, and the one pass's fallback, take it); the trace it
    gives equals the one pass's (``real_trace``)."""
    model, scoped = default_model, real_trace  # traced with the candidates as they are
    monkeypatch.setattr(targets_module, "ONE_PASS_FROM", 1 << 30)
    passes = []
    real = capture_module.capture
    monkeypatch.setattr(capture_module, "capture", lambda *a, **k: passes.append(len(a[2])) or real(*a, **k))
    monkeypatch.setattr(capture_module, "candidates", lambda mag, scale, loose: torch.full(
        mag.shape[:2], candidates == "all"))
    with untouched(model):
        other = trace_origin(model, REAL_TEXT)
    births = scoped.events[scoped.events.component == "mlp"]
    assert passes == ([len(set(births.pos))] if candidates == "none" else [])  # the refill, sliced there
    assert len(scoped.neurons) and len(scoped.why)
    for key, frame in _frames(scoped).items():
        assert frame.equals(_frames(other)[key]), key


# --------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def real_trace(default_model):
    with untouched(default_model):
        return trace_origin(default_model, REAL_TEXT)


@pytest.fixture(scope="module")
def real_trace_verified(default_model, real_trace):
    """Verification of the largest traced entry (each entry costs a few forward passes)."""
    t = real_trace.targets.loc[real_trace.targets.peak.abs().idxmax()]
    with untouched(default_model):
        return trace_origin(default_model, REAL_TEXT, dim=int(t.dim), pos=int(t.pos), verify=True)


@pytest.mark.slow
def test_real_ledger_and_births(real_trace):
    _ledger_ok(real_trace)
    assert real_trace.targets.massive.all() and "bos" in set(real_trace.targets.token_kind)
    for t in real_trace.targets.itertuples():
        births = real_trace.births[(real_trace.births.pos == t.pos) & (real_trace.births.dim == t.dim)]
        assert not births.empty
        # the births explain most of the peak value
        assert math.copysign(1, t.peak) * births.contribution.sum() > 0.5 * abs(t.peak)


@pytest.mark.slow
def test_real_zeroing_named_neurons_removes_most(real_trace_verified):
    v = real_trace_verified.verification
    t = real_trace_verified.targets.iloc[0]
    at_peak = v[(v.intervention == "zero_neurons") & (v.layer == t.peak_layer)]
    assert not at_peak.empty and at_peak.remaining.abs().min() < 0.2
    births = real_trace_verified.births.set_index("layer")
    per_birth = v[v.scope != "all births"]
    assert not per_birth.empty
    for r in per_birth.itertuples():  # each birth's neurons carry most of that birth
        assert (r.value - r.ablated) / births.loc[r.layer, "contribution"] > 0.5
    assert "leaves" in real_trace_verified.summary()


@pytest.mark.slow
def test_real_mlp_agrees_with_plain_transformers(real_trace, default_model):
    """The ledger's MLP term and one neuron's term, recomputed from the Hugging Face MLP module
    with a plain torch forward hook (no TransformerLens hooks)."""
    t = real_trace.targets.iloc[0]
    births = real_trace.births
    birth = births[(births.pos == t.pos) & (births.dim == t.dim) & (births.component == "mlp")]
    layer = int(birth.loc[birth.contribution.abs().idxmax(), "layer"])
    block = default_model.original_model.model.layers[layer]
    mlp = getattr(block, "_original_component", block).mlp
    mlp = getattr(mlp, "_original_component", mlp)
    seen = {}
    handle = mlp.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0].detach(), out=out.detach()))
    tokens = default_model.to_tokens(REAL_TEXT)
    try:
        with untouched(default_model), torch.no_grad():
            default_model.original_model(tokens)
    finally:
        handle.remove()
    ledger = real_trace.ledger[(real_trace.ledger.pos == t.pos) & (real_trace.ledger.dim == t.dim)]
    term = ledger[(ledger.component == "mlp") & (ledger.layer == layer)].contribution.item()
    assert float(seen["out"][0, t.pos, t.dim]) == pytest.approx(term, rel=1e-4)
    neurons = real_trace.neurons[(real_trace.neurons.pos == t.pos) & (real_trace.neurons.dim == t.dim)]
    top = neurons[neurons.layer == layer].iloc[0]
    x = seen["x"][0, t.pos]
    n = int(top.neuron)
    with torch.no_grad():
        post = mlp.act_fn(mlp.gate_proj.weight[n] @ x) * (mlp.up_proj.weight[n] @ x)
        mine = float(post * mlp.down_proj.weight[t.dim, n])
    assert mine == pytest.approx(top.contribution, rel=1e-3)
