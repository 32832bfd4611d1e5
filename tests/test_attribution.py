"""Origin attribution accounts for the whole peak: an abrupt birth, gradual growth over eight
layers (+15% each), and a gradual erasure, planted on every tiny family, must each be named
by the runs that wrote them, with at most 10% of the value left to "the rest" (and said)."""

from __future__ import annotations

import pytest
import torch

from massive_lens import tiny_model, trace_origin
from massive_lens.models import FAMILIES
from massive_lens.origin.attribution import attribute

DIM, TRIGGER_DIM, N_LAYERS = 5, 11, 12
BIRTH = 200.0


def _bos_activation(model, name: str) -> torch.Tensor:
    seen = {}

    def keep(act, hook):
        seen["x"] = act[0, 0].clone()

    tokens = torch.tensor([[model.tokenizer.bos_token_id, 72, 105, 46]])
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(name, keep)])
    return seen["x"]


def _resid_at_bos(model, layer: int) -> float:
    return float(_bos_activation(model, f"blocks.{layer}.hook_resid_post")[DIM])


def plant_write(model, layer: int, read_dim: int, add: float, neuron: int = 17) -> None:
    """Make MLP ``layer`` add exactly ``add`` to the residual's ``DIM`` at BOS: one neuron reads
    ``read_dim`` and writes ``DIM``; its size is set from a measured pass (on post-norm models
    through the post-norm's weight of ``DIM``, the layer's other neurons no longer writing it)."""
    mlp = model.blocks[layer].mlp
    post_norm = f"blocks.{layer}.ln2_post.hook_out" in model.hook_dict
    with torch.no_grad():
        for name in ("W_in", "W_gate"):
            weight = getattr(mlp, name, None)
            if weight is not None:
                weight[:, neuron] = 0.0
                weight[read_dim, neuron] = 3.0
        if getattr(mlp, "b_in", None) is not None:
            mlp.b_in[neuron] = 0.0
        if post_norm:
            mlp.W_out[:, DIM] = 0.0
        mlp.W_out[neuron] = 0.0
        mlp.W_out[neuron, DIM] = 1.0 if add > 0 else -1.0
    if post_norm:
        out = float(_bos_activation(model, f"blocks.{layer}.ln2_post.hook_out")[DIM])
        weight = model.blocks[layer].ln2_post._original_component.weight  # Gemma: x * (1 + weight)
        with torch.no_grad():
            weight[DIM] = (1.0 + weight[DIM]) * add / out - 1.0
    else:
        act = float(_bos_activation(model, f"blocks.{layer}.mlp.hook_post")[neuron])
        with torch.no_grad():
            mlp.W_out[neuron, DIM] = add / act


def planted(family: str, shape: str):
    """A 12-layer tiny model with one planted shape at (BOS, DIM); returns (model, text)."""
    model = tiny_model(family, num_hidden_layers=N_LAYERS)
    with torch.no_grad():
        model.W_E[model.tokenizer.bos_token_id].zero_()
        model.W_E[model.tokenizer.bos_token_id, TRIGGER_DIM] = 1.0
    plant_write(model, 1, TRIGGER_DIM, 1000.0 if shape != "growth" else BIRTH)
    if shape == "growth":  # MLPs 2-9 each add 15% of the running value
        for layer in range(2, 10):
            plant_write(model, layer, DIM, 0.15 * _resid_at_bos(model, layer - 1))
    if shape == "erasure":  # MLPs 5-10 each remove 12% of it
        for layer in range(5, 11):
            plant_write(model, layer, DIM, -0.12 * _resid_at_bos(model, layer - 1))
    return model


def _trace(model):
    bos = model.tokenizer.bos_token_id
    return trace_origin(model, torch.tensor([[bos, 72, 105, 46, 33]]), dim=DIM, pos=0)


def _shares(trace, target: str) -> dict[str, float]:
    rows = trace.attribution[trace.attribution.target == target]
    return dict(zip(rows.label, rows.share, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_abrupt_birth_is_one_mlp(family):
    trace = _trace(planted(family, "abrupt"))
    shares = _shares(trace, "peak")
    assert shares["MLP 1"] > 0.9, shares
    assert "the peak" in trace.summary() and "MLP 1 +" in trace.summary()


@pytest.mark.parametrize("family", FAMILIES)
def test_gradual_growth_is_named_as_one_run(family):
    trace = _trace(planted(family, "growth"))
    shares = _shares(trace, "peak")
    expected = 1 - 1 / 1.15**8  # the eight +15% writes' part of the peak
    assert shares.get("MLPs 2-9") == pytest.approx(expected, abs=0.05), shares
    named = sum(v for k, v in shares.items() if k != "the rest")
    assert named >= 0.9 and abs(shares.get("the rest", 0.0)) <= 0.1
    assert "MLPs 2-9 +" in trace.summary()


@pytest.mark.parametrize("family", FAMILIES)
def test_gradual_erasure_is_named_as_a_cumulative_cut(family):
    trace = _trace(planted(family, "erasure"))
    change = _shares(trace, "change")
    assert change.get("MLPs 5-10", 0.0) >= 0.9, change
    assert trace.events.query("kind == 'erasure'").empty  # no single step is large enough
    line = next(s for s in trace.summary().splitlines() if s.strip().startswith("then cut"))
    assert "MLPs 5-10 -" in line


def test_attribution_sums_to_its_target_and_names_large_cuts():
    rows = [dict(component="mlp", layer=i, contribution=c) for i, c in enumerate([50.0, 60.0, -30.0, 20.0, 1.0])]
    groups = attribute(rows, target=101.0)
    assert sum(g["contribution"] for g in groups) == pytest.approx(101.0)
    assert any(g["label"] == "MLP 2" and g["contribution"] == -30.0 for g in groups)  # a 30% cut is named


@pytest.mark.slow
def test_default_model_summary_accounts_for_each_peak(default_model):
    text = "Summer is warm. Winter is cold.\nThe cat sat on the mat, and the dog slept."
    trace = trace_origin(default_model, text)
    for t in trace.targets.itertuples():
        rows = trace.attribution[(trace.attribution.pos == t.pos) & (trace.attribution.dim == t.dim)]
        peak = rows[rows.target == "peak"]
        assert peak.contribution.sum() == pytest.approx(t.peak, rel=1e-4)  # exact, the rest included
        rest = peak[peak.label == "the rest"].share.sum()
        assert abs(rest) <= 0.1 or f"the rest: {int(peak[peak.label == 'the rest'].n_writes.iloc[0])}" in \
            trace.summary()
