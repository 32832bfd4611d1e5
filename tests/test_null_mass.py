"""Null mass (issue 51): the attention to a learned sink logit or sink slot, per layer and head,
against transformers' own eager attention with sinks (gpt-oss) and the trained variants' patterns."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError, tiny_model
from massive_lens.attention.census import sink_census
from massive_lens.attention.mass import sink_attention
from massive_lens.attention.null_mass import SINK_LOGIT, null_mass, off_switch_layers
from massive_lens.core.attention_pass import attention_pass
from massive_lens.core.model_view import ModelView
from massive_lens.models import byte_tokenizer, wrap_hf_model
from massive_lens.models.tiny import tiny_config
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM

TEXTS = ["Hello there, how are you? Fine, thanks.", "Bye now."]
TOL = 1e-5  # attention shares in float32 (issue 51's bar)


def _gpt_oss(spread: float) -> tuple:
    """A tiny gpt-oss bridge and an independent eager Hugging Face copy (same weights), its sink
    logits drawn from N(0, spread) so that heads differ."""
    tok = byte_tokenizer()
    cls, config = tiny_config("gpt_oss", tok, {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = cls(config).eval()
        with torch.no_grad():
            for module in hf.modules():
                if hasattr(module, "sinks"):
                    module.sinks.normal_(0, spread)
    ref = cls(config).eval()
    ref.load_state_dict(hf.state_dict())
    ref.config._attn_implementation = "eager"
    return wrap_hf_model(hf, tok, name="tiny-gpt_oss"), ref


@pytest.fixture(scope="module")
def gpt_oss():
    return _gpt_oss(2.0)


def _reference(ref, model, texts) -> tuple[torch.Tensor, torch.Tensor]:
    """[layer head]: transformers' eager attention's null mass (one minus the keys' weights: it drops
    the sink's column after the softmax) and first-token weight, over the real queries after the first."""
    batch = ModelView(model).tokenize(texts)
    with torch.no_grad():
        weights = ref(batch.tokens, attention_mask=batch.mask.long(), output_attentions=True).attentions
    after = batch.mask.float().clone()
    after[:, 0] = 0
    null = torch.stack([torch.einsum("bhq,bq->h", 1 - w.sum(-1), after) for w in weights]) / after.sum()
    first = torch.stack([torch.einsum("bhq,bq->h", w[..., 0], after) for w in weights]) / after.sum()
    return null, first


@pytest.mark.parametrize("path", ["eager", "lse"])
@pytest.mark.parametrize("texts", [TEXTS[:1], TEXTS], ids=["one", "padded"])
def test_gpt_oss_equals_transformers_eager_with_sinks(gpt_oss, path, texts):
    model, ref = gpt_oss
    with untouched(model):
        result = null_mass(model, texts, attention=path)
    assert result.attention == path and result.kind == SINK_LOGIT
    frame = result.to_frame()
    null, first = _reference(ref, model, texts)
    got = torch.tensor(frame.null_mass.to_numpy(), dtype=torch.float32).view_as(null)
    assert (got - null).abs().max() < TOL
    assert (torch.tensor(frame.first_mass.to_numpy(), dtype=torch.float32).view_as(first) - first).abs().max() < TOL
    sinks = torch.stack([m.sinks.detach() for m in ref.modules() if hasattr(m, "sinks")])
    assert torch.equal(torch.tensor(frame.sink_logit.to_numpy(), dtype=torch.float32).view_as(sinks), sinks)


def test_null_mass_follows_the_sink_logit():
    """Raising every sink logit moves attention from the tokens to the slot (a relation, not a value)."""
    model, _ = _gpt_oss(0.0)
    low = null_mass(model, TEXTS[0]).to_frame()
    with torch.no_grad():
        for module in model.original_model.modules():
            if hasattr(module, "sinks"):
                module.sinks.fill_(8.0)
    high = null_mass(model, TEXTS[0]).to_frame()
    assert (high.null_mass > low.null_mass).all() and (high.first_mass < low.first_mass).all()
    assert null_mass(model, TEXTS[0]).where == "sink slot"


def _trained(variant: str, **options) -> MassiveLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        cfg = MassiveLMConfig(n_layers=2, d_model=32, n_heads=2, attention=dict(name=variant, **options))
        model = MassiveLM(cfg, byte_tokenizer()).eval()
        with torch.no_grad():  # slots and logits away from their initial values, so heads differ
            for name, p in model.named_parameters():
                if "slot" in name or "sink_logit" in name:
                    p.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("variant,options", [("softmax1", {}), ("softmax_n", {"n": 3}), ("learned_sink", {}),
                                             ("kv_bias", {}), ("k_bias", {})])
def test_slot_variants_against_their_patterns(variant, options):
    """The slot weights (hook_slot_pattern) against one minus the real keys' weights (hook_pattern):
    the softmax's rows sum to one; the sink logit against the variant's own parameter."""
    model = _trained(variant, **options)
    with untouched(model):
        result = null_mass(model, TEXTS)
    assert result.kind == variant and result.attention == "eager"
    view = ModelView(model)
    batch = view.tokenize(TEXTS)
    after = batch.mask.float().clone()
    after[:, 0] = 0
    frame = result.to_frame()
    for layer in range(model.cfg.n_layers):
        pattern = view.activation(batch, f"blocks.{layer}.attn.hook_pattern")
        want = torch.einsum("bhq,bq->h", 1 - pattern.sum(-1), after) / after.sum()
        got = torch.tensor(frame[frame.layer == layer].null_mass.to_numpy(), dtype=torch.float32)
        assert (got - want).abs().max() < TOL, (variant, layer)
        variant_module = model.blocks[layer].attn.variant
        logit = frame[frame.layer == layer].sink_logit
        if variant == "learned_sink":
            assert torch.equal(torch.tensor(logit.to_numpy(), dtype=torch.float32), variant_module.sink_logit[:, 0])
        elif variant in ("kv_bias", "k_bias"):
            assert logit.isna().all()  # a learned key: the slot's logit depends on the query


def test_off_switch_layers_names_the_kind():
    assert off_switch_layers(ModelView(tiny_model("llama"))) == ("", {})
    kind, layers = off_switch_layers(ModelView(_trained("learned_sink")))
    assert kind == "learned_sink" and sorted(layers) == [0, 1]


def test_refusals():
    with pytest.raises(MassiveLensError, match="no null slot.*sink_attention"):
        null_mass(tiny_model("llama"), "Hello.")
    model, _ = _gpt_oss(1.0)
    for bad in (0.0, 1.0, 1.5, float("inf")):  # the open interval (0, 1), core.checks' number rule
        with pytest.raises(MassiveLensError, match=r"threshold \(an attention share\) must be a"):
            null_mass(model, "Hello.", threshold=bad)
    with pytest.raises(MassiveLensError, match="no null slot.*sink_attention"):
        off_switch_layers(ModelView(tiny_model("llama")), required=True)
    with pytest.raises(MassiveLensError, match="trained here.*eager"):
        null_mass(_trained("softmax1"), "Hello.", attention="lse")


def test_result_round_trip(tmp_path):
    import massive_lens

    model, _ = _gpt_oss(1.0)
    result = null_mass(model, TEXTS)
    back = massive_lens.load(result.save(tmp_path / "null"))
    assert back.to_frame().equals(result.to_frame()) and back.summary() == result.summary()
    assert "null mass" in result.summary() and result.plot() is not None


def _per_head(frame) -> torch.Tensor:
    return torch.tensor(frame.sort_values(["layer", "head"]).null_mass.to_numpy(), dtype=torch.float32)


def _per_layer(census) -> torch.Tensor:
    return torch.tensor(census.by_layer.drop_duplicates("layer").sort_values("layer").null_mass.to_numpy())


@pytest.mark.parametrize("model_of", ["gpt_oss", "learned_sink"])
def test_sink_attention_and_census_carry_null_mass(gpt_oss, model_of):
    """Where the attention has a null slot, sink_attention's table gains null_mass per layer and head
    and sink_census's by_layer its mean over heads: null_mass()'s numbers, on every path, and the
    eager and LSE paths agree (the eager pattern misses exactly the sink's weight)."""
    model = gpt_oss[0] if model_of == "gpt_oss" else _trained("learned_sink")
    paths = ["eager", "lse"] if model_of == "gpt_oss" else ["eager"]
    seen = {}
    for path in paths:
        want = null_mass(model, TEXTS, attention=path).to_frame()
        with untouched(model):
            mass = sink_attention(model, TEXTS, attention=path)
            census = sink_census(model, TEXTS, attention=path, batch_size=1)  # pooled over two batches
        assert mass.null_kind == census.null_kind == off_switch_layers(ModelView(model))[0] != ""
        frame = mass.to_frame()
        assert list(frame.columns) == ["layer", "head", "sink_mass", "first_token_mass", "null_mass"]
        assert (_per_head(frame) - _per_head(want)).abs().max() < TOL
        layer_means = torch.tensor(want.groupby("layer").null_mass.mean().to_numpy())
        assert (_per_layer(census) - layer_means).abs().max() < TOL
        assert all(f"null mass ({r.null_kind})" in r.summary() for r in (mass, census))
        seen[path] = (_per_head(frame), _per_layer(census))
    if len(seen) == 2:
        assert all((a - b).abs().max() < TOL for a, b in zip(seen["eager"], seen["lse"], strict=True))


@pytest.mark.parametrize("path", ["eager", "lse"])
def test_no_null_column_without_a_slot(path):
    """A plain softmax attention: sink_attention's and sink_census's tables and summaries stay as they were."""
    model = tiny_model("llama")
    mass = sink_attention(model, TEXTS, attention=path)
    census = sink_census(model, TEXTS, attention=path)
    assert list(mass.to_frame().columns) == ["layer", "head", "sink_mass", "first_token_mass"]
    assert list(census.by_layer.columns) == ["layer", "level", "sinks", "sequences"]
    assert mass.null_kind == census.null_kind == ""
    assert "null mass" not in mass.summary() and "null mass" not in census.summary()


def test_null_columns_round_trip(gpt_oss, tmp_path):
    import massive_lens

    model = gpt_oss[0]
    for name, result in (("mass", sink_attention(model, TEXTS)), ("census", sink_census(model, TEXTS))):
        back = massive_lens.load(result.save(tmp_path / name))
        assert back.null_kind == result.null_kind and back.summary() == result.summary()


@pytest.mark.parametrize("texts", [TEXTS[0], TEXTS], ids=["one", "padded"])
def test_pass_hands_the_null_on_both_paths(gpt_oss, texts):
    """The attention pass hands each layer's null weight (want="null") whichever path ran: the kernel's
    exp(s - LSE) and one minus the eager pattern's keys' weights agree on every real query; without
    want="null" it hands none."""
    view = ModelView(gpt_oss[0])
    batch = view.tokenize(texts)
    null_from = dict.fromkeys(off_switch_layers(view)[1], "pattern")
    seen: dict = {}
    for path in ("eager", "lse"):
        got = seen.setdefault(path, {})
        attention_pass(view, batch, lambda at, got=got: got.__setitem__(at.layer, at.null), path=path,
                       want=("null",), null_from=null_from)
        plain: dict = {}
        attention_pass(view, batch, lambda at, plain=plain: plain.__setitem__(at.layer, at.null), path=path,
                       null_from=null_from)
        assert set(plain) == set(got) and all(null is None for null in plain.values())
    assert set(seen["eager"]) == set(seen["lse"]) >= set(null_from) != set()
    real = batch.mask[:, None, :]
    for layer in null_from:
        eager, lse = seen["eager"][layer], seen["lse"][layer]
        assert eager.shape == lse.shape and lse.shape[::2] == batch.mask.shape
        assert ((eager - lse).abs() * real).max() < TOL
        assert bool((lse.masked_select(real) > 0).all())


def test_pass_hands_the_slots_null():
    """A model trained with sink slots: the eager pass's null weight is the slots' weights summed
    (attn.hook_slot_pattern, read by the caller's own hook in the same forward); a null_from naming
    no source is refused."""
    model = _trained("kv_bias")
    view = ModelView(model)
    batch = view.tokenize(TEXTS)
    layers = off_switch_layers(view)[1]
    got: dict = {}
    slots: dict = {}
    hooks = [(view.hook_name(layer, "attn.hook_slot_pattern"),
              lambda act, hook, layer=layer: slots.__setitem__(layer, act.detach().sum(-1))) for layer in layers]
    attention_pass(view, batch, lambda at: got.__setitem__(at.layer, at.null), path="eager", want=("null",),
                   null_from=dict.fromkeys(layers, "slot_pattern"), hooks=hooks)
    assert set(slots) == set(layers) != set()
    for layer in layers:
        assert (got[layer] - slots[layer]).abs().max() < TOL and bool((got[layer] > 0).all())
    with pytest.raises(MassiveLensError, match="null_from"):
        attention_pass(view, batch, None, path="eager", want=("null",), null_from={0: "keys"})
