"""sink_kv: a planted key bias found where it was planted, and agreement with plain transformers
hooks on the default model (key and value norms and attention masses to 1e-5)."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from test_census import N_LAYERS, SEC_LIFE, _tokens, plant_secondary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from massive_lens import tiny_model
from massive_lens.attention.kv import sink_kv
from massive_lens.errors import MassiveLensError


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def planted(request):
    return plant_secondary(tiny_model(request.param, num_hidden_layers=N_LAYERS))


def test_planted_key_bias(planted):
    """BOS's key reads its massive dim into the one pair every query shares from layer 1 on:
    there its key is a bias (large, aligned with the mean query, one logit for every query);
    in layer 0 the keys read nothing and it is not."""
    with untouched(planted):
        kv = sink_kv(planted, _tokens(planted), sinks=[0])
    f = kv.to_frame()
    n_kv = int(f["kv_head"].max()) + 1
    bos = f[(f["layer"] >= 1) & ((f["kv_head"] < n_kv // 2) | ~f["layer"].isin(SEC_LIFE))]
    assert (bos["key_ratio"] > 5).all() and (bos["key_cos_query"] > 0.9).all() and (bos["bias_share"] > 0.9).all()
    assert (bos["sink_mass"] > 0.9).all()
    first = f[f["layer"] == 0]
    assert (first["sink_mass"] < 0.5).all() and (first["key_ratio"] < 5).all()
    assert torch.allclose(torch.tensor(f["drain"].values), torch.tensor(f["sink_term"].values), rtol=1e-4)


def test_planted_secondary_keys(planted):
    """With the '.' positions as the sinks, the heads that read them in SEC_LIFE carry the bias."""
    tokens = _tokens(planted)
    dots = tokens == planted.tokenizer(".", add_special_tokens=False)["input_ids"][0]
    f = sink_kv(planted, tokens, sinks=dots, layers=list(SEC_LIFE)).to_frame()
    n_kv = int(f["kv_head"].max()) + 1
    reads = f["kv_head"] >= n_kv // 2
    assert (f[reads]["sink_mass"] > 0.9).all() and (f[reads]["bias_share"] > 0.9).all()
    assert (f[~reads]["sink_mass"] < 0.1).all()


def test_bands_and_no_rotary():
    kv = sink_kv(tiny_model("llama"), "Hello there, world.", sinks=[0], layers=1)
    half = kv.bands["band"].max() + 1
    assert kv.rotary and len(kv.bands) == kv.to_frame()["head"].nunique() * half
    assert kv.bands["frequency"].is_monotonic_decreasing or kv.bands.groupby("head")["frequency"].apply(
        lambda s: s.is_monotonic_decreasing).all()
    gpt2 = sink_kv(tiny_model("gpt2"), "Hello there, world.", sinks=[0])
    assert not gpt2.rotary and gpt2.bands.empty and "no rotary embeddings" in gpt2.summary()
    assert gpt2.plot().get_xlabel() == "layer"
    with pytest.raises(MassiveLensError, match="every real position is a sink"):
        sink_kv(tiny_model("llama"), "Hi", sinks=[0, 1, 2])


def _hf_reference(model, tokens: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """Keys, values and the attention pattern of one layer from the Hugging Face modules alone."""
    hf = model.original_model
    attn = hf.model.layers[layer].self_attn
    seen: dict[str, torch.Tensor] = {}
    handles = [getattr(getattr(attn, name), "_original_component", getattr(attn, name)).register_forward_hook(
        lambda mod, i, o, name=name: seen.__setitem__(name, o.detach())) for name in ("q_proj", "k_proj", "v_proj")]
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in handles:
            h.remove()
    cfg = hf.config
    d = cfg.hidden_size // cfg.num_attention_heads
    b, p = tokens.shape
    q, k, v = (seen[n].view(b, p, -1, d).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
    cos, sin = hf.model.rotary_emb(v, torch.arange(p)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), float("-inf"))
    return {"k": k, "v": v, "pattern": scores.softmax(-1)}


@pytest.mark.slow
def test_default_model_agrees_with_transformers(default_model):
    tokens = default_model.to_tokens("The cat sat on the mat. Then it slept, and the dog barked.")
    layers = [0, default_model.cfg.n_layers // 2, default_model.cfg.n_layers - 1]
    with untouched(default_model):
        f = sink_kv(default_model, tokens, sinks=[0], layers=layers).to_frame()
    for layer in layers:
        ref = _hf_reference(default_model, tokens, layer)
        mine = f[f["layer"] == layer].sort_values("head")
        group = len(mine) // ref["k"].shape[1]
        for name, col in (("k", "key"), ("v", "value")):
            norms = ref[name].norm(dim=-1)[0]  # [kv_head pos]
            want_sink = norms[:, 0].repeat_interleave(group)
            want_median = norms[:, 1:].median(-1).values.repeat_interleave(group)
            _close(mine[f"{col}_norm"], want_sink)
            _close(mine[f"{col}_median"], want_median)
        mass = ref["pattern"][0, :, 1:, 0].mean(-1)
        _close(mine["sink_mass"], mass)


def _close(column, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(column.values, dtype=torch.float32), want, rtol=1e-5, atol=1e-5)


def test_a_sink_set_found_once_serves_both_analyses():
    """The sinks found in sink_kv's own pass give the table the same sinks given give (at this length the layers
    are kept whole until the sinks are known; reduced, see test_sinks_found_in_the_same_pass)."""
    from massive_lens.attention import dormant_heads, find_sinks

    model = tiny_model("llama")
    text = "Hello there, world. The cat sat."
    found = find_sinks(model, text)
    assert sink_kv(model, text, sinks=found).to_frame().equals(sink_kv(model, text).to_frame())
    assert dormant_heads(model, text, sinks=found).to_frame().equals(dormant_heads(model, text).to_frame())
    with pytest.raises(MassiveLensError, match="find the sinks on the same text"):
        sink_kv(model, "Hi.", sinks=found)


def _agree(a, b, tol: float) -> None:
    """Every numeric column of two frames within ``tol`` of that column's largest entry."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for col in a.select_dtypes("number").columns if len(a) else ():
        x, y = torch.tensor(a[col].to_numpy()), torch.tensor(b[col].to_numpy())
        assert (x - y).abs().max() <= tol * x.abs().max().clamp(min=1e-12), (col, float((x - y).abs().max()))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "gemma3"])
def test_both_paths_agree(family):
    """The eager hooks and the fused kernel give one table (issue 50: a reducer over the one pass), with
    several sinks per sequence, different ones in each, and a padded batch; float32 kernels differ in the
    last bits, so the tolerance is 1e-5 of each column's largest entry."""
    model = tiny_model(family)
    tokens = torch.randint(1, 200, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, [0, 5]], mask[1, [0, 3, 7]] = True, True
    texts = ["Hello there, world. The cat sat on the mat.", "A deer feeds."]
    with untouched(model):
        for text, sinks in ((tokens, mask), (texts, [0, 2])):
            eager = sink_kv(model, text, sinks=sinks, attention="eager")
            lse = sink_kv(model, text, sinks=sinks, attention="lse")
            _agree(eager.to_frame(), lse.to_frame(), 1e-5)
            _agree(eager.bands, lse.bands, 1e-5)
    assert eager.rotary == (family != "gpt2") and not eager.to_frame().isna().any().any()


def test_reads_its_layers_from_the_pass():
    """kv.py names no attention hook and no path (issue 50); past LSE_FROM tokens 'auto' reads the kernel,
    and agrees with the eager hooks."""
    import ast
    import pathlib

    from massive_lens.core.attention_pass import LSE_FROM

    tree = ast.parse((pathlib.Path(__file__).parents[1] / "massive_lens" / "attention" / "kv.py").read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, (ast.Module, ast.ClassDef,
            ast.FunctionDef)) and node.body and isinstance(node.body[0], ast.Expr)}
    words = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and id(n) not in docs] + [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    assert not [w for w in words if "hook_" in w.replace("resid_post", "") or w in ("LSE", "EAGER", "lse", "eager",
                                                                                     "LayerGather")]
    model = tiny_model("llama", max_position_embeddings=2 * LSE_FROM)
    tokens = torch.randint(1, model.cfg.d_vocab, (1, LSE_FROM + 8), generator=torch.Generator().manual_seed(0))
    with untouched(model):
        auto, eager = sink_kv(model, tokens, sinks=[0, 9]), sink_kv(model, tokens, sinks=[0, 9], attention="eager")
    _agree(auto.to_frame(), eager.to_frame(), 1e-5)
    with pytest.raises(MassiveLensError, match="attention must be one of"):
        sink_kv(model, "Hello there.", attention="fast")


def test_sinks_found_in_the_same_pass(monkeypatch):
    """sinks=None reads the sinks and the layers in one forward at any length (issue 50's speed: each layer
    reduced against every candidate column, not kept); the table is the one the sinks given give, and where a
    sink falls outside the candidate columns one more pass gives the same table."""
    import massive_lens.attention.kv as kv_module
    from massive_lens.core.model_view import ModelView

    model = tiny_model("llama")
    text = ["Hello there, world. The cat sat on the mat.", "A deer feeds near the reeds."]
    calls = []
    forward = ModelView.forward
    monkeypatch.setattr(ModelView, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    with untouched(model):
        one = sink_kv(model, text)
        assert len(calls) == 1
        monkeypatch.setattr(kv_module, "WHOLE_BYTES", 0)  # as past ~650 tokens on SmolLM2: the layers reduced
        reduced = sink_kv(model, text)
        assert len(calls) == 2
        two = sink_kv(model, text, sinks=one.sinks)
        monkeypatch.setattr(kv_module, "candidate_columns", lambda view, batch: torch.tensor([1]))
        three = sink_kv(model, text)
    assert len(calls) == 5 and one.sinks.mask.equal(three.sinks.mask) and one.sinks.mask.equal(reduced.sinks.mask)
    _agree(reduced.to_frame(), two.to_frame(), 1e-6)
    assert one.to_frame().equals(two.to_frame()) and two.to_frame().equals(three.to_frame())
    assert one.bands.equals(reduced.bands) and one.bands.equals(two.bands) and one.bands.equals(three.bands)


@pytest.mark.parametrize(("family", "attention"), [("llama", "eager"), ("llama", "lse"), ("gpt2", "eager")])
@pytest.mark.parametrize("whole", [0, 2 ** 27])
def test_sinks_found_reduce_like_sinks_given(monkeypatch, family, attention, whole):
    """Whatever sinks the rule finds (here planted: several per sequence, different in each, some of them
    queries after another sink), the layers reduced against every candidate column before the sinks are known
    (WHOLE_BYTES 0), or kept whole, give the table those sinks given give, within float32 rounding, in a
    padded batch too."""
    import massive_lens.attention.kv as kv_module
    from massive_lens.attention.sinks import SinkSet
    from massive_lens.core.model_view import ModelView

    model = tiny_model(family)
    tokens = torch.randint(1, 200, (2, 14), generator=torch.Generator().manual_seed(0))
    texts = ["Hello there, world. The cat sat on the mat.", "A deer feeds."]
    with untouched(model):
        for text in (tokens, texts):
            sinks = torch.zeros_like(ModelView(model).tokenize(text).mask)
            sinks[0, [0, 5]], sinks[1, [0, 3, 7]] = True, True
            monkeypatch.setattr(kv_module, "WHOLE_BYTES", whole)
            monkeypatch.setattr(kv_module, "candidate_columns", lambda view, batch: torch.arange(9))
            monkeypatch.setattr(kv_module, "sinks_from", lambda evidence, kinds, path, m=sinks: SinkSet(m, kinds,
                                                                                                        "planted"))
            found = sink_kv(model, text, attention=attention)
            monkeypatch.undo()
            given = sink_kv(model, text, sinks=sinks, attention=attention)
            assert found.sink_source == "planted" and found.sinks.mask.equal(given.sinks.mask)
            _agree(found.to_frame(), given.to_frame(), 1e-6)
            assert found.bands.equals(given.bands)


@pytest.mark.parametrize("sinks", [None, [0, 2]])
def test_a_layer_held_apart_gives_the_same_rows(monkeypatch, sinks):
    """A layer that does not fit the buffers (on another device, in a model split over several) is held apart and
    reduced on its own: the table is the one every layer in the buffers gives, in the layers' order."""
    import massive_lens.attention.kv as kv_module

    model = tiny_model("llama")
    texts = ["Hello there, world. The cat sat on the mat.", "A deer feeds."]
    together = sink_kv(model, texts, sinks=sinks)
    hold = kv_module._Reduce._hold

    def every_other_apart(self, layer, fields):
        if layer % 2:  # as the device check sends it
            self.apart.append((layer, {name: x.clone() for name, x in fields.items()}))
        else:
            hold(self, layer, fields)

    monkeypatch.setattr(kv_module._Reduce, "_hold", every_other_apart)
    apart = sink_kv(model, texts, sinks=sinks)
    assert apart.to_frame()["layer"].tolist() == together.to_frame()["layer"].tolist()
    _agree(apart.to_frame(), together.to_frame(), 1e-6)


@pytest.mark.parametrize("sinks", [None, [0, 2]])
def test_layers_tabled_one_at_a_time_give_the_same_rows(monkeypatch, sinks):
    """At length the held layers are tabled a few at a time (ROWS_BYTES): the table is the one all at once gives."""
    import massive_lens.attention.kv as kv_module

    model = tiny_model("llama")
    texts = ["Hello there, world. The cat sat on the mat.", "A deer feeds."]
    together = sink_kv(model, texts, sinks=sinks)
    monkeypatch.setattr(kv_module, "ROWS_BYTES", 1)
    alone = sink_kv(model, texts, sinks=sinks)
    assert alone.to_frame()["layer"].tolist() == together.to_frame()["layer"].tolist()
    _agree(alone.to_frame(), together.to_frame(), 1e-6)
