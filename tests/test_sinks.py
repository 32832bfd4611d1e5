"""Sinks identified as sinks: a position is a sink when it draws attention as one or carries a
massive activation that persists across layers; a dim that crosses the criterion at one early
layer does not make its positions sinks. Checked on the rule itself (synthetic patterns and
activations), on a planted model of every family where a dim is briefly massive at ordinary
tokens while the first token is the true sink, and on what every analysis and intervention
reports."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import untouched
from planting import BRIEF_DIM, SINK_DIM, TEXT, WORD, bos_tokens, plant_brief

from massive_lens import MassiveLensError, decompose_attention, find_massive, sink_attention, tiny_model
from massive_lens.attention import find_sinks
from massive_lens.attention.sinks import SinkSet
from massive_lens.core.criterion import SINK_MIN_QUERIES, SINK_QUERIES, SinkEvidence, SinkRule, key_attention
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.interventions import (
    bias_surgery,
    calibrate,
    fix_sink_term,
    observe,
    remove_sink_attention,
    run_interventions,
)
from massive_lens.models import FAMILIES

# --------------------------------------------------------------------------- the rule itself


def _uniform(batch: int, heads: int, pos: int) -> torch.Tensor:
    causal = torch.tril(torch.ones(pos, pos))
    return (causal / causal.sum(-1, keepdim=True)).expand(batch, heads, pos, pos).clone()


def test_attention_alone_makes_a_sink():
    """Every head sends most of its attention to position 3 (no massive activation anywhere)."""
    pos, heads = 40, 4
    pattern = _uniform(1, heads, pos)
    pattern[..., 4:, :] *= 0.2
    pattern[..., 4:, 3] += 0.8
    ev = SinkEvidence(torch.ones(1, pos, dtype=torch.bool), n_layers=2)
    for _ in range(2):
        ev.add_pattern(pattern)
    assert ev.mask()[0].nonzero().flatten().tolist() == [3]
    assert bool(ev.by_attention[0, 3]) and not bool(ev.by_massive.any())


def test_local_heads_and_late_positions_make_no_sink():
    """A previous-token head gives each key 1 / (its later queries): no sink; and the last
    positions, with fewer than SINK_MIN_QUERIES later queries, are not judged by attention."""
    pos = 40
    prev = torch.zeros(1, 1, pos, pos)
    prev[0, 0, 0, 0] = 1.0
    prev[0, 0, torch.arange(1, pos), torch.arange(pos - 1)] = 1.0
    ev = SinkEvidence(torch.ones(1, pos, dtype=torch.bool), n_layers=1)
    ev.add_pattern(prev)
    assert not bool(ev.mask().any())
    late = torch.zeros(1, 1, pos, pos)
    late[0, 0, :, 0] = 1.0
    late[0, 0, -3:, :] = 0.0
    late[0, 0, -3:, pos - 4] = 1.0  # the last 3 queries all attend to position pos - 4: only 3 later queries
    ev = SinkEvidence(torch.ones(1, pos, dtype=torch.bool), n_layers=1)
    ev.add_pattern(late)
    assert ev.mask()[0].nonzero().flatten().tolist() == [0]
    assert SINK_MIN_QUERIES > 3


def test_one_massive_layer_is_a_crossing_not_a_sink():
    ev = SinkEvidence(torch.ones(2, 6, dtype=torch.bool), n_layers=6)
    for layer in range(6):
        x = torch.ones(2, 6, 16)
        x[:, 0, 1] = 5000.0  # the first token, every layer: persistent
        if layer == 1:
            x[:, 2:5, 9] = 3000.0  # ordinary tokens, one early layer
        if layer >= 3:
            x[1, 5, 4] = 4000.0  # a later position massive from layer 3 to the end: 3 of 6 layers
        ev.add_resid(layer, x)
    assert ev.mask().tolist() == [[True, False, False, False, False, False],
                                  [True, False, False, False, False, True]]
    strict = copy.copy(ev)  # the same evidence, judged by a stricter rule
    strict.rule = SinkRule(persistence=0.9)
    assert strict.mask()[:, 5].tolist() == [False, False]


@pytest.mark.parametrize("kwargs", [dict(head_share=0), dict(threshold=1.0), dict(persistence=1.5),
                                    dict(min_layers=0), dict(min_queries=True)])
def test_bad_rule(kwargs):
    with pytest.raises(MassiveLensError, match="SinkRule"):
        SinkRule(**kwargs)


# --------------------------------------------------------------------------- a planted trap: brief crossings


@pytest.fixture(scope="module", params=FAMILIES)
def brief(request):
    """A tiny model of each family with the planted trap (see ``planting.plant_brief``)."""
    return plant_brief(tiny_model(request.param))


def _texts(model, n: int = 2, seq_len: int = 64, offset: int = 0) -> torch.Tensor:
    return bos_tokens(model, TEXT, seq_len, n, offset)


def test_the_trap_is_set(brief):
    """The ordinary letter is massive at layer 0, and only there; the first token at every layer."""
    tokens = _texts(brief, 1, 80)
    frame = find_massive(brief, tokens).to_frame()
    words = frame[frame["dim"] == BRIEF_DIM]
    assert set(words["layer"]) == {0} and sorted(words["pos"]) == (tokens[0] == WORD).nonzero().flatten().tolist()
    assert len(words) >= 10 and set(words["token_kind"]) <= {"other", "first"}
    bos = frame[(frame["dim"] == SINK_DIM) & (frame["pos"] == 0)]
    assert sorted(bos["layer"]) == list(range(brief.cfg.n_layers))


def test_find_sinks_finds_the_first_token_only(brief):
    with untouched(brief):
        found = find_sinks(brief, _texts(brief))
    assert found.mask[:, 0].all() and not found.mask[:, 1:].any()
    assert found.by_massive[:, 0].all() and found.kind_counts == {"bos": 2}
    assert found.describe() == "1 per sequence: bos 2"
    assert found.to_frame()[["seq", "pos", "token_kind"]].values.tolist() == [[0, 0, "bos"], [1, 0, "bos"]]


def test_analyses_report_the_sinks_they_used(brief):
    texts = _texts(brief)
    with untouched(brief):
        attention = sink_attention(brief, texts)
        decomposition = decompose_attention(brief, texts)
    for result in (attention, decomposition):
        assert result.sinks.mask[:, 0].all() and not result.sinks.mask[:, 1:].any()
        assert "1 per sequence: bos 2" in result.summary()
    assert torch.equal(decomposition.sink_mask, decomposition.sinks.mask)
    assert decomposition.reconstruction_error < 1e-4


def test_calibration_and_interventions_use_the_first_token_only(brief):
    calib = calibrate(brief, _texts(brief, 4, 48, offset=300), progress=False)
    assert set(calib.dims_at[0].tolist()) == {SINK_DIM, BRIEF_DIM}  # both are massive activations ...
    assert calib.massive_layers[BRIEF_DIM] == {0}
    assert calib.sinks.mask[:, 0].all() and not calib.sinks.mask[:, 1:].any()  # ... only one makes a sink
    assert calib.sink_first and calib.sink_layer == -1 and (calib.online_missed, calib.online_extra) == (0, 0)
    assert calib.attn_layers == tuple(range(1, brief.cfg.n_layers))
    assert "1 per sequence: bos 4" in calib.summary()
    tokens = _texts(brief, 1, 60)
    for build in (fix_sink_term, remove_sink_attention, bias_surgery, observe):
        iv = build(brief, calibration=calib)
        with untouched(brief), iv:
            brief(tokens)
        used = iv.record.sinks[0]
        assert used[0].nonzero().flatten().tolist() == [0], (iv.name, used)
    assert int((tokens == WORD).sum()) >= 5


def test_table_names_the_sinks_it_used(brief):
    with untouched(brief):
        table = run_interventions(brief, _texts(brief, 4, 48), calibration=_texts(brief, 4, 48, offset=300),
                                  batch_size=2, progress=False,
                                  settings=["original", "sink_term_mean", "sink_attention_removed"])
    frame = table.to_frame().set_index("setting")
    assert (frame["sinks_per_seq"] == 1.0).all() and (frame["sink_kinds"] == "bos 4").all()
    assert table.sinks.mask[:, 0].all() and not table.sinks.mask[:, 1:].any()
    assert "sinks (positions that draw attention as sinks" in table.summary()
    assert "1 per sequence: bos 4" in table.summary()


def test_given_sinks(brief):
    """sinks= overrides the online rule; a mask of the wrong shape is refused with a clear message."""
    calib = calibrate(brief, _texts(brief, 2, 32, offset=300), progress=False)
    tokens = _texts(brief, 1, 20)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[0, [0, 3]] = True
    iv = remove_sink_attention(brief, calibration=calib, sinks=SinkSet(mask, torch.zeros_like(tokens), "given"))
    with iv:
        brief(tokens)
    assert iv.record.sinks[0][0].nonzero().flatten().tolist() == [0, 3]
    positions = remove_sink_attention(brief, calibration=calib, sinks=[0, 5])
    with positions:
        brief(tokens)
    assert positions.record.sinks[0][0].nonzero().flatten().tolist() == [0, 5]
    with pytest.raises(MassiveLensError, match="sinks= was given for"), remove_sink_attention(
            brief, calibration=calib, sinks=mask[:, :5]):
        brief(tokens)
    with pytest.raises(MassiveLensError, match="bool"):
        fix_sink_term(brief, calibration=calib, sinks=torch.zeros(1, 3))


def test_sink_set_kinds():
    kinds = torch.tensor([[TOKEN_KINDS.index("bos"), TOKEN_KINDS.index("delimiter"), 3]])
    s = SinkSet(torch.tensor([[True, True, False]]), kinds, "given")
    assert s.kind_counts == {"bos": 1, "delimiter": 1} and s.kinds_text == "bos 1, delimiter 1"
    assert s.per_seq.tolist() == [2]


@pytest.mark.slow
def test_default_model_sinks(default_model):
    """On the real default model the sink is the first token, by both criteria, in every text."""
    texts = ["The history of the city begins in the Roman era, when a fort stood by the river. It grew.",
             "Photosynthesis converts light into chemical energy, stored in sugar molecules; plants need it."]
    with untouched(default_model):
        found = find_sinks(default_model, texts)
    assert found.mask[:, 0].all() and found.by_attention[:, 0].all() and found.by_massive[:, 0].all()
    assert set(found.kind_counts) <= {"bos", "first", "delimiter"}


def test_a_sink_set_keeps_the_result_contract():
    """SinkSet is public (find_sinks, table.sinks): it summarizes, draws and tabulates."""
    import matplotlib.axes
    import torch

    from massive_lens.attention.sinks import SinkSet

    s = SinkSet(torch.tensor([[True, False, True], [True, False, False]]), torch.tensor([[0, 3, 2], [0, 3, 3]]),
                "given")
    assert s.summary() == "sinks (given): 1-2 per sequence (mean 1.5): bos 2, delimiter 1"
    ax = s.plot()
    assert isinstance(ax, matplotlib.axes.Axes) and [p.get_height() for p in ax.patches] == [2, 1]
    assert s.to_frame()[["seq", "pos", "token_kind"]].values.tolist() == [[0, 0, "bos"], [0, 2, "delimiter"],
                                                                         [1, 0, "bos"]]


@pytest.mark.parametrize("n", [3, 70, 150, 600])
def test_key_attention_matches_the_banded_mean_it_stands_for(n):
    gen = torch.Generator().manual_seed(n)
    pattern = torch.rand(2, 3, n, n, generator=gen).tril().to(torch.bfloat16)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, n - n // 3:] = False  # right padding in the second sequence
    q, k = torch.arange(n)[:, None], torch.arange(n)[None]
    band = ((q > k) & (q <= k + SINK_QUERIES)).float()[None, None] * valid[:, None, :, None]
    count = band[:, 0].sum(1)
    expected = (pattern.float() * band).sum(2) / count.clamp(min=1)[:, None]
    mass, got_count = key_attention(pattern, valid)
    torch.testing.assert_close(got_count, count)
    torch.testing.assert_close(mass, expected, rtol=1e-5, atol=1e-6)
