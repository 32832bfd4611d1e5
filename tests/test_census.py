"""sink_census on planted tiny models (a primary sink at BOS, a secondary sink at '.', born by a
known MLP neuron, with a known life) and on the default model.

The plant (:func:`plant_secondary`, six layers): every ordinary token carries a constant in a clean
``CONST_DIM``; every query head reads it into its lowest-frequency rotary pair (so RoPE barely
turns it over a short text), which makes every query the same vector there. Keys read one clean
dim into that pair: the first half of the kv heads read BOS's massive ``SINK_DIM`` from layer 1
on (MLP 0 writes it; layer 0's keys read nothing, since LayerNorm's centring makes a clean dim
non-zero at every token); the second half read ``SEC_DIM`` in layers ``SEC_LIFE`` and ``SINK_DIM`` elsewhere.
``SEC_DIM`` is written, only at '.', by neuron ``SEC_NEURON`` of MLP ``SEC_BIRTH``, below the
massive criterion (``SEC_VALUE`` < 100). So BOS is the primary sink of every layer (75% of all
heads: the sink rule counts it), and each '.' a secondary sink of layers ``SEC_LIFE`` only
(half the heads there, 1/6 of all heads: the rule does not count it).
"""

from __future__ import annotations

import pytest
import torch
from helpers import untouched
from planting import BOS_TRIGGER, SINK_DIM, clean_dim, plant_sink, scale_write, set_trigger, wire

from massive_lens import load, sink_census, tiny_model
from massive_lens.errors import MassiveLensError

N_LAYERS = 6
SEC_DIM, SEC_TRIGGER, CONST_DIM = 20, 21, 22
SEC_BIRTH, SEC_NEURON, SEC_VALUE = 1, 29, 60.0
SEC_LIFE = (2, 3)
GAIN, CONST = 12.0, 0.05
TEXTS = ["the bee sees. the tree and the green reeds bend near the creek",
         "a deer feeds there. the breeze eases the heat near the reeds",
         "green reeds bend. three geese see the bee near the deer"]
FAMILIES = ["llama", "gpt2", "qwen2"]  # gemma3's QK-norm bounds every key: it cannot carry this plant


def _tokens(model, texts=TEXTS):
    """Each text as ids, BOS first, cut to the shortest."""
    bos = model.tokenizer.bos_token_id
    rows = [[bos, *model.tokenizer(t, add_special_tokens=False)["input_ids"]] for t in texts]
    n = min(len(r) for r in rows)
    return torch.tensor([r[:n] for r in rows])


def _read_pair(weight: torch.Tensor, heads, dim: int | None, pair: tuple[int, int]) -> None:
    """Heads ``heads`` of a [head, d_model, d_head] weight read only ``dim`` (None: nothing) into ``pair[0]``."""
    for h in heads:
        weight[h, :, list(pair)] = 0.0
        if dim is not None:
            weight[h, dim, pair[0]] = GAIN


def plant_secondary(model):
    """See the module docstring; returns the model, edited in place."""
    dot = model.tokenizer(".", add_special_tokens=False)["input_ids"][0]
    plant_sink(model)
    clean_dim(model, CONST_DIM)
    with torch.no_grad():
        model.W_E[:, CONST_DIM] = CONST
    set_trigger(model, model.tokenizer.bos_token_id, BOS_TRIGGER)
    set_trigger(model, dot, SEC_TRIGGER)
    clean_dim(model, SEC_DIM)
    wire(model, SEC_BIRTH, SEC_NEURON, SEC_TRIGGER, SEC_DIM)
    d_head = model.cfg.d_head
    pair = (d_head // 2 - 1, d_head - 1)  # the lowest rotary frequency (rotate-half layout)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            n_kv = attn.W_K.shape[0]
            _read_pair(attn.W_Q, range(attn.W_Q.shape[0]), CONST_DIM, pair)
            sink = None if layer == 0 else SINK_DIM  # nothing to read before MLP 0 writes it
            _read_pair(attn.W_K, range(n_kv // 2), sink, pair)
            _read_pair(attn.W_K, range(n_kv // 2, n_kv), SEC_DIM if layer in SEC_LIFE else sink, pair)
            for bias in (getattr(attn, "b_Q", None), getattr(attn, "b_K", None)):
                if bias is not None:
                    bias[:, list(pair)] = 0.0
    tokens = _tokens(model)
    scale_write(model, SEC_BIRTH, SEC_NEURON, SEC_DIM, SEC_VALUE, tokens, int((tokens[0] == dot).nonzero()[0]))
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def planted(request):
    return plant_secondary(tiny_model(request.param, num_hidden_layers=N_LAYERS))


def test_census_finds_exactly_the_planted_sinks(planted):
    tokens = _tokens(planted)
    with untouched(planted):
        census = sink_census(planted, tokens)
    f = census.to_frame()
    assert set(f["level"]) <= {"primary", "secondary"}, f[f["level"] == "transient"]
    prim, sec = census.level("primary"), census.level("secondary")
    assert prim["pos"].tolist() == [0, 0, 0] and prim["in_rule"].all()
    assert (prim["first_layer"] == 1).all() and (prim["last_layer"] == N_LAYERS - 1).all()  # MLP 0 writes SINK_DIM
    dots = (tokens == planted.tokenizer(".", add_special_tokens=False)["input_ids"][0]).nonzero().tolist()
    assert sorted(zip(sec["seq"], sec["pos"], strict=True)) == [tuple(d) for d in dots]
    assert (sec["token"] == ".").all() and (sec["token_kind"] == "delimiter").all() and not sec["in_rule"].any()
    assert (sec["first_layer"] == SEC_LIFE[0]).all() and (sec["last_layer"] == SEC_LIFE[-1]).all()
    assert (sec["mlp_layer"] == SEC_BIRTH).all() and (sec["neuron"] == SEC_NEURON).all()
    assert (sec["heads"] == planted.cfg.n_heads // 2).all() and (sec["peak_mass"] > 0.9).all()
    assert (sec["norm_ratio"] < 0.1).all()  # far below BOS's massive residual
    kinds = census.by_kind.set_index("token_kind")
    assert kinds.loc["delimiter", "frequency"] == 1.0 and kinds.loc["other", "secondary"] == 0
    text = census.summary()
    assert "secondary sinks on '.' in 100% of sequences, layers 2-3" in text and f"MLP {SEC_BIRTH}" in text


def test_without_the_plant_no_secondary(planted):
    """The same model with the secondary's keys switched off: the census loses it (the test can fail)."""
    tokens = _tokens(planted)
    saved = {layer: planted.blocks[layer].attn.W_K.detach().clone() for layer in SEC_LIFE}
    try:
        with torch.no_grad():
            for layer in SEC_LIFE:
                planted.blocks[layer].attn.W_K[:, SEC_DIM] = 0.0
        census = sink_census(planted, tokens)
    finally:
        with torch.no_grad():
            for layer, w in saved.items():
                planted.blocks[layer].attn.W_K.copy_(w)
    assert census.level("secondary").empty


def test_corpus_levels_save_and_plot(planted, tmp_path):
    census = sink_census(planted, " ".join(TEXTS) * 3, seq_len=24, n_seqs=3, batch_size=2)
    assert census.n_seqs == 3 and set(census.by_layer["level"]) == {"primary", "secondary", "transient"}
    back = load(census.save(tmp_path / "census"))
    assert back.summary() == census.summary() and back.to_frame().equals(census.to_frame())
    assert census.plot().get_xlabel() == "layer"


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(MassiveLensError, match="min_layers"):
        sink_census(model, "Hello.", min_layers=0)


@pytest.mark.slow
def test_default_model_census(default_model):
    """On SmolLM2: the first token is the primary sink in most layers and the rule counts it."""
    with untouched(default_model):
        census = sink_census(default_model, ["The cat sat on the mat. Then it slept, and the dog barked.\n"
                                             "A new line begins here, with more words after it."])
    prim = census.level("primary")
    assert (prim["pos"] == 0).any() and prim["in_rule"].all()
    first = prim[prim["pos"] == 0].iloc[0]
    assert first["n_layers"] >= default_model.cfg.n_layers // 2
    others = census.to_frame().query("pos > 0")
    assert (others["norm_ratio"] < 1).all() or others.empty
