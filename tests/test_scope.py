"""Token-specific massive activations vs outlier dimensions, and the headline, on a planted model.

``plant_story`` (tests/planting.py) plants both phenomena in one tiny pre-norm model: BOS's
``SINK_DIM`` grows over three MLPs to its peak and is then cut (token-specific), while
``OUTLIER_DIM`` is massive at every token but BOS in the first layers (an outlier dimension).
"""

from __future__ import annotations

import inspect
import logging

import pandas as pd
import pytest
from helpers import plant_massive, untouched
from planting import GROWTH, OUTLIER_DIM, OUTLIER_END, SINK_DIM, TEXT, bos_tokens, plant_story

from massive_lens import (
    Criterion,
    MassiveLensError,
    find_massive,
    run_interventions,
    scan_corpus,
    tiny_model,
    trace_origin,
)
from massive_lens.core.criterion import OUTLIER_DIM_MIN_TOKENS, OUTLIER_DIM_SHARE, outlier_dims
from massive_lens.detect import LayerProfile
from massive_lens.origin.story import BIRTH_SHARE, _heads
from massive_lens.origin.trace import VERIFY_TOP

STORY_TEXT = "The cat sat on the mat. It was warm, and the dog slept by the door."
PEAK_LAYER = max(range(len(GROWTH)), key=lambda i: abs(GROWTH[i]))


@pytest.fixture(scope="module", params=("llama", "gpt2"))
def story_model(request):
    return plant_story(tiny_model(request.param))


def test_outlier_rule_needs_share_and_count():
    import torch

    n = torch.tensor([10, 3])
    count = torch.tensor([[int(10 * OUTLIER_DIM_SHARE), int(10 * OUTLIER_DIM_SHARE) - 1], [3, 2]])
    flags = outlier_dims(count, n).tolist()
    assert flags[0] == [True, False]
    assert flags[1] == [3 >= OUTLIER_DIM_MIN_TOKENS, False]  # BOS and a delimiter of a short text are not one


def test_scope_labels(story_model):
    with untouched(story_model):
        found = find_massive(story_model, STORY_TEXT, prepend_bos=True)
    frame = found.to_frame()
    assert set(frame.scope) == {"token", "outlier_dim"}
    token, outlier = frame[frame.scope == "token"], frame[frame.scope == "outlier_dim"]
    assert set(zip(token.pos, token.dim, strict=True)) == {(0, SINK_DIM)}
    assert set(outlier.dim) == {OUTLIER_DIM} and set(outlier.layer) == set(range(OUTLIER_END))
    assert 0 not in set(outlier.pos)
    dims = found.outlier_dims()
    assert dims.dim.tolist() == [OUTLIER_DIM]
    assert dims.layers.iloc[0] == tuple(range(OUTLIER_END)) and dims.share.iloc[0] > OUTLIER_DIM_SHARE
    rows = found.by_dim()
    assert rows.scope.iloc[0] == "token" and (rows.scope.iloc[1:] == "outlier_dim").all()  # grouped below


def test_summary_headline_and_outliers_apart(story_model):
    found = find_massive(story_model, STORY_TEXT, prepend_bos=True)
    text = found.summary()
    first = text.splitlines()[0]
    assert "1 token-specific massive (position, dim) pair" in first
    assert f"at layer {PEAK_LAYER}" in first and f"{GROWTH[PEAK_LAYER]:,.0f}" in first
    assert found.headline_layer == PEAK_LAYER and int(found.headline.dim) == SINK_DIM
    outlier_line = next(line for line in text.splitlines() if f"dim {OUTLIER_DIM} at " in line)
    assert f"of tokens in layers 0-{OUTLIER_END - 1}: an outlier dimension" in outlier_line
    assert text.index(f"dim {SINK_DIM} at") < text.index(outlier_line)


def test_scan_scope_and_headline_layer(story_model):
    scan = scan_corpus(story_model, TEXT, seq_len=32, max_tokens=128, progress=False, prepend_bos=True)
    frame = scan.to_frame()
    token, outlier = frame[frame.scope == "token"], frame[frame.scope == "outlier_dim"]
    assert set(token.dim) == {SINK_DIM} and set(token.token_kind) == {"bos"}
    assert outlier.dim.tolist() == [OUTLIER_DIM] and outlier.token_kind.tolist() == ["any"]
    assert (outlier.first_layer.iloc[0], outlier.last_layer.iloc[0]) == (0, OUTLIER_END - 1)
    assert frame.index[frame.scope == "outlier_dim"].min() > frame.index[frame.scope == "token"].max()
    text = scan.summary()
    assert f"top-1 is largest at layer {PEAK_LAYER}" in text
    assert "an outlier dimension" in text


def test_profile_names_the_ratio_layer_when_it_differs():
    frame = pd.DataFrame(dict(layer=[0, 1, 2], top1_mean=[50.0, 900.0, 2000.0], top1_std=0.0,
                              median_mean=[0.001, 0.5, 2.0], median_std=0.0,
                              ratio_mean=[50_000.0, 1_800.0, 1_000.0], ratio_std=0.0))
    text = LayerProfile(frame=frame, model_name="m", n_sequences=3).summary()
    assert "top-1 is largest at layer 2 with 2,000.0" in text
    assert "top-1/median peaks at layer 0 (50,000x" in text
    same = LayerProfile(frame=frame.assign(ratio_mean=[1.0, 2.0, 3.0]), model_name="m", n_sequences=3).summary()
    assert "peaks at" not in same


# --------------------------------------------------------------------------- trace_origin


def test_trace_defaults_to_token_specific_entries(story_model):
    trace = trace_origin(story_model, STORY_TEXT, prepend_bos=True)
    assert trace.targets[["pos", "dim"]].values.tolist() == [[0, SINK_DIM]]
    assert trace.targets.scope.tolist() == ["token"]
    assert any("outlier dimensions" in n and "not traced" in n for n in trace.notes)
    chosen = trace_origin(story_model, STORY_TEXT, dim=OUTLIER_DIM, pos=3, prepend_bos=True)
    assert chosen.targets.scope.tolist() == ["outlier_dim"]


def test_birth_is_named_at_a_share_of_the_peak(story_model):
    """The first write passes the absolute threshold but is a small share of the peak: it is
    'written by'; the birth is the first write that brings the value to BIRTH_SHARE of it."""
    text = trace_origin(story_model, STORY_TEXT, prepend_bos=True).summary()
    born = next(i for i, g in enumerate(GROWTH) if abs(g) >= BIRTH_SHARE * abs(GROWTH[PEAK_LAYER]))
    assert GROWTH[0] > 100 and born > 0  # the fixture tests what it means to
    assert "written by MLP 0 " in text and f"born in MLP {born} " in text and "of the peak)" in text
    lines = text.splitlines()
    story = next(i for i, line in enumerate(lines) if line.startswith(f"dim {SINK_DIM} at"))
    assert lines[story + 1].strip().startswith("the peak")  # the attribution leads, events follow
    assert any(line.strip().startswith("events: ") for line in lines[story + 2:])


def test_the_events_table_and_the_summary_agree_on_the_birth(story_model):
    """One rule: the MLP that only writes 4% of the peak is a ``write`` in the table ("written
    by"), the one that reaches BIRTH_SHARE is the ``birth`` ("born in"), later growth a ``raise``."""
    trace = trace_origin(story_model, STORY_TEXT, prepend_bos=True)
    born = next(i for i, g in enumerate(GROWTH) if abs(g) >= BIRTH_SHARE * abs(GROWTH[PEAK_LAYER]))
    mine = trace.events[(trace.events.dim == SINK_DIM) & (trace.events.component == "mlp")].set_index("layer")
    assert mine.loc[0, "kind"] == "write" and mine.loc[born, "kind"] == "birth"
    assert (mine.loc[born + 1:PEAK_LAYER, "kind"] == "raise").all()
    births = trace.births[trace.births.dim == SINK_DIM]
    assert births.layer.tolist() == [born]
    text = trace.summary()
    assert "written by MLP 0 " in text and f"born in MLP {born} " in text and f"raised by MLP {PEAK_LAYER} " in text


def test_first_query_has_no_attention_claim():
    heads = pd.DataFrame(dict(layer=[0], head=[0], contribution=[5.0], first_token_attention=[1.0],
                              max_attention=[1.0]))
    assert "attends 100% to the first token" in _heads(heads, 0, 5.0)
    assert "attends" not in _heads(heads, 0, 5.0, first_query=True)


@pytest.fixture(scope="module")
def many_entries():
    """The story model plus four more token-specific entries (rare letters, each its own dim)."""
    model = plant_story(tiny_model("llama"))
    for i, char in enumerate("xqzj"):
        token = model.tokenizer(char, add_special_tokens=False)["input_ids"][0]
        plant_massive(model, layer=1, neuron=60 + i, dim=20 + i, value=300.0 + 100 * i, trigger=token,
                      trigger_dim=30 + i)
    return model


def test_verification_is_bounded_and_estimated(many_entries, caplog):
    text = "x marks it. q, z and j are rare letters here."
    with caplog.at_level(logging.INFO, logger="massive_lens.origin.trace"):
        trace = trace_origin(many_entries, text, verify=True, prepend_bos=True)
    n = len(trace.targets)
    assert n > VERIFY_TOP
    verified = trace.verification[["pos", "dim"]].drop_duplicates()
    largest = trace.targets.head(VERIFY_TOP)
    assert set(map(tuple, verified.values.tolist())) <= set(map(tuple, largest[["pos", "dim"]].values.tolist()))
    assert any(f"{n - VERIFY_TOP} skipped" in note for note in trace.notes)
    assert any("estimated" in r.getMessage() and "verifying" in r.getMessage() for r in caplog.records)


def test_verify_must_be_a_bool(story_model):
    untyped = inspect.unwrap(trace_origin)  # what a caller without the test-time type checker runs
    with pytest.raises(MassiveLensError, match="verify must be True or False"):
        untyped(story_model, STORY_TEXT, verify="no")


# --------------------------------------------------------------------------- the report's first screen


@pytest.fixture(scope="module")
def story_report(tmp_path_factory):
    from massive_lens.report import write_report

    model = plant_story(tiny_model("llama"))
    with untouched(model):
        return write_report(model, text=STORY_TEXT, out_dir=tmp_path_factory.mktemp("story"), quick=True,
                            progress=False, tables=False)


def test_report_first_screen_names_the_headline(story_report):
    md = (story_report.parent / "report.md").read_text()
    massive = md.split("## Massive activations")[1].split("## Origin")[0]
    first = massive.split("```")[1]
    assert f"the largest is {GROWTH[PEAK_LAYER]:,.0f} (dim {SINK_DIM}" in first and f"at layer {PEAK_LAYER}" in first
    token_table = massive.index("token-specific massive (position, dim) pairs")
    outlier_table = massive.index("outlier dimensions, listed apart")
    assert token_table < outlier_table
    assert f"activation landscape at layer {PEAK_LAYER} (the layer of the headline activation: dim {SINK_DIM}" \
        in massive
    attention = md.split("## Attention sinks")[1].split("## Interventions")[0]
    assert f"attention patterns of layer {PEAK_LAYER} (the layer of the headline activation" in attention
    assert f"after layer {PEAK_LAYER} (the layer of the headline activation" in attention  # the magnitude view
    origin = md.split("## Origin")[1].split("## Attention")[0]
    assert f"dim {SINK_DIM} at" in origin and f"dim {OUTLIER_DIM} at" not in origin


# --------------------------------------------------------------------------- interventions


@pytest.fixture(scope="module")
def story_tokens():
    model = plant_story(tiny_model("llama"))
    return model, bos_tokens(model, TEXT, 32, 3), bos_tokens(model, TEXT, 32, 3, offset=200)


@pytest.mark.parametrize("outliers", ["exclude", "include"])
def test_interventions_list_their_targets_and_leave_outlier_dims_by_default(story_tokens, outliers):
    model, evaluation, calibration = story_tokens
    with untouched(model):
        table = run_interventions(model, evaluation, calibration=calibration,
                                  settings=["original", "zero", "sink_term_zero"], outliers=outliers, progress=False)
    frame = table.to_frame().set_index("setting")
    dims = {int(d) for d in frame.loc["zero", "target_dims"].split(", ")}
    assert OUTLIER_DIM in table.calibration.outlier_dims.tolist()
    if outliers == "exclude":
        assert dims == {SINK_DIM} and frame.loc["zero", "target_kinds"] == f"bos {len(evaluation)}"
        assert frame.loc["zero", "targets_per_seq"] == 1.0
        assert f"dim {OUTLIER_DIM}: excluded" in table.summary()
    else:
        assert dims == {SINK_DIM, OUTLIER_DIM} and frame.loc["zero", "targets_per_seq"] > 1
        assert "included" in table.summary()
    assert frame.loc["sink_term_zero", "target_dims"] == "" and frame.loc["original", "target_dims"] == ""
    assert frame.loc["sink_term_zero", "sink_kinds"] == f"bos {len(evaluation)}"  # an outlier dim makes no sink


def test_outlier_choice_is_checked():
    with pytest.raises(MassiveLensError, match="outliers must be 'include' or 'exclude'"):
        Criterion(outliers="some")


def test_a_rebirth_can_be_the_birth():
    """Written to 3% of the peak, erased, then rewritten to the peak: the rewrite is the birth."""
    from massive_lens.origin.ledger import event_kinds
    from massive_lens.origin.story import _verbs

    kinds = event_kinds([(0.0, 300.0), (300.0, 40.0), (40.0, 10_000.0), (10_000.0, 4_000.0)], 10_000.0)
    assert kinds == ["write", "erasure", "birth", "erasure"]
    assert _verbs(pd.DataFrame(dict(kind=kinds))) == ["written by", "cut", "born in", "cut"]


@pytest.mark.parametrize("share", [0.5, 0.3, 1 / 3, 0.7])
def test_outlier_rule_bound_is_the_float32_comparison(share, monkeypatch):
    """outlier_dims compares counts with one integer bound per sequence: the same flags as comparing the count,
    as float32, with the share of the real tokens (float32) and with the minimum, at every count and length."""
    import torch

    import massive_lens.core.outliers as module

    monkeypatch.setattr(module, "OUTLIER_DIM_SHARE", share)
    n = torch.arange(0, 5000, 7)
    count = torch.arange(0, 5000)[None].expand(len(n), -1)
    as_float = count.float()
    expected = (as_float >= share * n.float()[:, None]) & (as_float >= OUTLIER_DIM_MIN_TOKENS)
    assert torch.equal(outlier_dims(count, n), expected)
    assert torch.equal(outlier_dims(count[:1], n[50:51]), expected[50:51])  # one sequence: one comparison
