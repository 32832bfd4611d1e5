"""sink_dependence: the loss change without a head's sink attention (against an independent
computation through the head's output), the no-op / broadcast label (exact on a BOS sink), the
census's summary, and the usual contract."""

from __future__ import annotations

import ast
import re
from functools import partial
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import untouched
from planting import TEXT, bos_tokens, plant_sink

from massive_lens import find_massive, perplexity, sink_census, tiny_model
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import SinkDependence, dependence, force_self_attention, sink_dependence
from massive_lens.report import write_report

LAYER, HEAD = 1, 2


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    plant_sink(model)
    return model


def by_output(model, tokens, layer, head):
    """The loss with (layer, head)'s attention to the first token removed and its rows renormalised,
    computed on the head's output: z' = (z - p_0 v_0) / (1 - p_0) at every query but the first."""
    view, stash = ModelView(model), {}

    def keep(act, hook, key):
        stash[key] = act

    def edit(z, hook):
        p0 = stash["pattern"][:, head, :, 0]  # [batch query]
        group = stash["pattern"].shape[1] // stash["v"].shape[2]
        v0 = stash["v"][:, 0, head // group]  # [batch d_head]
        new = (z[:, :, head] - p0[..., None] * v0[:, None]) / (1 - p0)[..., None]
        z = z.clone()
        z[:, 1:, head] = new[:, 1:]
        return z

    hooks = [(view.hook_name(layer, "attn.hook_pattern"), partial(keep, key="pattern")),
             (view.hook_name(layer, "attn.hook_v"), partial(keep, key="v")),
             (view.hook_name(layer, "attn.hook_z"), edit)]
    return perplexity(model, tokens, batch_size=len(tokens), hooks=hooks, progress=False).per_seq


def test_loss_change_matches_the_head_output_computation(model):
    tokens = bos_tokens(model, TEXT, 24, 4)
    with untouched(model):
        dep = sink_dependence(model, tokens, heads=[(LAYER, HEAD)], batch_size=4, progress=False)
    assert isinstance(dep, SinkDependence)
    row = dep.to_frame().set_index(["layer", "head"]).loc[(LAYER, HEAD)]
    base = perplexity(model, tokens, batch_size=4, progress=False).per_seq
    want = (by_output(model, tokens, LAYER, HEAD) - base).mean()
    assert row["measured"] and row["loss_change"] == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    assert row["loss_low"] <= row["loss_change"] <= row["loss_high"]


def test_a_head_that_writes_nothing_does_not_depend_on_its_sink(model):
    with torch.no_grad():
        saved = model.blocks[LAYER].attn.W_O[HEAD].clone()
        model.blocks[LAYER].attn.W_O[HEAD] = 0.0
    try:
        dep = sink_dependence(model, bos_tokens(model, TEXT, 24, 4), heads=[(LAYER, HEAD)], progress=False)
    finally:
        with torch.no_grad():
            model.blocks[LAYER].attn.W_O[HEAD] = saved
    row = dep.to_frame().iloc[0]
    assert row["loss_change"] == row["loss_low"] == row["loss_high"] == 0.0


def test_a_bos_sink_is_an_exact_no_op_and_a_varying_first_token_a_broadcast(model):
    """A BOS sees only itself: its value is the same in every input, so swapping it changes nothing.
    Without BOS, the first token (the fallback sink) differs between inputs and its value carries that."""
    tokens = bos_tokens(model, TEXT, 24, 4)
    with_bos = sink_dependence(model, tokens, threshold=0.0, max_heads=1, progress=False).to_frame()
    assert (with_bos["swap_change"] == 0.0).all() and set(with_bos["label"]) == {"no-op"}
    without = sink_dependence(model, tokens[:, 1:], threshold=0.0, max_heads=1, progress=False).to_frame()
    assert (without["swap_change"] > 0.0).all() and "broadcast" in set(without["label"])


def test_summary_puts_dependence_beside_mass(model):
    tokens = bos_tokens(model, TEXT, 24, 4)
    dep = sink_dependence(model, tokens, threshold=0.0, max_heads=2, progress=False)
    text = dep.summary()
    assert "2 measured" in text and "nats/token" in text and "not a finding" in text
    census = sink_census(model, tokens)
    assert "dependence was not measured" in census.summary()
    joined = census.with_dependence(dep).summary()
    assert "dependence was not measured" not in joined and dep.summary() in joined
    assert dep.plot() is not None


@pytest.mark.parametrize("kw", [dict(heads=[(99, 0)]), dict(heads=[(0, 99)]), dict(n_seqs=1), dict(max_heads=0),
                                dict(batch_size=0), dict(broadcast_at=-1.0)])
def test_bad_inputs_are_refused(model, kw):
    with untouched(model), pytest.raises(MassiveLensError):
        sink_dependence(model, TEXT, seq_len=16, **{"n_seqs": 2, **kw}, progress=False)


@pytest.mark.heavy
def test_the_report_measures_dependence_only_behind_full(tmp_path):
    """The light report says dependence was not measured; ``full=True`` (``--full``) shows it."""
    model = tiny_model("llama")
    skip = "origin,sinks,circuit,interventions,quantization,lowbit"
    light = write_report(model, out_dir=tmp_path / "light", quick=True, progress=False, tables=False, skip=skip)
    assert "Sink dependence not measured" in (light.parent / "report.md").read_text()
    full = write_report(model, out_dir=tmp_path / "full", full=True, n_seqs=2, progress=False, tables=False, skip=skip)
    md = (full.parent / "report.md").read_text()
    assert "sink dependence on" in md and "Sink dependence not measured" not in md


@pytest.mark.slow
def test_a_sink_planted_on_the_default_model_is_named_by_the_census_and_dependence(default_model):
    """Known answer (issue 49): on the real default model, a position forced to attend only to itself
    in the layers up to the first token's massive birth (``force_self_attention``) becomes a sink. The
    census names it a primary sink in every sequence; ``sink_dependence``
    counts it among the sinks it removes; without the plant neither names it."""
    model, pos = default_model, 32
    view = ModelView(model)
    tokens = sequences(view, None, pos + 16, 2)
    found = find_massive(model, tokens).to_frame()
    birth = int(found.loc[found["pos"] == 0, "layer"].min())  # where the first token's massive activation is born
    with untouched(model):
        before = sink_census(model, tokens, attention="eager").to_frame()
        plain = sink_dependence(model, tokens, heads=[], batch_size=len(tokens), progress=False)
        with force_self_attention(model, pos, range(birth + 1)):
            after = sink_census(model, tokens, attention="eager").to_frame()
            dep = sink_dependence(model, tokens, max_heads=1, batch_size=len(tokens), progress=False)
    at = after[after["pos"] == pos]
    assert sorted(at["seq"]) == list(range(len(tokens))) and (at["level"] == "primary").all(), after
    assert not (before["pos"] == pos).any()
    assert bool(dep.sinks.mask[:, pos].all()) and not bool(plain.sinks.mask[:, pos].any())
    assert dep.to_frame()["measured"].sum() == 1 and dep.to_frame()["sink_mass"].max() >= dep.threshold


def test_the_untouched_pass_reads_either_path_alike(model, monkeypatch):
    """The sink mass and the swap's |dz|/|z| from the one pass: on the LSE path (a crossover within the
    tiny model's context) the same table as on the eager pattern; the loss changes are the eager edits'."""
    tokens = sequences(ModelView(model), TEXT, 24, 4)
    got = {}
    for crossover in (10_000, 8):
        monkeypatch.setattr("massive_lens.core.attention_pass.LSE_FROM", crossover)
        got[crossover] = sink_dependence(model, tokens[:, 1:], threshold=0.0, max_heads=2, progress=False).to_frame()
    pd.testing.assert_frame_equal(got[8], got[10_000], rtol=1e-5, atol=1e-6)


READERS = {"massive_lens/interventions/plant.py": ("sink_strength", "_key_attention_at"),
           "massive_lens/interventions/dependence.py": ("_Tally",),
           "massive_lens/effects/valley.py": ("_measure", "_layer_rows", "compression_valley")}


@pytest.mark.parametrize("path", sorted(READERS))
def test_the_readings_hang_no_attention_hook_of_their_own(path):
    """Issue 50: sink_strength, sink_dependence's untouched pass and compression_valley read their layers
    from the one attention pass; only the edits (force_self_attention, the removal runs) name hook points."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / path).read_text())
    found = [node for node in tree.body if getattr(node, "name", None) in READERS[path]]
    assert len(found) == len(READERS[path])
    for node in found:
        named = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                 and re.search(r"hook_(pattern|attn_scores|v|z|q|k)\b", c.value) and c not in _docstrings(node)]
        assert not named, f"{path}: {node.name} names {named}"


def _docstrings(node):
    return [n.body[0].value for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)]


def test_the_sinks_found_in_the_untouched_pass_or_in_their_own_give_the_same_table(model, monkeypatch):
    """The sinks are found in the untouched pass (the candidate columns held), in a pass of their own where
    the held columns would pass their budget (_holds), and read again where a sink is not among the candidates:
    one table."""
    tokens = sequences(ModelView(model), TEXT, 24, 4)[:, 1:]
    kw = dict(threshold=0.0, max_heads=1, progress=False)
    want = sink_dependence(model, tokens, **kw).to_frame()
    monkeypatch.setattr("massive_lens.interventions.dependence._holds", lambda *args: False)
    pd.testing.assert_frame_equal(sink_dependence(model, tokens, **kw).to_frame(), want)
    monkeypatch.undo()
    monkeypatch.setattr("massive_lens.interventions.dependence.candidate_columns",
                        lambda view, batch: torch.zeros(0, dtype=torch.long))
    pd.testing.assert_frame_equal(sink_dependence(model, tokens, **kw).to_frame(), want)


def test_the_held_columns_may_take_half_the_logits_a_plain_forward_would_hold(model, monkeypatch):
    """Past HOLD_BYTES the candidate columns are still held (one pass) while they take at most half the batch's
    float32 logits, which the loss at the head never makes; beyond, or where the loss reads the full logits,
    the sinks are found in a pass of their own."""
    view = ModelView(model)
    batch = view.full_batch(sequences(view, TEXT, 24, 2))
    per_column = dependence.attention_layers(view).__len__() * batch.mask.numel() * view.cfg.n_heads * 4
    half_logits = batch.mask.numel() * view.cfg.d_vocab * 4 // 2
    fits = half_logits // per_column
    assert 1 <= fits < batch.mask.shape[1]
    monkeypatch.setattr(dependence, "HOLD_BYTES", 0)
    scorer = dependence.NextTokenLoss(view)
    assert dependence._holds(view, batch, fits, scorer) and not dependence._holds(view, batch, fits + 1, scorer)
    scorer.exact = False
    assert not dependence._holds(view, batch, 1, scorer)
    capped = ModelView(tiny_model("gemma3", final_logit_softcapping=30.0))  # its loss reads the full logits
    assert not dependence._holds(capped, capped.full_batch(batch.tokens), 1, dependence.NextTokenLoss(capped))
    own_passes, sinks_of = [], dependence.sinks_of
    monkeypatch.setattr(dependence, "sinks_of", lambda *a: own_passes.append(1) or sinks_of(*a))
    for n_columns, passes in ((fits, 0), (fits + 1, 1)):
        monkeypatch.setattr(dependence, "candidate_columns", lambda view, batch, n=n_columns: torch.arange(n))
        own_passes.clear()
        sink_dependence(model, batch.tokens, heads=[], progress=False)
        assert len(own_passes) == passes, n_columns
