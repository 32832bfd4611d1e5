"""sink_circuit: the logit split is exact on every tiny family (biases, GQA, post-norms, QK norms,
learned positions), against the model's own attention scores; on a planted sink the split names
the planted writer and massive dim, and the causal check kills the sink by removing them; bad
input gets a clear error; the model is left as found; the result saves and loads."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from test_census import N_LAYERS, _tokens, plant_secondary

from massive_lens import load, tiny_model
from massive_lens.attention import SinkCircuit, sink_circuit
from massive_lens.core.criterion import SinkRule
from massive_lens.errors import MassiveLensError

TEXT = ["Hello there, world. The cat sat on the mat.", "A deer feeds near the reeds, and the geese see it."]
LOW = SinkRule(threshold=0.01)  # random tiny models spread their attention: every head passes


def _with_biases(model):
    """Random nonzero query and key biases where the family has them (tiny models start at zero)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            for name in ("b_Q", "b_K"):
                b = getattr(block.attn, name, None)
                if isinstance(b, torch.Tensor):
                    b.copy_(torch.randn(b.shape, generator=gen))
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "gemma3"])
def test_split_is_exact(family):
    """Every head's parts add up to the scores the model computed (read independently here with
    run_with_cache); the query side (b_Q + content) adds up too; b_Q is a part where present."""
    model = _with_biases(tiny_model(family))
    heads = [(layer, h) for layer in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    with untouched(model):
        c = sink_circuit(model, TEXT, heads=heads, rule=LOW)
    _, cache = model.run_with_cache(TEXT[0])
    f = c.to_frame()
    for (layer, head), part in f.groupby(["layer", "head"]):
        info = c.heads[(c.heads["layer"] == layer) & (c.heads["head"] == head)].iloc[0]
        assert info["check"] < 1e-4
        key, query = part[part["side"] == "key"], part[part["side"] == "query"]
        assert abs(key["contribution"].sum() - info["logit"]) <= 1e-4 * max(1.0, abs(info["logit"]))
        assert abs(query["contribution"].sum() - info["logit"]) <= 1e-4 * max(1.0, abs(info["logit"]))
    # the first text alone: the mean logit on the sink is what the model's own scores say
    one = sink_circuit(model, TEXT[0], heads=[(1, 0)], rule=LOW)
    scores = cache["blocks.1.attn.hook_attn_scores"][0, 0, 1:, 0]
    assert abs(one.heads["logit"].iloc[0] - float(scores.mean())) <= 1e-4 * max(1.0, float(scores.abs().max()))
    parts = set(f["part"])
    assert {"embed", "attn 0", "mlp 0"} <= parts
    assert ("pos_embed" in parts) == (family == "gpt2")
    assert ("b_K" in parts) == (family in ("gpt2", "qwen2"))
    assert ("norm bias" in parts) == (family == "gpt2")
    bq = f[f["part"] == "b_Q"]
    assert (bq["contribution"].abs().max() > 0) == (family in ("gpt2", "qwen2"))


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def planted(request):
    return plant_secondary(tiny_model(request.param, num_hidden_layers=N_LAYERS))


def test_planted_sink(planted):
    """BOS's massive dim, written by MLP 0, is what the first half of the kv heads read into the
    pair every query shares: those heads are the sink heads, MLP 0 their dominant writer, the
    massive dims nearly all of the logit; removing them (or MLP 0's part) kills the sink; b_Q,
    planted at zero in that pair, does not."""
    tokens = _tokens(planted)
    with untouched(planted):
        c = sink_circuit(planted, tokens, corpus=tokens, n_seqs=len(tokens), seq_len=tokens.shape[1])
    h = c.heads
    assert len(h) and (h["layer"] >= 1).all() and (h["sink_mass"] > 0.9).all()
    assert (h["dominant"] == "mlp 0").all(), h
    assert (h["massive_share"] > 0.9).all() and (h["check"] < 1e-4).all()
    causal = c.causal
    for removal in ("massive dims", "dominant writer", "shared direction"):
        rows = causal[causal["removal"] == removal]
        assert len(rows) == len(h) and rows["kills"].all(), rows
        assert (rows["mass_after"] < 0.3).all() and (rows["mass_before"] > 0.9).all()
    bq = causal[causal["removal"] == "b_Q"]
    assert not bq["kills"].any()
    assert (causal["loss_ratio"] > 0).all() and (causal["mass_after_low"] <= causal["mass_after_high"]).all()
    text = c.summary()
    assert text.splitlines()[0].startswith(f"{c.model_name}: the sink at") and "mlp 0" in text
    assert "removing massive dims drops its attention from" in text


def test_save_load(tmp_path, planted):
    c = sink_circuit(planted, _tokens(planted), n_heads=2)
    back = load(c.save(tmp_path / "c"))
    assert isinstance(back, SinkCircuit) and back.summary() == c.summary()
    assert back.heads.equals(c.heads) and back.to_frame().equals(c.to_frame())
    assert c.plot() is not None


def test_bad_input():
    model = tiny_model("llama")
    with pytest.raises(MassiveLensError, match="no sink in the text"):
        sink_circuit(model, TEXT)  # random weights: no head gives the first token > 0.3
    with pytest.raises(MassiveLensError, match="not a sink head"):
        sink_circuit(model, TEXT, heads=[(0, 0)])
    with pytest.raises(MassiveLensError, match="out of range"):
        sink_circuit(model, TEXT, heads=[(0, 99)], rule=LOW)
    with pytest.raises(MassiveLensError, match="out of range"):
        sink_circuit(model, TEXT, layers=[99])
    with pytest.raises(MassiveLensError, match="pairs"):
        sink_circuit(model, TEXT, heads=[0], rule=LOW)
    with pytest.raises(MassiveLensError, match="query after the first token"):
        sink_circuit(model, torch.tensor([[1]]), rule=LOW)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_norm_roles(family):
    """BOS's planted massive value takes nearly all of the next norm's denominator (checked against
    the cached residual); with the norm's weight on that dim as is it is a contributor, with the
    weight shrunk 1e4-fold (what a rescaler looks like) a rescaler; after the norm the BOS states
    of different texts point the same way."""
    from planting import SINK_DIM

    from massive_lens.attention import norm_roles

    model = plant_secondary(tiny_model(family, num_hidden_layers=N_LAYERS))
    tokens = _tokens(model)
    with untouched(model):
        r = norm_roles(model, tokens)
    bos = r.to_frame().query("pos == 0 and layer == 2")
    assert len(bos) == len(tokens) and (bos["dims"] == str(SINK_DIM)).all()
    _, cache = model.run_with_cache(tokens)
    x = cache["blocks.2.ln1.hook_in"][:, 0].double()
    x = x - x.mean(-1, keepdim=True) if family == "gpt2" else x
    want = (x[:, SINK_DIM] ** 2 / (x ** 2).sum(-1)).tolist()
    assert bos["denominator_share"].tolist() == pytest.approx(want, rel=1e-5)
    assert (bos["role"] == "contributor").all()
    lay = r.layers.set_index("layer").loc[2]
    assert lay["n_tokens"] == len(tokens) and lay["cos_normed"] > 0.99
    with torch.no_grad():
        ln = model.blocks[2].ln1.original_component
        ln.weight[SINK_DIM] *= 1e-4
    shrunk = norm_roles(model, tokens).to_frame().query("pos == 0 and layer == 2")
    assert (shrunk["role"] == "rescaler").all()
    assert (shrunk["output_share"].to_numpy() < bos["output_share"].to_numpy() / 2).all()
    assert f"a {r.headline()['role']}" in r.summary()


def test_bad_input_leaves_the_model_as_found():
    model = tiny_model("qwen2")
    with untouched(model), pytest.raises(MassiveLensError, match="no sink in the text"):
        sink_circuit(model, TEXT, corpus=TEXT)


def test_command_and_report_section(planted, monkeypatch, tmp_path, capsys):
    """``massive-lens sink-circuit`` prints the chain and saves the result and its figure; the
    report's section shows the summary, the figure and both tables; a text with no sink gives the
    section a note instead of failing the report."""
    from massive_lens.attention import circuit_cli
    from massive_lens.cli import main
    from massive_lens.report.circuit_section import circuit_section
    from massive_lens.report.render import Section
    from massive_lens.report.sections import Inputs, ReportOptions

    def inputs(model, full=True):  # the section reads the model, the evaluation sequences and full
        tokens = _tokens(model)
        return Inputs(model, "", tokens, ReportOptions(seq_len=tokens.shape[1], n_seqs=len(tokens), full=full))

    monkeypatch.setattr(circuit_cli, "load_model", lambda *a, **k: planted)
    text = planted.tokenizer.decode(_tokens(planted)[0])
    assert main(["sink-circuit", "--text", text, "--no-causal", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the sink at" in out and "mlp 0" in out
    assert isinstance(load(tmp_path / "sink_circuit"), SinkCircuit) and (tmp_path / "sink_circuit.png").exists()
    s = Section("circuit")
    circuit_section(inputs(planted), s)
    kinds = [kind for kind, _, _ in s.blocks]
    assert kinds.count("table") == 2 and "figure" in kinds and "pre" in kinds
    light = Section("circuit")  # the light default names the call and runs nothing
    circuit_section(inputs(planted, full=False), light)
    assert [kind for kind, _, _ in light.blocks] == ["note"] and "--full" in light.blocks[0][1]
    none = Section("circuit")
    circuit_section(inputs(tiny_model("llama")), none)
    assert [kind for kind, _, _ in none.blocks] == ["note"] and "no sink in the text" in none.blocks[0][1]


def test_the_causal_check_is_bounded(planted):
    tokens = _tokens(planted)
    with untouched(planted), pytest.raises(MassiveLensError, match="over max_seconds"):
        sink_circuit(planted, tokens, corpus=tokens, max_seconds=1e-9)
