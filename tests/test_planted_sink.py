"""A planted sink (issue 49): force_self_attention's exact pattern and its known answer under rotary
positions (the planted position's residual is the same token's residual as a first token),
shift_rotary_position against Hugging Face's own position_ids, planted_writers' split, the
contract (model left as found, hooks gone after an exception) and the refusals."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError, sink_census, tiny_model
from massive_lens.core.criterion import SinkRule
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import force_self_attention, planted_writers, shift_rotary_position, sink_strength

TEXT = "The cat sat on the mat. The dog ran, and the bird flew.\n" * 4
POS = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _patterns(model, tokens, hooks=()):
    view = ModelView(model)
    seen = {}
    keep = [(view.hook_name(layer, "attn.hook_pattern"),
             lambda x, hook, layer=layer: seen.__setitem__(layer, x.detach().clone()))
            for layer in range(view.n_layers)]
    view.forward(view.tokenize(tokens), [*hooks, *keep])
    return seen


def test_the_planted_row_is_all_on_itself_and_nothing_else_changes_up_to_the_plant(model):
    view = ModelView(model)
    tokens = view.tokenize(TEXT).tokens
    plant = [1, 2]
    with untouched(model):
        before = _patterns(model, tokens)
        with force_self_attention(model, POS, plant) as iv:
            after = _patterns(model, tokens)
    assert iv.layers == (1, 2) and not iv.active
    for layer in plant:
        row = after[layer][:, :, POS]
        assert torch.equal(row[..., POS], torch.ones_like(row[..., POS]))
        assert float(row.sum(-1).sub(1).abs().max()) == 0.0  # the rest of the row is exactly zero
    # layer 0 runs before the plant: bit-identical; at the planted layers the other rows up to pos
    # (which never read pos's later residual) are identical too
    assert torch.equal(before[0], after[0])
    for layer in plant:
        assert torch.equal(before[layer][:, :, :POS], after[layer][:, :, :POS])
    assert not torch.equal(before[3], after[3])  # downstream of the plant the row at pos reads a changed residual


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_planted_in_every_layer_pos_is_that_token_as_a_first_token(family):
    """Attending only to itself in every layer, under rotary positions (distance 0 to itself), the
    position's residual stream is exactly the same token's as the first token of a text: the known
    answer that makes it a copy of the model's own first token."""
    model = tiny_model(family)
    view = ModelView(model)
    tokens = view.tokenize(TEXT).tokens
    name = view.hook_name(view.n_layers - 1, "resid_post")
    with force_self_attention(model, POS, None):
        planted = view.activation(view.full_batch(tokens), name)[0, POS]
    alone = view.activation(view.full_batch(tokens[:, POS:]), name)[0, 0]
    plain = view.activation(view.full_batch(tokens), name)[0, POS]
    scale = float(alone.abs().max())
    assert float((planted - alone).abs().max()) <= 1e-5 * scale
    assert float((plain - alone).abs().max()) > 1e-2 * scale  # without the plant it is not


def test_census_on_the_planted_model(model):
    """On a random tiny model a sink need not emerge downstream of the plant; what is exact is that the
    census still runs under it on the eager path and judges pos with the plant's changed attention."""
    view = ModelView(model)
    tokens = view.tokenize(TEXT).tokens
    rule = SinkRule(threshold=0.05)
    before = sink_census(model, tokens, rule=rule, attention="eager").to_frame()
    with untouched(model), force_self_attention(model, POS, None):
        after = sink_census(model, tokens, rule=rule, attention="eager").to_frame()
    assert set(after["level"]) <= {"primary", "secondary", "transient"}
    assert not before.equals(after)


def test_shift_rotary_position_is_hugging_faces_position_ids():
    model = tiny_model("llama")
    view = ModelView(model)
    tokens = view.tokenize(TEXT).tokens
    hf = model.original_model
    for to in (3, -2):
        ids = torch.arange(tokens.shape[1])[None].clone()
        ids[0, 0] = to
        with torch.no_grad():
            expected = hf(tokens, position_ids=ids).logits
        with untouched(model), shift_rotary_position(model, 0, to), torch.no_grad():
            got = model(tokens)
        with torch.no_grad():
            plain = model(tokens)
        assert torch.allclose(got, expected, atol=1e-5)
        assert not torch.allclose(got, plain, atol=1e-4)


def test_planted_writers_split_adds_up_at_pos(model):
    with untouched(model), force_self_attention(model, POS, None):
        w = planted_writers(model, TEXT, pos=POS, n_heads=3, rule=SinkRule(threshold=0.01))
    assert len(w) and (w["pos"] == POS).all() and (w["check"] < 1e-4).all()
    assert all(d.split(" ")[0] in ("embed", "attn", "mlp") for d in w["dominant"])


def test_an_exception_inside_the_plant_leaves_no_hooks(model):
    with untouched(model):
        with pytest.raises(RuntimeError, match="boom"), force_self_attention(model, POS, [0]):
            raise RuntimeError("boom")
        # a text that ends before pos has nothing to plant: the pass is the plain one (perplexity probes
        # its first tokens under whatever is attached, and must run under a plant at a later position)
        short = ModelView(model).tokenize("Hi there").tokens
        with torch.no_grad():
            plain = model(short)
            with force_self_attention(model, 50, [0]):
                same = model(short)
        assert torch.equal(same, plain)
        with pytest.raises(MassiveLensError, match="needs at least"), shift_rotary_position(model, 0, 60):
            model(ModelView(model).tokenize("Hi there").tokens)


@pytest.mark.parametrize(("pos", "layers", "match"), [
    (0, None, "already attends only"), (-3, None, ">= 1"), (2.0, None, "must be an int"), (True, None, "an int"),
    (10**9, None, "out of range"), (3, [], "empty"), (3, [99], "layer 99 out of range"), (3, [1.5], "ints"),
    (3, "0", "ints"),
])
def test_bad_plants_are_refused(model, pos, layers, match):
    with pytest.raises(MassiveLensError, match=match):
        force_self_attention(model, pos, layers)


def test_bad_rotary_shifts_are_refused(model):
    with pytest.raises(MassiveLensError, match="no rotary cos/sin hooks"):
        shift_rotary_position(tiny_model("gpt2"), 0, 2)
    with pytest.raises(MassiveLensError, match="must be an int"):
        shift_rotary_position(model, 0, 1.5)
    with pytest.raises(MassiveLensError, match=">= 0"):
        shift_rotary_position(model, -1, 2)
    with pytest.raises(MassiveLensError, match="no sink|first token|more than"):
        planted_writers(model, TEXT, pos=POS)  # a random tiny model has no head over 0.3 on pos
    with pytest.raises(MassiveLensError, match="queries after"):
        planted_writers(model, "Hi", pos=POS)


def test_sink_strength_is_the_sink_metric_at_the_position(model):
    """Against the pattern read here: per head, the mean attention to pos of the queries after it
    (all of them: the text is shorter than 64 tokens after pos), the share of heads over the threshold."""
    view = ModelView(model)
    tokens = view.tokenize(TEXT[:60]).tokens
    assert tokens.shape[1] - POS - 1 <= 64
    patterns = _patterns(model, tokens)
    got = sink_strength(model, tokens, pos=[0, POS], threshold=0.05).set_index("pos")
    for p in (0, POS):
        per_head = torch.cat([patterns[layer][0, :, p + 1:, p].mean(-1) for layer in sorted(patterns)])
        assert got.loc[p, "strength"] == pytest.approx(float((per_head > 0.05).float().mean()), abs=1e-6)
        assert got.loc[p, "mass"] == pytest.approx(float(per_head.mean()), abs=1e-6)
        assert got.loc[p, "queries"] == tokens.shape[1] - p - 1
    with pytest.raises(MassiveLensError, match="past the end"):
        sink_strength(model, tokens, pos=10_000)
    with pytest.raises(MassiveLensError, match="threshold"):
        sink_strength(model, tokens, pos=0, threshold=1.5)
    with pytest.raises(MassiveLensError, match="position"):
        sink_strength(model, tokens, pos=-1)


def test_sink_strength_reads_either_path_alike_and_the_plant_on_the_eager_one(model, monkeypatch):
    """On the LSE path (a crossover within the tiny model's context) the same strengths as on the eager
    pattern; under the plant the pass takes the eager path (the kernel would skip the edit) at any length."""
    tokens = ["Hello there, world. " * 4, "The cat sat on the mat."]  # two lengths: a padded batch
    got = {}
    for crossover in (10_000, 4):
        monkeypatch.setattr("massive_lens.core.attention_pass.LSE_FROM", crossover)
        got["plain", crossover] = sink_strength(model, tokens, pos=[0, POS], threshold=0.05)
        with force_self_attention(model, POS):
            got["plant", crossover] = sink_strength(model, tokens, pos=[0, POS], threshold=0.05)
    for name in ("plain", "plant"):
        pd.testing.assert_frame_equal(got[name, 4], got[name, 10_000], rtol=1e-5, atol=1e-6)
    assert not got["plant", 4]["mass"].equals(got["plain", 4]["mass"])
