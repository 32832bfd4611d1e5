"""Detection: exact answers on planted models, relations on the real default model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import plant_massive, untouched

from massive_lens import Criterion, MassiveLensError, find_massive, layer_profile, scan_corpus, tiny_model
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import TOKEN_KINDS

PRE_NORM = ("llama", "gpt2", "qwen2")


@pytest.fixture(params=PRE_NORM)
def planted_bos(request):
    """A tiny pre-norm model whose layer-1 MLP writes 500 into dim 11 at BOS."""
    model = tiny_model(request.param)
    bos = model.tokenizer.bos_token_id
    plant_massive(model, layer=1, neuron=7, dim=11, value=500.0, trigger=bos, trigger_dim=40)
    return model


def test_planted_entry_found_exactly(planted_bos):
    with untouched(planted_bos):
        found = find_massive(planted_bos, "Hi. there, you", prepend_bos=True)
    frame = found.to_frame()
    assert found.dims == (11,) and found.positions == (0,)
    assert found.layers == tuple(range(1, planted_bos.cfg.n_layers))  # born in layer 1, carried on
    assert set(frame.token_kind) == {"bos"}
    born = frame[frame.layer == 1].iloc[0]
    assert born.value == pytest.approx(500.0, rel=0.05)  # 500 planted + the tiny rest of the stream
    assert born.ratio > 1000


def test_thresholds_are_both_respected(planted_bos):
    found = find_massive(planted_bos, "Hi.", prepend_bos=True).to_frame()
    assert find_massive(planted_bos, "Hi.", criterion=Criterion(abs_threshold=600), prepend_bos=True).to_frame().empty
    top = float(found.ratio.max())
    strict = find_massive(planted_bos, "Hi.", criterion=Criterion(ratio_threshold=top * 1.01), prepend_bos=True)
    assert strict.to_frame().empty
    middle = find_massive(planted_bos, "Hi.", criterion=Criterion(ratio_threshold=float(found.ratio.median())),
                          prepend_bos=True)
    assert 0 < len(middle.to_frame()) < len(found)
    lowered = find_massive(planted_bos, "Hi.", criterion=Criterion(abs_threshold=1.0, ratio_threshold=5),
                           prepend_bos=True)
    assert len(lowered.to_frame()) > len(found)


def test_padding_never_counts(planted_bos):
    """A padded batch gives each text what it gives alone; pads are ignored."""
    texts = ["Hi. there, you are here", "Yo"]
    batch = find_massive(planted_bos, texts, prepend_bos=True).to_frame()
    assert set(batch.seq) == {0, 1}
    for i, text in enumerate(texts):
        alone = find_massive(planted_bos, text, prepend_bos=True).to_frame()
        mine = batch[batch.seq == i].drop(columns="seq").reset_index(drop=True)
        assert mine[["layer", "pos", "dim"]].equals(alone.drop(columns="seq")[["layer", "pos", "dim"]])
        assert torch.allclose(torch.tensor(mine.value.values), torch.tensor(alone.value.values), rtol=1e-4)


def test_pads_equal_to_trigger_are_not_massive():
    model = tiny_model("llama")
    pad = model.tokenizer.pad_token_id
    plant_massive(model, layer=1, neuron=7, dim=11, value=500.0, trigger=pad, trigger_dim=40)
    found = find_massive(model, ["a long enough text", "ab"])
    assert found.to_frame().empty  # the trigger only ever appears as padding
    as_token = find_massive(model, torch.tensor([[72, pad, 105]]))  # unpadded ids: the pad id is a real token
    assert as_token.dims == (11,) and as_token.positions == (1,)  # so the plant fires where it is one


def test_token_kinds():
    view = ModelView(tiny_model("llama"))
    batch = view.tokenize(["Hi. you,\nme", "Ok"], prepend_bos=True)
    kinds = [TOKEN_KINDS[k] for k in view.token_kinds(batch)[0].tolist()]
    tokens = view.str_tokens(batch)[0]
    assert kinds[:2] == ["bos", "first"]
    for token, kind in zip(tokens[2:], kinds[2:], strict=True):
        assert (kind == "delimiter") == (token in {".", ",", "\n"}), token
    no_bos = view.tokenize("Hi.", prepend_bos=False)
    assert TOKEN_KINDS[int(view.token_kinds(no_bos)[0, 0])] == "first"


def test_bad_input():
    model = tiny_model("gpt2")
    with untouched(model):
        for bad in ("", [], ["ok", ""]):
            with pytest.raises(MassiveLensError, match="empty"):
                find_massive(model, bad)
        with pytest.raises(MassiveLensError, match="context"):
            find_massive(model, "x" * (model.cfg.n_ctx + 5))
        with pytest.raises(MassiveLensError, match="hook"):
            find_massive(model, "hi", hook="mlp_out")
        with pytest.raises(MassiveLensError, match="layer"):
            find_massive(model, "hi", layers=[99])
    for kwargs in (dict(abs_threshold=-1), dict(ratio_threshold=0.5), dict(abs_threshold=math.nan),
                   dict(median_over="mean"), dict(abs_threshold=0, ratio_threshold=1)):
        with pytest.raises(MassiveLensError):
            Criterion(**kwargs)
    with pytest.raises(MassiveLensError, match="not a TransformerLens model"):
        find_massive(object(), "hi")


def test_model_unchanged_when_a_hook_raises(monkeypatch):
    """An error inside the forward pass still removes our hooks."""
    model = tiny_model("llama")
    assert "no massive activations" in find_massive(model, "Hi.").summary()
    with untouched(model), pytest.raises(MassiveLensError, match="token ids"):
        find_massive(model, torch.tensor([[1, 2, 10**6]]))

    def fail(self, layer, resid):
        if layer == 2:
            raise RuntimeError("boom in layer 2")

    with untouched(model):
        monkeypatch.setattr("massive_lens.core.reduce.ResidualReducer._reduce", fail)
        with pytest.raises(RuntimeError, match="boom"):
            find_massive(model, "Hi.")
        monkeypatch.undo()
    assert find_massive(model, "still works").to_frame().empty


def test_half_precision_warns_with_numbers():
    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=7, dim=11, value=3000.0, trigger=model.tokenizer.bos_token_id, trigger_dim=40)
    with pytest.warns(UserWarning, match="resolves steps of"):
        find_massive(model.to(torch.bfloat16), "Hi.")


def test_layer_profile_and_scan(planted_bos):
    with untouched(planted_bos):
        profile = layer_profile(planted_bos, ["Hi. there", "One more text"], k=2, prepend_bos=True).to_frame()
        scan = scan_corpus(planted_bos, ["Some prose. More, prose.\n" * 40], seq_len=32, batch_size=2,
                           prepend_bos=True, progress=False)
    assert list(profile.layer) == list(range(planted_bos.cfg.n_layers))
    assert (profile.top1_mean[1:] > 400).all() and (profile.top1_mean >= profile.top2_mean).all()
    assert profile.top1_std[1:].max() < 1.0  # the planted value is input-independent
    freq = scan.to_frame().set_index(["dim", "token_kind"])
    assert freq.loc[(11, "bos"), "frequency"] == 1.0 and freq.loc[(11, "bos"), "first_layer"] == 1
    assert set(scan.to_frame().dim) == {11}
    assert scan.n_tokens == scan.n_sequences * 32
    assert "dim 11 at bos: 100%" in scan.summary()


def test_profile_has_one_schema(planted_bos):
    """``.profile`` is layer_profile's per-layer table on every result that has one."""
    texts = ["Hi. there", "One more text"]
    with untouched(planted_bos):
        found = find_massive(planted_bos, texts, prepend_bos=True)
        expected = layer_profile(planted_bos, texts, k=1, prepend_bos=True).to_frame()
        scan = scan_corpus(planted_bos, ["Some prose. More, prose.\n" * 8], seq_len=32, k=1, prepend_bos=True,
                           progress=False)
    assert list(found.profile.columns) == list(expected.columns) == list(scan.profile.columns)
    assert found.profile.to_numpy() == pytest.approx(expected.to_numpy(), rel=1e-4, abs=1e-6)
    per_seq = found.magnitudes  # one row per (seq, layer)
    assert list(per_seq.columns) == ["seq", "layer", "top1", "median"] and len(per_seq) == 2 * len(expected)


@pytest.mark.slow
def test_default_model_matches_plain_transformers(default_model):
    """find_massive's values equal an output_hidden_states run of the wrapped HF model."""
    text = "The quick brown fox. It jumps over the lazy dog."
    found = find_massive(default_model, text)
    assert not found.to_frame().empty, "the default model should carry massive activations"
    tokens = default_model.to_tokens(text)
    with torch.no_grad():
        hidden = default_model.original_model(tokens, output_hidden_states=True).hidden_states
    n_layers = default_model.cfg.n_layers
    for row in found.to_frame().itertuples():
        if row.layer < n_layers - 1:  # HF's last hidden state is after the final norm
            expected = float(hidden[row.layer + 1][0, row.pos, row.dim])
            assert row.value == pytest.approx(expected, rel=1e-3)
    # the biggest entry is massive by a wide margin on the first token, and recurs in the scan
    top = found.by_dim().iloc[0]
    assert top.pos == 0 and top.ratio > 1000
    scan = scan_corpus(default_model, seq_len=64, max_tokens=512, progress=False).to_frame()
    row = scan[(scan.dim == top.dim) & (scan.token_kind == top.token_kind)]
    assert float(row.frequency.iloc[0]) == 1.0
