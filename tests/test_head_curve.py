"""head_curve on the planted dormant heads of test_dormant: zeroing exactly the planted heads
(dormant-first) leaves perplexity where it was, zeroing as many random heads does not."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from test_census import N_LAYERS, TEXTS, _tokens
from test_dormant import plant_dormant

from massive_lens import tiny_model
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import head_curve

# float32 quantities re-derived here in another order agree to a few float32 ulps, never to 1e-9
F32_REL = 16 * torch.finfo(torch.float32).eps

OTHER = ["The river ran past the old mill and into the town.", "A bird sang in the tall tree near the school.",
         "The market opened early and the bakers sold bread.", "Snow fell on the hills through the long night."]


@pytest.fixture(scope="module")
def planted():
    model = tiny_model("llama", num_hidden_layers=N_LAYERS)
    return model, plant_dormant(model)


def test_dormant_first_zeroes_the_planted_heads_and_keeps_perplexity(planted):
    model, expected = planted
    n_heads = N_LAYERS * model.cfg.n_heads
    with untouched(model):
        curve = head_curve(model, _tokens(model, TEXTS), calibration=_tokens(model, OTHER),
                           shares=(len(expected) / n_heads,), draws=3)
    frame = curve.to_frame()
    dormant = frame[frame.order == "dormant"].iloc[0]
    assert dormant.heads == " ".join(f"{layer}.{head}" for layer, head in expected)
    assert dormant.ratio == pytest.approx(1.0, abs=0.01)
    random = frame[frame.order == "random"]
    assert len(random) == 3 and (random.n_heads == len(expected)).all()
    assert abs(random.ratio - 1).mean() > 5 * abs(dormant.ratio - 1)
    curve_rows = curve.curve()
    assert set(curve_rows.order) == {"dormant", "random"} and (curve_rows.low <= curve_rows.high).all()
    assert f"{len(expected)})" in curve.summary() and "random (3 draws, geometric mean)" in curve.summary()


@pytest.mark.parametrize(("options", "expected"), [
    (dict(shares=()), "shares must be non-empty"), (dict(shares=(1.5,)), "in \\(0, 1\\]"),
    (dict(draws=0), "draws >= 1"),
])
def test_bad_options_are_refused(planted, options, expected):
    model, _ = planted
    with pytest.raises(MassiveLensError, match=expected):
        head_curve(model, _tokens(model, TEXTS), calibration=_tokens(model, OTHER), **options)


def test_the_same_text_for_ranking_and_evaluation_is_refused(planted):
    model, _ = planted
    with pytest.raises(MassiveLensError, match="rank the heads on other text"):
        head_curve(model, _tokens(model, TEXTS), calibration=_tokens(model, TEXTS))


def test_every_order_ranks_on_the_calibration_text_and_best_pairs_them(planted):
    """The sink-score, activation-norm and weight-magnitude orders, checked against the dormant
    frame and W_O computed here; the planted dormant heads (silent values) come first by activation
    norm; best() names the lowest order with a paired interval."""
    from massive_lens.attention.dormant import dormant_heads
    from massive_lens.interventions.heads import ORDERS, head_order

    model, expected = planted
    calib = _tokens(model, OTHER)
    found = dormant_heads(model, calib).to_frame().groupby(["layer", "head"])[["sink_mass", "out_norm"]].mean()
    ranked = {order: head_order(model, dormant_heads(model, calib), order) for order in ORDERS[:-1]}
    assert sorted(ranked["activation"][:len(expected)]) == expected
    sink = [found.loc[h, "sink_mass"] for h in ranked["sink"]]
    assert sink == sorted(sink, reverse=True)
    weight = [float(model.blocks[layer].attn.W_O[head].detach().norm()) for layer, head in ranked["weight"]]
    assert weight == pytest.approx(sorted(weight), rel=F32_REL)
    n_heads = N_LAYERS * model.cfg.n_heads
    with untouched(model):
        curve = head_curve(model, _tokens(model, TEXTS), calibration=calib, shares=(len(expected) / n_heads, 0.5),
                           draws=1, orders=ORDERS)
    assert set(curve.to_frame().order) == set(ORDERS)
    assert len(curve.per_seq) == 4 * 2 * len(TEXTS)  # four ranked orders, two shares, every sequence
    best = curve.best()
    assert len(best) == 2 and (best.low <= best.ratio).all() and (best.ratio <= best.high).all()
    frame = curve.to_frame().set_index(["order", "share"])
    for b in best.itertuples():  # the lowest ranked order, its ratio to the runner-up's from the frame's ratios
        ratios = frame.xs(b.share, level="share").drop("random").ratio
        assert b.order == ratios.idxmin() and b.runner_up == ratios.drop(b.order).idxmin()
        # a paired ratio of float32 losses against the ratio of two ratios of the same losses: float32 precision
        assert b.ratio == pytest.approx(ratios[b.order] / ratios[b.runner_up], rel=F32_REL)
    assert "paired ratio" in curve.summary() and "sink-score-first" in curve.summary()
    with pytest.raises(MassiveLensError, match="orders must be"):
        head_curve(model, _tokens(model, TEXTS), calibration=calib, orders=("magnitude",))
