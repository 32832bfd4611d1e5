"""Vision transformers: the analyses on images (``pixel_values``), checked exact against plain
transformers on tiny planted ViTs and DeiTs (``matrix.build``: a neuron of block
``PLANT_LAYER`` writes ``VALUE`` into ``DIM`` at ``[CLS]``), the token kinds, the patch-grid
figure, loading, and the clear errors for inputs of the wrong kind."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers as tf
from helpers import untouched
from matrix import DIM, PLANT_LAYER, VALUE, build
from matrix_vit import VISION_SHAPE, images

from massive_lens import (
    MassiveLensError,
    decompose_attention,
    find_massive,
    layer_profile,
    load_model,
    perplexity,
    scan_corpus,
    sink_attention,
    tiny_model,
    trace_origin,
)
from massive_lens.core.criterion import Criterion, massive_mask, median_scale
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.viz import capture_one, patch_map

ARCHS = ("ViTModel", "DeiTForImageClassification")


pytestmark = [pytest.mark.usefixtures("free_matrix_models"), pytest.mark.heavy]  # heavy: not in make check


@pytest.fixture(scope="module", params=ARCHS)
def planted(request):
    b = build(request.param)
    assert b.planted == "neuron"
    return b


def _hidden(b, pixels):
    with torch.no_grad():
        return b.ref(pixels, output_hidden_states=True).hidden_states  # [embeddings, block 0, ...]


def test_kinds_and_labels(planted):
    view = ModelView(planted.model)
    batch = view.tokenize(images(2))
    kinds = [view.token_kinds(batch)[1, p] for p in range(batch.tokens.shape[1])]
    labels = view.str_tokens(batch)[1]
    deit = planted.arch.startswith("DeiT")
    assert labels[:3] == (["[CLS]", "[DIST]", "patch 0,0"] if deit else ["[CLS]", "patch 0,0", "patch 0,1"])
    assert labels[-1] == "patch 3,3" and len(labels) == batch.tokens.shape[1] == (18 if deit else 17)
    second = "register" if deit else "patch"  # DeiT's distillation token counts as a register
    assert [TOKEN_KINDS[int(k)] for k in kinds[:3]] == ["cls", second, "patch"]


def test_find_massive_matches_transformers(planted):
    pixels = images(3, seed=5)
    criterion = Criterion()
    with untouched(planted.model):
        found = find_massive(planted.model, pixels, criterion=criterion)
    hidden = _hidden(planted, pixels)
    expected = {}
    for layer in range(len(hidden) - 2):  # the last hidden state is the same; check the blocks before it
        h = hidden[layer + 1]
        for seq, pos, dim in massive_mask(h, criterion).nonzero().tolist():
            expected[seq, layer, pos, dim] = float(h[seq, pos, dim])
    frame = found.to_frame()
    got = {(r.seq, r.layer, r.pos, r.dim): r.value for r in frame.itertuples() if r.layer < len(hidden) - 2}
    assert set(got) == set(expected) and (0, PLANT_LAYER, 0, DIM) in got
    assert all(math.isclose(got[k], v, rel_tol=1e-5) for k, v in expected.items())
    assert set(frame[frame.pos == 0].token_kind) == {"cls"} and set(frame[frame.pos == 0].token) == {"[CLS]"}
    assert math.isclose(got[0, PLANT_LAYER, 0, DIM], VALUE, rel_tol=1e-2)


def test_layer_profile_matches_transformers(planted):
    pixels = images(3, seed=6)
    with untouched(planted.model):
        frame = layer_profile(planted.model, pixels, k=2, batch_size=2).to_frame()  # two passes
    for layer, h in enumerate(_hidden(planted, pixels)[1:-1]):
        mag = h.abs()
        top = mag.flatten(1).topk(2).values
        _, median = median_scale(mag, Criterion())
        row = frame[frame.layer == layer].iloc[0]
        assert math.isclose(row.top1_mean, float(top[:, 0].mean()), rel_tol=1e-5)
        assert math.isclose(row.top2_mean, float(top[:, 1].mean()), rel_tol=1e-5)
        assert math.isclose(row.median_mean, float(median.mean()), rel_tol=1e-5)


def test_trace_origin_on_an_image(planted):
    with untouched(planted.model):
        trace = trace_origin(planted.model, planted.tokens[0])  # one image, without the batch dim
    assert trace.reconstruction_error < 1e-5
    target = trace.targets.iloc[0]
    assert (target.pos, target.dim, target.token, target.token_kind) == (0, DIM, "[CLS]", "cls")
    births = trace.births
    assert ((births.component == "mlp") & (births.layer == PLANT_LAYER)).any()
    neurons = trace.neurons[trace.neurons.layer == PLANT_LAYER]
    assert 5 in neurons.neuron.tolist()  # matrix.NEURON


def test_a_value_born_in_the_embedding_is_told_without_heads():
    model = tiny_model("vit")
    with torch.no_grad():
        model.embed.original_component.cls_token[0, 0, DIM] = 3000.0  # [CLS] carries it from the start
    text = trace_origin(model, images(1, seed=0)[0]).summary()
    assert "born in embed to 3,000" in text and "head" not in text  # an embedding has no heads


def test_sink_attention_matches_transformers(planted):
    pixels = images(2, seed=7)
    with untouched(planted.model):
        result = sink_attention(planted.model, pixels)  # sinks found: [CLS] carries the massive value
    assert result.sinks.kind_counts == {"cls": 2}
    with torch.no_grad():
        attentions = planted.ref(pixels, output_attentions=True).attentions
    frame = result.to_frame()
    for layer, pattern in enumerate(attentions):
        mass = pattern[:, :, 1:, 0].mean((0, 2))  # non-sink queries' attention to [CLS], per head
        got = torch.tensor(frame[frame.layer == layer].sink_mass.to_numpy(), dtype=torch.float32)
        assert torch.allclose(got, mass, atol=1e-5)


def test_decompose_attention_on_images(planted):
    with untouched(planted.model):
        result = decompose_attention(planted.model, images(2, seed=8), sinks=[0])
    assert result.reconstruction_error < 1e-5
    assert result.sink.shape[1:3] == (2, ModelView(planted.model).image_layout.n_positions)


def test_patch_map(planted):
    with untouched(planted.model):
        ax = patch_map(planted.model, planted.tokens)
        sink_ax = patch_map(planted.model, planted.tokens, layer=1, what="sink")
    grid = ax.get_images()[0].get_array()
    peak = find_massive(planted.model, planted.tokens).peak_layer
    assert grid.shape == (4, 4) and ax.get_title().endswith(f"|dim {DIM}| at layer {peak}")
    strip = ax.child_axes[0]
    assert strip.get_images()[0].get_array().max() > 100 * grid.max()  # [CLS] shown apart, massive
    assert sink_ax.get_images()[0].get_array().shape == (4, 4)


@pytest.mark.parametrize("call, words", [
    (lambda m: find_massive(m, "a text"), "reads images, not text"),
    (lambda m: find_massive(m, torch.tensor([[1, 2, 3]])), "reads images, not token ids"),
    (lambda m: find_massive(m, torch.rand(1, 3, 16, 32)), "must be [batch, 3, 32, 32]"),
    (lambda m: find_massive(m, torch.rand(1, 1, 32, 32)), "must be [batch, 3, 32, 32]"),
    (lambda m: layer_profile(m, torch.rand(2, 32, 32)), "must be [batch, 3, 32, 32]"),
    (lambda m: find_massive(m, torch.full((1, 3, 32, 32), float("nan"))), "NaN or inf"),
    (lambda m: trace_origin(m, torch.rand(2, 3, 32, 32)), "one text"),
    (lambda m: perplexity(m, progress=False), "do not apply"),
    (lambda m: perplexity(m, torch.rand(2, 3, 32, 32), progress=False), "do not apply"),
    (lambda m: scan_corpus(m, progress=False), "do not apply"),
    (lambda m: patch_map(m, torch.rand(3, 32, 32), what="text"), "what must be one of"),
    (lambda m: trace_origin(m, torch.rand(3, 32, 32), verify=True), "verify=True) is not supported for images"),
])
def test_bad_inputs_to_a_vit(call, words):
    model = tiny_model("vit", num_hidden_layers=2)
    with untouched(model), pytest.raises(MassiveLensError) as err:
        call(model)
    assert words in str(err.value) and "tiny-vit" in str(err.value)


@pytest.mark.parametrize("inputs", [torch.rand(2, 3, 32, 32), torch.rand(3, 32, 32)])
def test_images_to_a_text_model(inputs):
    model = tiny_model("gpt2")
    with untouched(model), pytest.raises(MassiveLensError, match="tiny-gpt2 is a text model"):
        find_massive(model, inputs)
    with pytest.raises(MassiveLensError, match="text model"):
        patch_map(model, torch.rand(3, 32, 32))


@pytest.mark.parametrize("cls", [tf.ViTForImageClassification, tf.DeiTModel])
def test_load_saved_folder_and_hf_model(tmp_path, cls):
    """A ViT saved with save_pretrained loads through the bridge offline (the path a hub id like
    google/vit-base-patch16-224 takes), and a Hugging Face ViT object is wrapped, no tokenizer."""
    torch.manual_seed(0)
    hf = cls(cls.config_class(num_hidden_layers=2, **VISION_SHAPE)).eval()
    hf.save_pretrained(tmp_path / "vit")
    pixels = images(1)
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states[1]
    loaded = load_model(tmp_path / "vit")
    assert loaded.cfg.model_name == "vit" and ModelView(loaded).image_layout is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_model says it takes the model over
        wrapped = load_model(hf, name="my-vit")
    for model in (loaded, wrapped):
        resid, labels = capture_one(model, pixels, 0, "resid_post")
        assert torch.allclose(resid, expected[0], rtol=1e-5, atol=1e-6) and labels[0] == "[CLS]"

