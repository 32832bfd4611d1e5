"""The LSE path (massive_lens.core.lse): attention on key columns and the sink rule's band from q, k
and the fused SDPA kernel's log-sum-exp, exact against the eager pattern; the analyses that use it
give the eager path's tables; the model is left as found; models that cannot are refused by name."""

from __future__ import annotations

import pytest
import torch

from massive_lens import tiny_model
from massive_lens.attention import decompose_attention, dormant_heads, find_sinks, sink_attention, sink_census
from massive_lens.core.criterion import SinkRule, key_attention
from massive_lens.core.lse import lse_run, lse_support
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

TOL = 1e-5
TEXTS = ["Hello there, world. The cat sat on the mat. " * 3, "Bye now."]  # padded: the second is short


def _patterns(view, batch):
    seen = {}
    hooks = [(view.hook_name(layer, "attn.hook_pattern"),
              lambda x, hook, layer=layer: seen.__setitem__(layer, x.float())) for layer in range(view.n_layers)]
    view.forward(batch, hooks)
    return seen


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3", "qwen2"])
def test_columns_and_band_match_the_pattern(family):
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXTS)
    got = {}
    with lse_run(view, lambda att: got.__setitem__(att.layer, (att.columns([0, 2, 5]), att.band(batch.mask)))) as seen:
        view.forward(batch, [])
    assert seen == set(range(view.n_layers))
    patterns = _patterns(view, batch)
    real = batch.mask[:, None, :, None]
    for layer, (cols, (mass, count)) in got.items():
        p = patterns[layer]
        assert float(((cols - p[..., [0, 2, 5]]) * real).abs().max()) < TOL
        want_mass, want_count = key_attention(p, batch.mask)
        assert float((mass - want_mass).abs().max()) < TOL
        assert torch.equal(count, want_count)


def _same(a, b):
    fa, fb = a.to_frame(), b.to_frame()
    assert list(fa.columns) == list(fb.columns) and len(fa) == len(fb)
    num = fa.select_dtypes("number").columns
    assert float((fa[num] - fb[num]).abs().max().max() if len(fa) else 0.0) < TOL
    assert fa.drop(columns=num).equals(fb.drop(columns=num))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_analyses_give_the_eager_tables(family):
    model = tiny_model(family)
    for run in (lambda a: sink_attention(model, TEXTS, attention=a),
                lambda a: sink_attention(model, TEXTS, sinks=[0, 3], attention=a),
                lambda a: dormant_heads(model, TEXTS, sinks=[0], attention=a),
                lambda a: sink_census(model, TEXTS, rule=SinkRule(threshold=0.1), attention=a)):
        eager, lse = run("eager"), run("lse")
        assert (eager.attention, lse.attention) == ("eager", "lse")
        _same(eager, lse)
    eager, lse = find_sinks(model, TEXTS, attention="eager"), find_sinks(model, TEXTS, attention="lse")
    assert lse.attention == "lse" and torch.equal(eager.mask, lse.mask)
    eager, lse = (decompose_attention(model, TEXTS, attention=a) for a in ("eager", "lse"))
    _same(eager, lse)
    assert float((eager.sink - lse.sink).abs().max()) < TOL and float((eager.content - lse.content).abs().max()) < TOL
    assert lse.reconstruction_error < 1e-4 and "log-sum-exp" in lse.summary()


def test_model_left_as_found_even_after_an_error():
    model = tiny_model("llama")
    view = ModelView(model)
    hf = model.original_model
    before = hf.config._attn_implementation
    batch = view.tokenize("Hello there.")
    want = _patterns(view, batch)
    with pytest.raises(RuntimeError, match="boom"):
        with lse_run(view, lambda att: (_ for _ in ()).throw(RuntimeError("boom"))):
            view.forward(batch, [])
    assert hf.config._attn_implementation == before
    assert all("forward" not in block.attn.__dict__ for block in model.blocks)
    got = _patterns(view, batch)  # the eager pattern hook fires again, with the same numbers
    assert all(torch.equal(got[layer], want[layer]) for layer in want)


def test_bad_input_and_unsupported_models():
    model = tiny_model("llama")
    with pytest.raises(MassiveLensError, match="attention must be one of"):
        sink_attention(model, "Hello.", attention="flash")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    view = ModelView(model)
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(MassiveLensError, match="soft cap"):  # an attention that asks for one (Gemma 2) is refused
        with lse_run(view):
            ALL_ATTENTION_FUNCTIONS["massive_lens_lse"](model.blocks[0].attn.original_component, q, q, q, None,
                                                        softcap=30.0)
    assert model.original_model.config._attn_implementation != "massive_lens_lse"


def test_a_model_trained_here_reads_the_pattern():
    from massive_lens.train.model import MassiveLM, MassiveLMConfig

    model = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))
    assert "not a TransformerBridge" in lse_support(ModelView(model))
    with pytest.raises(MassiveLensError, match="cannot give the attention's log-sum-exp"):
        find_sinks(model, torch.tensor([[1, 2, 3, 4]]), attention="lse")
