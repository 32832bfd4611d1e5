"""Token-specific massive activations vs outlier dimensions, and the headline, on a planted model.

``plant_story`` (tests/planting.py) plants both phenomena in one tiny pre-norm model: BOS's
``SINK_DIM`` grows over three MLPs to its peak and is then cut (token-specific), while
``OUTLIER_DIM`` is massive at every token but BOS in the first layers (an outlier dimension).
"""

from __future__ import annotations

import pandas as pd
import pytest
from helpers import untouched
from planting import GROWTH, OUTLIER_DIM, OUTLIER_END, SINK_DIM, TEXT, plant_story

from massive_lens import find_massive, scan_corpus, tiny_model
from massive_lens.core.criterion import OUTLIER_DIM_MIN_TOKENS, OUTLIER_DIM_SHARE, outlier_dims
from massive_lens.detect import LayerProfile

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
    assert set(zip(token.pos, token.dim)) == {(0, SINK_DIM)}
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
    text = LayerProfile(frame, "m", 3).summary()
    assert "top-1 is largest at layer 2 with 2,000.0" in text
    assert "top-1/median peaks at layer 0 (50,000x" in text
    same = LayerProfile(frame.assign(ratio_mean=[1.0, 2.0, 3.0]), "m", 3).summary()
    assert "peaks at" not in same
