"""Interventions that check themselves: on a planted model of every family that rebuilds a
zeroed massive activation two layers later, zeroing at the first layer must be flagged as not
holding and zeroing at every massive layer must hold; the table flags the row and adds the
``every`` row itself. Post-norm (Gemma-3 style) models: every intervention edits exactly what it
says, and says where it acts relative to the norms. And on the real default model, the table
reports its sinks and the downstream check."""

from __future__ import annotations

import pytest
import torch
from helpers import WIKITEXT_TEST, WIKITEXT_VALID, needs_wikitext, untouched
from planting import REBUILD_LAYER, SINK_DIM, TEXT, VALUE, bos_tokens, plant_rebuild, plant_sink

from massive_lens import MassiveLensError, decompose_attention, tiny_model
from massive_lens.attention.sinks import sink_term
from massive_lens.interventions import (
    REBUILT,
    ablate_massive,
    bias_surgery,
    calibrate,
    fix_sink_term,
    observe,
    patch_sink_from,
    remove_sink_attention,
    run_interventions,
)
from massive_lens.interventions.checks import Record, downstream, reading
from massive_lens.interventions.table import CHECK_COLUMNS
from massive_lens.models import FAMILIES


def _tokens(model, n: int = 4, seq_len: int = 32, offset: int = 0) -> torch.Tensor:
    return bos_tokens(model, TEXT, seq_len, n, offset)


def _keep_at(seen: dict, key: int, whole: bool = False):
    """A probe hook keeping the activation (or its BOS entry of SINK_DIM) under ``key``."""
    def keep(x, hook):
        seen[key] = x.detach().clone() if whole else x[0, 0, SINK_DIM].detach()
    return keep


@pytest.fixture(scope="module", params=FAMILIES)
def rebuilding(request):
    """(model, calibration): a tiny model of each family that rebuilds a zeroed BOS value."""
    model = plant_rebuild(tiny_model(request.param))
    return model, calibrate(model, _tokens(model, offset=400), progress=False)


# --------------------------------------------------------------------------- the rebuilt activation


def test_first_layer_zero_is_undone_and_says_so(rebuilding):
    model, calib = rebuilding
    assert calib.first_layer == {SINK_DIM: 0} and calib.massive_layers[SINK_DIM] == set(range(model.cfg.n_layers))
    with untouched(model):
        frame = ablate_massive(model, calibration=calib).check(_tokens(model, 1))
    frame = frame.set_index("layer")
    assert frame.loc[0, "with"] == 0.0 and frame.loc[0, "without"] == pytest.approx(VALUE, rel=1e-3)
    assert frame.loc[REBUILD_LAYER - 1, "kept"] < 0.01  # gone for a layer ...
    assert frame.loc[REBUILD_LAYER, "kept"] > 0.9  # ... then written back
    verdict = frame.attrs["verdict"]
    assert verdict.startswith("zero (first layer): dim 5 back to") and verdict.endswith("the model rebuilds it")
    assert f"by layer {REBUILD_LAYER}" in verdict


def test_every_layer_zero_holds(rebuilding):
    model, calib = rebuilding
    with untouched(model):
        iv = ablate_massive(model, calibration=calib, where="every")
        frame = iv.check(_tokens(model, 1))
    assert iv.name == "zero_every" and iv.where == "every"
    assert (frame["with"] == 0.0).all() and (frame["without"] > 100).all()
    assert "removed downstream" in frame.attrs["verdict"] and "rebuilds" not in frame.attrs["verdict"]


def test_every_mean_sets_each_layer_to_its_mean(rebuilding):
    model, calib = rebuilding
    seen = {}
    probes = [(f"blocks.{layer}.hook_resid_post", _keep_at(seen, layer)) for layer in range(model.cfg.n_layers)]
    with ablate_massive(model, "mean", calibration=calib, where="every"), model.hooks(fwd_hooks=probes):
        model(_tokens(model, 1))
    means = {layer: calib.means_at[layer][calib.dims_at[layer].tolist().index(SINK_DIM)].item()
             for layer in range(model.cfg.n_layers)}
    for layer, mean in means.items():
        assert seen[layer].item() == pytest.approx(mean, rel=1e-4)


def test_bias_surgery_checks_its_suppression(rebuilding):
    model, calib = rebuilding
    first = bias_surgery(model, calibration=calib).check(_tokens(model, 1))
    every = bias_surgery(model, calibration=calib, where="every").check(_tokens(model, 1))
    assert "the model rebuilds it" in first.attrs["verdict"] and "rebuilds" not in every.attrs["verdict"]
    mass = every[every["kind"] == "sink_mass"]
    assert (mass["with"] < 1e-6).all() and (mass["without"] > 0).all()  # the sinks are masked out


def test_table_flags_the_rebuilt_row_and_adds_every(rebuilding):
    model, calib = rebuilding
    with untouched(model):
        table = run_interventions(model, _tokens(model), calibration=calib, batch_size=2, progress=False,
                                  settings=["original", "zero", "mean"])
    frame = table.to_frame().set_index("setting")
    assert list(frame.index) == ["original", "zero", "mean", "zero_every"]
    assert set(CHECK_COLUMNS) <= set(frame.columns)
    zero, every = frame.loc["zero"], frame.loc["zero_every"]
    assert zero["rebuilt"] and not zero["added"] and zero["where"] == "first"
    assert zero["target_back"] >= REBUILT and zero["back_layer"] == REBUILD_LAYER
    assert every["added"] and not every["rebuilt"] and every["target_back"] < 0.01 and every["where"] == "every"
    assert not frame.loc["mean", "rebuilt"] and frame.loc["mean", "target_kept"] == pytest.approx(1.0, abs=0.01)
    assert (frame.loc[["zero", "mean", "zero_every"], "targets_per_seq"] == 1.0).all()
    text = table.summary()
    assert "the model rebuilds it" in text and "NOTE: zero did not remove" in text and "[added:" in text
    assert set(table.checks["setting"]) == {"original", "zero", "mean", "zero_every"}


def test_abrupt_removal_holds_and_adds_nothing():
    model = tiny_model("llama")
    plant_sink(model)
    calib = calibrate(model, _tokens(model, offset=400), progress=False)
    table = run_interventions(model, _tokens(model), calibration=calib, progress=False, settings=["zero"])
    row = table.to_frame().iloc[0]
    assert list(table.to_frame()["setting"]) == ["zero"] and not row["rebuilt"]
    assert row["target_kept"] == 0.0 and row["target_back"] < 0.01
    assert "removed downstream" in row["check"] and "NOTE" not in table.summary()


def test_sink_interventions_check_the_attention_left_on_the_sinks(rebuilding):
    model, calib = rebuilding
    tokens = _tokens(model, 1)
    removed = remove_sink_attention(model, calibration=calib).check(tokens)
    assert (removed["with"] < 1e-6).all() and (removed["without"] > 0).all() and len(removed) == len(calib.attn_layers)
    kept = fix_sink_term(model, calibration=calib).check(tokens)
    first = kept[kept["layer"] == calib.attn_layers[0]].iloc[0]
    assert first["kept"] == pytest.approx(1.0)  # the pattern is not edited, only the sink term
    base = observe(model, calibration=calib)
    with base:
        model(tokens)
    assert base.record.sinks[0][0].nonzero().flatten().tolist() == [0]
    with pytest.raises(MassiveLensError, match="records no downstream check"):
        patch_sink_from(model, "Another text.").check(tokens)


def test_reading_of_a_record():
    """From two records alone: a removal that holds where the dim is massive, and a value that
    comes back only after those layers (named, not flagged)."""
    without, with_ = Record(), Record()
    for layer, (clean, edited) in enumerate([(1000.0, 0.0), (1000.0, 20.0), (1000.0, 30.0), (100.0, 300.0)], start=1):
        without.add_values(layer, [5], torch.tensor([clean]), torch.tensor([1.0]))
        with_.add_values(layer, [5], torch.tensor([edited]), torch.tensor([1.0]))
    checks = downstream(without, with_)
    assert checks["kept"].tolist() == [0.0, 0.02, 0.03, 3.0]
    read = reading(checks, label="zero (first layer)", first_layer={5: 1}, massive_layers={5: {1, 2, 3}},
                   removes=True, edits_massive=True, uses_sinks=False)
    assert not read["rebuilt"] and read["target_back"] == 0.03 and read["back_layer"] == 3
    assert read["check"] == ("zero (first layer): removed downstream: dim 5 at most 3.0% of its value at the later "
                             "layers where it was massive, 2.0% at the peak layer 2; after the layers where it is "
                             "massive, dim 5 at 300% of its untouched value at layer 4")
    kept = reading(checks, label="mean (first layer)", first_layer={5: 1}, massive_layers={5: {1, 2, 3}},
                   removes=False, edits_massive=True, uses_sinks=False)
    assert kept["check"] == "mean (first layer): dim 5 at 2.0% of its untouched value at the peak layer 2"


def test_bad_where(rebuilding):
    model, calib = rebuilding
    with pytest.raises(MassiveLensError, match="where"):
        ablate_massive(model, calibration=calib, where="last")
    with pytest.raises(MassiveLensError, match="where"):
        bias_surgery(model, calibration=calib, where="all")


# --------------------------------------------------------------------------- post-norm models: exact, and say where


@pytest.fixture(scope="module")
def gemma():
    """(model, calibration): a tiny Gemma-3 style model (sandwich norms) with a planted BOS sink."""
    model = tiny_model("gemma3")
    plant_sink(model)
    return model, calibrate(model, _tokens(model, offset=400), progress=False)


def _capture(model, tokens, names, intervention=None):
    seen = {}
    probes = [(n, lambda x, hook, n=n: seen.__setitem__(n, x.detach().clone())) for n in names]
    with torch.no_grad(), model.hooks(fwd_hooks=probes):  # attached first: sees each hook's input
        if intervention is None:
            out = model(tokens)
        else:
            with intervention:
                out = model(tokens)
    return seen, out


def test_gemma_ablation_is_exact_in_the_stream(gemma):
    model, calib = gemma
    tokens = _tokens(model, 1)
    for mode, where, expected in (("zero", "first", 0.0), ("mean", "first", calib.means[0].item()),
                                  (7.0, "every", 7.0)):
        iv = ablate_massive(model, mode, calibration=calib, where=where)
        assert "after this model's post-sublayer norms, so the edit is exact" in iv.acts_on
        seen = {}
        layers = range(model.cfg.n_layers) if where == "every" else [0]
        probes = [(f"blocks.{layer}.hook_resid_post", _keep_at(seen, layer)) for layer in layers]
        with untouched(model), iv, model.hooks(fwd_hooks=probes):  # probes attached after: see the edit
            model(tokens)
        assert all(v.item() == pytest.approx(expected, rel=1e-5) for v in seen.values()), (mode, seen)
    control = ablate_massive(model, calibration=calib, control=True)
    seen, _ = _capture(model, tokens, [])
    with control, model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: seen.setdefault("x", x))]):
        model(tokens)
    assert seen["x"][0, 0, SINK_DIM].item() == pytest.approx(VALUE, rel=1e-3) and (seen["x"][0] == 0).sum() >= 1


def test_gemma_sink_term_replacement_is_exact(gemma):
    model, calib = gemma
    tokens = _tokens(model, 1)
    layer = calib.attn_layers[0]
    names = [f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_v", f"blocks.{layer}.attn.hook_z"]
    clean, _ = _capture(model, tokens, names)
    iv = fix_sink_term(model, "mean", calibration=calib)
    assert "z (before W_O)" in iv.acts_on and "post-attention norm then rescales" in iv.acts_on
    edited = {}
    with iv, model.hooks(fwd_hooks=[(names[2], lambda x, hook: edited.setdefault("z", x.detach().clone()))]):
        model(tokens)
    sinks = torch.zeros(tokens.shape, dtype=torch.bool)
    sinks[:, 0] = True
    z, pattern, v = clean[names[2]], clean[names[0]], clean[names[1]]
    expected = z - sink_term(pattern, v, sinks) + calib.sink_z[layer]
    torch.testing.assert_close(edited["z"][:, 1:], expected[:, 1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(edited["z"][:, 0], z[:, 0])  # the sink query keeps its own output


def test_gemma_zero_sink_term_equals_unrenormalized_removal(gemma):
    model, calib = gemma
    tokens = _tokens(model, 1)
    _, a = _capture(model, tokens, [], fix_sink_term(model, "zero", calibration=calib))
    _, b = _capture(model, tokens, [], remove_sink_attention(model, renormalize=False, calibration=calib))
    _, base = _capture(model, tokens, [])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, base)


def test_gemma_removed_attention_is_renormalized(gemma):
    model, calib = gemma
    tokens = _tokens(model, 1)
    iv = remove_sink_attention(model, calibration=calib)
    assert "attention pattern (after softmax)" in iv.acts_on and "post-attention norm" in iv.acts_on
    seen = {}
    probes = [(f"blocks.{layer}.attn.hook_pattern", _keep_at(seen, layer, whole=True)) for layer in calib.attn_layers]
    with iv, model.hooks(fwd_hooks=probes):
        model(tokens)
    for pattern in seen.values():
        assert pattern[:, :, 1:, 0].abs().max() < 1e-6
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))


def test_gemma_bias_slot_reproduces_the_bos_sink(gemma):
    model, calib = gemma
    tokens = _tokens(model, 2)
    with untouched(model):
        _, slot = _capture(model, tokens, [], bias_surgery(model, calibration=calib, suppress=False))
        _, base = _capture(model, tokens, [])
    torch.testing.assert_close(slot, base, rtol=1e-4, atol=1e-4)


def test_gemma_patch_from_the_same_text_is_identity(gemma):
    model, _ = gemma
    tokens = _tokens(model, 1, 16)
    text = model.tokenizer.decode(tokens[0, 1:])
    iv = patch_sink_from(model, text, positions=[0, 3])
    assert "post-sublayer norms" in iv.acts_on and "positions 0 (" in iv.acts_on
    batch_tokens = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    same = torch.tensor([[model.tokenizer.bos_token_id, *batch_tokens]]) if model.cfg.default_prepend_bos else \
        torch.tensor([batch_tokens])
    _, patched = _capture(model, same, [], iv)
    _, base = _capture(model, same, [])
    torch.testing.assert_close(patched, base)


def test_gemma_decomposition_is_exact_before_the_norm(gemma):
    model, _ = gemma
    result = decompose_attention(model, _tokens(model, 2))
    assert result.reconstruction_error < 1e-4 and result.post_norm
    assert "before this model's post-attention norm" in result.summary()
    assert result.sinks.describe() == "1 per sequence: bos 2"


# --------------------------------------------------------------------------- the real default model


@pytest.mark.slow
@needs_wikitext
def test_default_model_table_reports_sinks_and_checks(default_model):
    """A small Table 3 (under a minute): the sinks are named, the zero row's target is gone at its
    peak layer or the row is flagged (and the every row added), and removing sink attention
    leaves none on the sinks."""
    with untouched(default_model):
        table = run_interventions(default_model, WIKITEXT_TEST, calibration=WIKITEXT_VALID, seq_len=32, n_seqs=2,
                                  batch_size=2, calibration_seqs=2, progress=False,
                                  settings=["original", "zero", "sink_attention_removed"])
    frame = table.to_frame().set_index("setting")
    assert (frame.loc[["original", "sink_attention_removed"], "sinks_per_seq"] >= 1).all()
    assert frame.loc["original", "sink_kinds"].startswith(("bos", "first"))
    zero = frame.loc["zero"]
    assert zero["target_kept"] < 0.1 or (zero["rebuilt"] and frame.loc["zero_every", "added"])
    assert zero["ratio"] > 10  # zeroing the massive activations still destroys the model
    removed = frame.loc["sink_attention_removed"]
    assert removed["sink_mass"] < 0.01 < removed["sink_mass_original"]
    assert "sinks (positions that draw attention as sinks" in table.summary()
