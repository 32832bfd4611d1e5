"""sink_circuit: the logit split is exact on every tiny family (biases, GQA, post-norms, QK norms,
learned positions), against the model's own attention scores; on a planted sink the split names
the planted writer and massive dim, and the causal check kills the sink by removing them; bad
input gets a clear error; the model is left as found; the result saves and loads."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import untouched
from test_census import N_LAYERS, _tokens, plant_secondary

from massive_lens import load, tiny_model
from massive_lens.attention import SinkCircuit, sink_circuit
from massive_lens.core.criterion import SinkRule
from massive_lens.errors import MassiveLensError

TEXT = ["Hello there, world. The cat sat on the mat.", "A deer feeds near the reeds, and the geese see it."]
OLD_CAUSAL = ["layer", "head", "removal", "mass_before", "mass_before_low", "mass_before_high", "mass_after",
              "mass_after_low", "mass_after_high", "loss_ratio", "loss_ratio_low", "loss_ratio_high", "kills",
              "n_seqs", "est_seconds"]  # the causal columns of results saved before the controls
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
    assert text.splitlines()[0].startswith(f"{c.model_name}: {len(h)} of {len(h)} sink heads single out one writer")
    assert text.splitlines()[1].startswith("split: the sink at") and "mlp 0" in text
    assert "removing massive dims drops the corpus attention on the first token" in text
    assert (c.verdicts()["verdict"] == "singled out: mlp 0").all()


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
    lay = r.layers.set_index("layer").loc[2]  # BOS in every text: copies of one state, counted once (no cosine)
    assert lay["n_tokens"] == len(tokens) and lay["n_distinct"] == 1 and lay["cos_normed"] != lay["cos_normed"]
    assert "copies of one state" in r.summary() and "mean cosine" not in r.summary()
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
    from massive_lens.report.inputs import Inputs, ReportOptions
    from massive_lens.report.render import Section

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


def _writers(family, values):
    from planting import TEXT, bos_tokens, plant_key_writers

    model = plant_key_writers(tiny_model(family, num_hidden_layers=len(values) + 2), values)
    return model, bos_tokens(model, TEXT, 40, 6)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_writer_singled_out_and_equal_parts_distributed(family):
    """Known answers: MLP 0 writing 90% of the sink key's logit is singled out (removing it kills
    the sink; its runner-up and random key directions of the same norm do not, by paired
    intervals); three MLPs writing a third each make a distributed sink, named by its three parts.
    The summary leads with that verdict, and the margin is the model's own (independent
    computation from the cached scores)."""
    model, tokens = _writers(family, (5000.0, 250.0, 250.0))
    with untouched(model):
        c = sink_circuit(model, tokens[:2], corpus=tokens[2:], n_seqs=4, seq_len=tokens.shape[1], progress=False)
    v = c.verdicts()
    assert len(v) and (c.heads["layer"] >= 3).all()
    assert (v["verdict"] == "singled out: mlp 0").all(), v[["verdict", "why"]]
    w = c.causal[c.causal["removal"] == "dominant writer"]
    assert w["kills"].all() and not w["controls_kill"].any() and (w["runner_up_gap_low"] > 0).all()
    assert (w["random_gap_low"] > 0).all() and (w["runner_up_after"] > 0.3).all()
    assert (w["random_after_min"] > 0.3).all()
    assert c.summary().startswith(f"{c.model_name}: {len(v)} of {len(v)} sink heads single out one writer of the "
                                  "sink's key (mlp 0")
    _, cache = model.run_with_cache(tokens[:2])
    for r in c.heads.itertuples():
        s = cache[f"blocks.{r.layer}.attn.hook_attn_scores"][:, r.head].double()  # [B Q K], causal mask applied
        n = s.shape[-1]
        content = s[:, 1:, 1:].masked_fill(~torch.ones(n - 1, n - 1, dtype=torch.bool).tril(), float("-inf"))
        want = float((s[:, 1:, 0] - torch.logsumexp(content, -1)).mean())
        assert abs(r.margin - want) <= 1e-4 * max(1.0, abs(want))

    model, tokens = _writers(family, (3000.0, 3000.0, 3000.0))
    c = sink_circuit(model, tokens[:2], corpus=tokens[2:], n_seqs=4, seq_len=tokens.shape[1], progress=False)
    v = c.verdicts()
    assert len(v) and v["verdict"].str.startswith("not singled out").all(), v[["verdict", "why"]]
    assert all(f"mlp {i}" in x for i in range(3) for x in v["verdict"])
    shares = [[int(p) for p in re.findall(r"mlp \d+ (\d+)%", x)] for x in v["verdict"]]
    # each writer's share of the positive parts: never over 100%, the three adding up to about all of it
    assert all(len(s) == 3 and max(s) <= 100 and abs(sum(s) - 100) <= 3 for s in shares), shares
    assert not c.causal.loc[c.causal["removal"] == "dominant writer", "kills"].any()
    assert c.summary().startswith(f"{c.model_name}: 0 of {len(v)} sink heads single out one writer")
    assert f"in {len(v)} no writer is singled out" in c.summary().splitlines()[0]


def test_passes_counted_and_shown(monkeypatch, caplog):
    """The estimate names the passes that really run (no b_Q pass without a query bias) and a bar
    counts them; each one is a forward pass (counted here on the loss)."""
    import logging

    from massive_lens.attention import circuit_causal

    calls = []

    class Counting(circuit_causal.NextTokenLoss):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    monkeypatch.setattr(circuit_causal, "NextTokenLoss", Counting)
    model, tokens = _writers("llama", (5000.0,))
    with caplog.at_level(logging.INFO, logger=circuit_causal.__name__):
        sink_circuit(model, tokens[:2], corpus=tokens[2:], n_seqs=4, seq_len=tokens.shape[1], progress=False)
    said = [m for m in caplog.messages if "passes (" in m]
    assert said and f"{len(calls)} passes" in said[0] and "b_Q" not in said[0]
    # with a query bias the b_Q pass runs and is counted; its random query-direction controls are read
    # at the head from the pass (checked against the pass's own pattern inside the call)
    from planting import TEXT, bos_tokens, plant_key_writers

    model = plant_key_writers(_with_biases(tiny_model("qwen2", num_hidden_layers=3)), (5000.0,))
    tokens = bos_tokens(model, TEXT, 40, 4)
    calls.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=circuit_causal.__name__):
        c = sink_circuit(model, tokens[:2], corpus=tokens[2:], n_seqs=2, seq_len=tokens.shape[1], progress=False)
    said = [m for m in caplog.messages if "passes (" in m]
    assert said and f"{len(calls)} passes" in said[0] and "b_Q" in said[0]
    bq = c.causal[c.causal["removal"] == "b_Q"]
    assert len(bq) and bq["applies"].all() and bq["random_after"].between(0, 1).all()


def test_layer_without_massive_dims():
    """A sink written below the massive rule: no massive share (NaN, not 0), the massive-dims
    removal removes nothing there, so it is neither a kill nor a survival, and the summary says so."""
    model, tokens = _writers("llama", (60.0,))
    c = sink_circuit(model, tokens[:2], corpus=tokens[2:], n_seqs=2, seq_len=tokens.shape[1], progress=False)
    assert c.heads["massive_share"].isna().all()
    rows = c.causal[c.causal["removal"] == "massive dims"]
    assert len(rows) and not rows["applies"].any() and not rows["kills"].any()
    v = c.verdicts()
    assert not v["survives"].str.contains("massive dims").any() and not v["killed_by"].str.contains("massive").any()
    text = c.summary()
    assert "no massive dims at the sink in these heads' layers" in text and "removes nothing in any" in text


def test_whitespace_token_and_chain_figure(planted):
    """A whitespace sink token prints visibly; the chain figure names the dominant writer on its own."""
    import dataclasses

    c = sink_circuit(planted, _tokens(planted), n_heads=2)
    assert "'⏎'" in dataclasses.replace(c, sink_token="\n").summary()
    labels = c.plot().get_legend_handles_labels()[1]
    assert "mlp 0 (massive dims)" in labels
    # a result saved before the controls: read back, it says it has none instead of failing
    tokens = _tokens(planted)
    full = sink_circuit(planted, tokens, n_heads=2, corpus=tokens, n_seqs=len(tokens), seq_len=tokens.shape[1],
                        progress=False)
    old = dataclasses.replace(full, heads=full.heads.drop(columns=["margin", "margin_spread", "runner_up",
                                                                   "runner_up_share"]),
                              causal=full.causal[[c for c in full.causal if c in OLD_CAUSAL]])
    assert "saved before the controls" in old.summary().splitlines()[0]


def test_reads_the_attention_from_the_pass_at_any_length():
    """The split reads its layers from the one pass (no attention hook of its own: issue 50), on the
    eager path that the pass chooses for the rotary cos/sin even past LSE_FROM tokens, where it would
    otherwise read the kernel; the parts still add up to the scores there."""
    import pathlib
    import re as regex

    from massive_lens.core.attention_pass import LSE_FROM

    src = pathlib.Path(__file__).parents[1] / "massive_lens" / "attention"
    for path in sorted(src.glob("circuit*.py")):
        hits = regex.findall(r"hook_pattern|hook_attn_scores|hook_q\b|hook_k\b|hook_rot",
                             path.read_text())
        assert not hits, (path.name, hits)
    model = tiny_model("llama", max_position_embeddings=2 * LSE_FROM)
    tokens = torch.randint(1, model.cfg.d_vocab, (1, LSE_FROM + 8), generator=torch.Generator().manual_seed(0))
    with untouched(model):
        c = sink_circuit(model, tokens, heads=[(1, 0)], rule=SinkRule(threshold=1e-6))
    assert c.heads["check"].max() < 1e-4


def test_nnsight_refused_by_name():
    pytest.importorskip("nnsight")
    from massive_lens import load_model
    from massive_lens.attention import norm_roles
    from massive_lens.models import byte_tokenizer
    from massive_lens.models.tiny import tiny_config

    cls, config = tiny_config("llama", byte_tokenizer(), {})
    lm = load_model(cls(config).eval(), tokenizer=byte_tokenizer(), backend="nnsight", name="tiny-llama")
    for call, name in ((lambda: sink_circuit(lm, TEXT), "sink_circuit"), (lambda: norm_roles(lm, TEXT), "norm_roles")):
        with pytest.raises(MassiveLensError, match=f"nnsight model.*{name}.*backend='bridge'"):
            call()


def test_norm_roles_outlier_channel_apart():
    """An outlier channel (OUTLIER_DIM at every token but BOS) beside a token-specific massive
    activation (BOS's SINK_DIM): the channel's entries have rows of their own (scope outlier_dim),
    counted apart in the summary; the token-specific share and the headline are BOS's."""
    from planting import OUTLIER_DIM, SINK_DIM, plant_story

    from massive_lens.attention import norm_roles

    model = plant_story(tiny_model("llama"))
    texts = ["the bee sees the tree and the green reeds", "a deer feeds there near the reeds and geese"]
    r = norm_roles(model, texts)
    f = r.to_frame()
    out = f[f["scope"] == "outlier_dim"]
    assert len(out) and (out["dims"] == str(OUTLIER_DIM)).all() and (out["pos"] > 0).all()
    tok = f[f["scope"] == "token"]
    assert len(tok) and (tok["pos"] == 0).all() and tok["dims"].str.split(",").map(lambda d: str(SINK_DIM) in d).all()
    assert r.headline()["scope"] == "token" and r.headline()["pos"] == 0
    text = r.summary()
    assert f"of the {len(tok)} token-specific massive" in text and f"their {len(out)} entries" in text
    assert (r.layers["n_outlier"] > 0).any() and (r.layers["n_tokens"] <= len(texts)).all()


def test_command_split_and_causal_check_read_other_sequences(planted, monkeypatch, tmp_path):
    from massive_lens.attention import circuit_cli
    from massive_lens.cli import main

    seen = {}

    def fake(model, text, **kwargs):
        seen["text"], seen["corpus"] = text, kwargs["corpus"]
        raise MassiveLensError("stop here")

    monkeypatch.setattr(circuit_cli, "load_model", lambda *a, **k: planted)
    monkeypatch.setattr(circuit_cli, "sink_circuit", fake)
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(f"word{i} and more text" for i in range(400)))
    main(["sink-circuit", "--corpus", str(corpus), "--n-text", "2", "--n-seqs", "3", "--seq-len", "16"])
    text, held = seen["text"], seen["corpus"]
    assert len(text) == 2 and len(held) == 3
    assert not any(torch.equal(a, b) for a in text for b in held)
