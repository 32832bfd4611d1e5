"""Outlier dimensions are decided per dimension over a run, not layer by layer.

``plant_dip`` (tests/planting.py): ``OUTLIER_DIM`` is massive at nearly every token of layer 0 (an
outlier dimension there) and, at ``DIP_LAYER``, at the ``WORD`` tokens only: under half of the
tokens, so a rule decided per layer calls those entries token-specific, and every consumer then
masks, edits or traces ordinary letters. Decided over the run (``OutlierTally``), none does.
"""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from planting import DIP_LAYER, OUTLIER_DIM, SINK_DIM, TEXT, WORD, bos_tokens, plant_dip

from massive_lens import (
    calibrate,
    exclusion_mask,
    find_massive,
    run_interventions,
    scan_corpus,
    tiny_model,
    trace_origin,
)
from massive_lens.core.criterion import OUTLIER_DIM_MIN_TOKENS, OUTLIER_DIM_SHARE, OutlierTally, SinkEvidence
from massive_lens.interventions import ablate_massive


@pytest.fixture(scope="module")
def dip():
    model = plant_dip(tiny_model("llama"))
    return model, bos_tokens(model, TEXT, 32, 3), bos_tokens(model, TEXT, 32, 3, offset=200)


def test_the_fixture_dips_under_the_share(dip):
    """What the other tests rely on: at DIP_LAYER the dim is massive at the WORD tokens only,
    fewer than the outlier share but more than the minimum count."""
    model, tokens, _ = dip
    entries = find_massive(model, tokens).to_frame()
    at_dip = entries[(entries.dim == OUTLIER_DIM) & (entries.layer == DIP_LAYER)]
    assert len(at_dip) and set(tokens[at_dip.seq.tolist(), at_dip.pos.tolist()].tolist()) == {WORD}
    per_seq = at_dip.groupby("seq").size()
    assert (per_seq < OUTLIER_DIM_SHARE * tokens.shape[1]).all() and (per_seq >= OUTLIER_DIM_MIN_TOKENS).all()


def test_find_massive_labels_the_dip_as_the_outlier_dimension(dip):
    model, tokens, _ = dip
    found = find_massive(model, tokens)
    entries = found.to_frame()
    assert (entries[entries.dim == OUTLIER_DIM].scope == "outlier_dim").all()
    token = entries[entries.scope == "token"]
    assert set(token.dim) == {SINK_DIM} and set(token.pos) == {0}
    assert f"{len(tokens)} token-specific massive (position, dim) pairs" in found.summary()
    assert found.outlier_dims().dim.tolist() == [OUTLIER_DIM]


def test_scan_counts_no_token_specific_row_for_the_outlier_dimension(dip):
    model, tokens, _ = dip
    frame = scan_corpus(model, tokens, seq_len=tokens.shape[1], batch_size=3, progress=False).to_frame()
    assert OUTLIER_DIM not in set(frame[frame.scope == "token"].dim)
    assert OUTLIER_DIM in set(frame[frame.scope == "outlier_dim"].dim)


def test_exclusion_mask_leaves_out_no_ordinary_token(dip):
    model, tokens, _ = dip
    ex = exclusion_mask(model, tokens, levels=())
    assert ex.mask[:, 1:].sum() == 0 and ex.mask[:, 0].all()
    assert WORD not in ex.token_ids()


def test_interventions_edit_no_entry_of_the_outlier_dimension(dip):
    """The calibration leaves the dim out at every layer; the table's edits (counted in the
    hooks) touch only the planted sink, and the summary says what was really edited."""
    model, evaluation, calibration = dip
    with untouched(model):
        table = run_interventions(model, evaluation, calibration=calibration,
                                  settings=["original", "zero", "zero_every"], progress=False)
    calib = table.calibration
    assert OUTLIER_DIM in calib.outlier_dims.tolist()
    assert all(OUTLIER_DIM not in dims.tolist() for dims in calib.dims_at.values())
    frame = table.to_frame().set_index("setting")
    for setting in ("zero", "zero_every"):
        assert frame.loc[setting, "target_dims"] == str(SINK_DIM)
        assert frame.loc[setting, "target_kinds"] == f"bos {len(evaluation)}"
        assert frame.loc[setting, "edited_dims"].startswith(f"{SINK_DIM} (")
    assert f"dim {OUTLIER_DIM}: excluded: no setting edited an entry of them" in table.summary()


def test_included_outlier_dims_are_reported_as_edited(dip):
    model, evaluation, calibration = dip
    table = run_interventions(model, evaluation, calibration=calibration, settings=["zero_every"],
                              outliers="include", progress=False)
    edited = table.to_frame().set_index("setting").loc["zero_every", "edited_dims"]
    assert f"{OUTLIER_DIM} (" in edited
    assert f"included; edited: dim {OUTLIER_DIM} by zero_every" in table.summary()


def test_the_valley_ablation_edits_only_the_token_specific_dim(dip):
    """compression_valley's zero_every is ablate_massive(where='every') on the calibration: the
    WORD tokens keep their OUTLIER_DIM value at the dip, the sink's value is gone."""
    model, evaluation, calibration = dip
    iv = ablate_massive(model, calibration=calibrate(model, calibration, progress=False), where="every")
    seen = {}

    def grab(resid, hook):
        seen["x"] = resid.detach().clone()

    model.run_with_hooks(evaluation, fwd_hooks=[*iv.fwd_hooks, (f"blocks.{DIP_LAYER}.hook_resid_post", grab)])
    words = evaluation == WORD
    assert torch.equal(seen["x"][..., OUTLIER_DIM][words].abs() > 100, torch.ones(int(words.sum()), dtype=torch.bool))
    assert (seen["x"][:, 0, SINK_DIM] == 0).all()
    assert set(iv.record.edited) == {SINK_DIM}


def test_trace_origin_traces_the_sink_only(dip):
    model, tokens, _ = dip
    trace = trace_origin(model, tokens[:1], prepend_bos=False)
    assert trace.targets[["pos", "dim"]].values.tolist() == [[0, SINK_DIM]]


def test_sink_rule_counts_no_dip_entry():
    """Positions massive only where an outlier dimension dips under the share are no sinks,
    however many layers the dip lasts."""
    n_layers, pos, d = 4, 10, 3
    evidence = SinkEvidence(torch.ones(1, pos, dtype=torch.bool), n_layers)
    for layer in range(n_layers):
        resid = torch.full((1, pos, d), 0.01)
        resid[0, 0, 2] = 5000.0  # the true sink
        resid[0, : (pos if layer == 0 else OUTLIER_DIM_MIN_TOKENS), 1] = 5000.0  # dim 1: every token, then a dip
        evidence.add_resid(layer, resid)
    assert evidence.mask()[0].nonzero().flatten().tolist() == [0]


def test_the_tally_keeps_a_massive_dim_token_specific_where_it_is_on_few_tokens():
    """A dim that is an outlier dimension at one layer keeps its token-specific entries at the
    layers where it is massive at fewer than OUTLIER_DIM_MIN_TOKENS tokens."""
    tally = OutlierTally()
    spread = torch.zeros(1, 10, 2, dtype=torch.bool)
    spread[0, :, 0] = True
    few = torch.zeros(1, 10, 2, dtype=torch.bool)
    few[0, : OUTLIER_DIM_MIN_TOKENS - 1, 0] = True
    for layer, massive in enumerate((few, spread, few)):
        tally.add(layer, massive)
    assert [bool(tally.at(layer)[0]) for layer in range(3)] == [False, True, False]
    assert tally.dims.tolist() == [True, False]


def test_calibration_reads_every_layer_when_the_final_norm_also_runs_first(dip):
    """A model whose final norm also normalizes the embeddings (NanoChat) fires
    ``ln_final.hook_out`` before the first block: the calibration pass must not stop there
    (it did, and found no massive activation at all)."""
    model, _, calibration = dip
    plain = calibrate(model, calibration, outliers="include", progress=False)
    embed = model.original_model.get_input_embeddings()

    def norm_too(module, args, out):  # the final norm runs on the embeddings, its output unused here
        model.ln_final(out)

    handle = embed.register_forward_hook(norm_too)
    try:
        early = calibrate(model, calibration, outliers="include", progress=False)
    finally:
        handle.remove()
    assert plain.dims_at, "the planted model has massive dims"
    assert {k: v.tolist() for k, v in early.dims_at.items()} == {k: v.tolist() for k, v in plain.dims_at.items()}


def test_the_tally_judges_again_after_each_added_layer():
    """``at`` judges every layer once and keeps the rows until the next ``add``: a dim that becomes an
    outlier dimension at a later layer is one at an earlier layer where it was spread, as soon as the
    later layer is added (a kept judgement that missed the add would still call it token-specific)."""
    tally, n = OutlierTally(), OUTLIER_DIM_MIN_TOKENS + 1
    spread = torch.zeros(1, n * 4, 3, dtype=torch.bool)
    spread[0, :n, 1] = True  # dim 1 on a few tokens: spread, not an outlier dimension by itself
    tally.add(0, spread)
    assert not bool(tally.at(0)[1])
    every = torch.zeros(1, n * 4, 3, dtype=torch.bool)
    every[0, :, 1] = True  # dim 1 on every token of layer 1: an outlier dimension
    tally.add(1, every)
    assert bool(tally.at(0)[1]) and bool(tally.at(1)[1])


def test_the_tally_gives_the_same_flags_with_the_callers_count_and_no_mask():
    """The reducer hands the tally its per-dim count and no mask where every position is real: the flags and the
    run's scopes are those of the tally counting for itself with an all-True mask."""
    gen = torch.Generator().manual_seed(0)
    mag = torch.rand(2, 40, 16, generator=gen)
    mag[:, :, 3] += 300.0  # a channel, large at every token
    mag[0, 5, 3], mag[1, 0, 7], mag[:, :30, 9] = 5000.0, 900.0, 700.0  # a spike on it; a token; a spread dim
    massive = mag > 500.0
    valid = torch.ones(2, 40, dtype=torch.bool)
    mine, theirs = OutlierTally(), OutlierTally()
    for layer in range(3):
        got = mine.add(layer, massive, None, mag, massive.sum(1))
        assert torch.equal(got, theirs.add(layer, massive, valid, mag))
        assert got[:, 9].all() and not got[:, 7].any()
    assert all(torch.equal(mine.at(layer), theirs.at(layer)) for layer in range(3))
