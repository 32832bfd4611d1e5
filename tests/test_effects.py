"""The effect analyses (massive_lens.effects): compression valley, streaming window, over-mixing.

Each has an analytic or planted case with an exact answer, leaves the model as found (exceptions
included) and refuses bad input with a MassiveLensError."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from helpers import plant_massive, untouched

from massive_lens import load, tiny_model
from massive_lens.core.model_view import ModelView
from massive_lens.effects import (
    CompressionValley,
    compression_valley,
    matrix_entropy,
    over_mixing,
    repeated_token_probe,
    streaming_window,
)
from massive_lens.effects.valley import ENTROPY_TIE, valley_layers
from massive_lens.errors import MassiveLensError

TEXT = "The cat sat. The dog ran!\nA bird sang, loudly. " * 12
CALIB = "Calibration is other text, read for its massive activations. " * 12


# --------------------------------------------------------------------------- matrix entropy


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_matrix_entropy_of_a_known_low_rank_input(rank):
    """Centered rows spanning ``rank`` orthogonal directions with equal variance: log(rank) / log(min(n, d))."""
    n, d = 16, 12
    basis = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64)).Q[:rank]  # [rank d] orthonormal
    coords = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64)).Q[:, :rank]  # [n rank] orthonormal
    coords = coords - coords.mean(0)  # centered: the columns stay orthogonal only if re-orthogonalized
    coords = torch.linalg.qr(coords).Q * 5.0
    x = coords @ basis + torch.randn(d, dtype=torch.float64)  # a shared offset: centering removes it
    assert matrix_entropy(x) == pytest.approx(math.log(rank) / math.log(min(n, d)), abs=1e-9)


def test_matrix_entropy_edges():
    assert matrix_entropy(torch.ones(5, 3)) == 0.0  # centered to zero
    assert 0.9 < matrix_entropy(torch.randn(400, 8)) <= 1.0  # isotropic noise: nearly 1
    with pytest.raises(MassiveLensError, match="pos >= 2"):
        matrix_entropy(torch.ones(1, 3))


# --------------------------------------------------------------------------- compression valley


def test_compression_valley_columns_and_ranges():
    model = tiny_model("llama")
    with untouched(model):
        valley = compression_valley(model, TEXT, seq_len=32, n_seqs=3, ablate=None, layers=[0, 2])
    frame = valley.to_frame()
    assert sorted(frame["layer"]) == [0, 2] and set(frame["setting"]) == {"original"}
    for col in ("entropy", "sink_rate"):
        assert frame[col].between(0, 1).all()
        assert (frame[f"{col}_low"] <= frame[col] + 1e-12).all() and (frame[col] <= frame[f"{col}_high"] + 1e-12).all()
    assert (frame["n_seqs"] == 3).all() and len(valley.per_seq) == 6


def test_compression_valley_planted_massive_activation_is_removed_by_zero_every():
    """A planted 600 in dim 7 at BOS makes the first token's norm huge and the sequence nearly rank
    one; zeroing it at every layer takes the norm down and the entropy up."""
    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=model.tokenizer.bos_token_id, trigger_dim=3)
    with untouched(model):
        valley = compression_valley(model, TEXT, seq_len=32, n_seqs=3, calibration=CALIB)
    orig, ablated = valley.setting("original").set_index("layer"), valley.setting("zero_every").set_index("layer")
    assert orig.loc[3, "first_norm"] > 500 and ablated.loc[3, "first_norm"] < 100
    assert ablated.loc[3, "entropy"] > 100 * orig.loc[3, "entropy"]  # rank one no longer
    assert "zero_every" in valley.summary()


def test_compression_valley_bad_input_and_model_left_as_found():
    model = tiny_model("llama")
    with pytest.raises(MassiveLensError, match="unknown ablate"):
        compression_valley(model, TEXT, seq_len=32, n_seqs=2, ablate="nonsense")
    with pytest.raises(MassiveLensError, match="has no token-specific massive"):  # nothing to ablate: say so
        compression_valley(model, TEXT, seq_len=32, n_seqs=2, calibration=CALIB)
    model.train()

    def boom(x, hook):
        raise RuntimeError("boom")

    with untouched(model), pytest.raises(RuntimeError, match="boom"):
        compression_valley(model, TEXT, seq_len=32, n_seqs=2, ablate=None, hooks=[("blocks.1.hook_resid_post", boom)])
    assert all(m.training for m in model.modules())


def _valley(entropy, first_norm, setting="original"):
    n = len(entropy)
    return pd.DataFrame(dict(setting=setting, layer=range(n), entropy=entropy,
                             entropy_low=[e - 0.002 for e in entropy], entropy_high=[e + 0.002 for e in entropy],
                             first_norm=first_norm, first_norm_ratio=1.0, sink_rate=0.5, n_seqs=4))


def test_valley_summary_names_a_near_tie_and_says_whether_the_valley_is_there():
    """Layer 0 is lowest by less than ENTROPY_TIE: a near-tie with layer 3, named as such; no
    middle layer is below both ends by more than the tolerance, so no valley."""
    tied = _valley([0.300, 0.60, 0.62, 0.300 + ENTROPY_TIE / 2, 0.65, 0.35], [10, 20, 30, 40, 50, 60])
    text = CompressionValley(frame=tied, per_seq=tied.assign(seq=0), model_name="m", seq_len=32).summary()
    assert "lowest at 2 layers within 0.01 of each other, a near-tie: layers 0, 3" in text
    assert "lowest at layer 0" not in text
    assert "compression valley (the paper's claim): NOT present on this model" in text
    assert valley_layers(tied) == []


def test_valley_summary_says_the_claim_holds_where_the_norm_peaks_in_the_valley():
    deep = _valley([0.7, 0.6, 0.05, 0.1, 0.6, 0.5], [10, 20, 900, 800, 50, 40])
    ablated = _valley([0.7, 0.6, 0.65, 0.6, 0.6, 0.5], [10, 20, 30, 30, 50, 40], setting="zero_every")
    both = pd.concat([deep, ablated], ignore_index=True)
    text = CompressionValley(frame=both, per_seq=both.assign(seq=0), model_name="m", seq_len=32).summary()
    assert "matrix entropy lowest at layer 2 (0.050" in text
    assert "present on this model" in text and "layers 2, 3" in text
    assert "peaks inside it (layer 2): the claim holds" in text
    assert text.splitlines()[-1].endswith("valley absent")
    off = _valley([0.7, 0.6, 0.05, 0.1, 0.6, 0.5], [10, 20, 30, 40, 50, 900])
    assert "peaks outside it (layer 5)" in CompressionValley(frame=off, per_seq=off.assign(seq=0), model_name="m",
                                                             seq_len=32).summary()


# --------------------------------------------------------------------------- streaming window


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_streaming_window_equals_the_cache_loop_on_one_layer(family):
    """One layer: a token's keys and values depend only on its embedding, so StreamingLLM's
    prediction at query t is a fresh pass over [first k tokens] + [last W tokens] (positions
    within the cache), computed here independently."""
    model = tiny_model(family, num_hidden_layers=1)
    tokens = torch.randint(1, 250, (2, 40))
    window = 8
    with untouched(model):
        run = streaming_window(model, tokens, window=window, sinks=(0, 1, 2, 4), census=False, bins=4)
    for i, k in enumerate((0, 1, 2, 4)):
        for t in (20, 38):
            ctx = torch.cat([tokens[:, :k], tokens[:, t - window + 1:t + 1]], 1)
            ref = torch.nn.functional.cross_entropy(model(ctx)[:, -1], tokens[:, t + 1], reduction="none")
            assert torch.allclose(run.losses[i + 1][:, t], ref, atol=1e-4), (k, t)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_streaming_window_as_long_as_the_text_is_full_attention_exactly(family):
    model = tiny_model(family)
    tokens = torch.randint(1, 250, (2, 48))
    run = streaming_window(model, tokens, window=48, sinks=(0, 1, 4), census=False)
    for i in range(1, 4):
        assert torch.equal(run.losses[0], run.losses[i])
    assert (run.to_frame()["ratio"] == 1.0).all()


def test_streaming_window_small_window_differs_and_reports():
    model = tiny_model("llama")
    run = streaming_window(model, TEXT, window=8, sinks=(0, 1), seq_len=48, n_seqs=2, bins=6)
    frame = run.to_frame()
    assert frame["setting"].tolist() == ["full", "k=0", "k=1"] and (frame["window"] == 8).all()
    assert not torch.equal(run.losses[0], run.losses[1])
    for i in (1, 2):  # before the window fills nothing changes, exactly
        assert torch.equal(run.losses[0][:, :7], run.losses[i][:, :7])
    assert set(run.curve["setting"]) == {"full", "k=0", "k=1"} and run.predicted_k >= 0
    assert "window 8" in run.summary()


def test_streaming_window_refuses_a_rotation_it_cannot_move():
    """cos/sin that are not a rotation linear in the position (here: scaled) are refused."""
    model = tiny_model("llama")
    scaled = [(f"blocks.{layer}.attn.hook_cos", lambda cos, hook: cos * 0.5) for layer in range(model.cfg.n_layers)]
    with untouched(model), model.hooks(fwd_hooks=scaled), pytest.raises(MassiveLensError, match="rotate-half"):
        streaming_window(model, TEXT, window=8, sinks=(1,), seq_len=32, n_seqs=1, census=False)


def test_rotation_check_takes_long_tables_and_refuses_a_bent_one():
    """At 8,192 positions the model's float32 angle p * theta has rounded by ~5e-4 rad: still a
    rotation linear in the position (a table from transformers' own rotary embedding passes); an
    angle that bends with the position does not."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from massive_lens.effects.cache import _check_rotation

    view = ModelView(tiny_model("llama"))
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192)
    n = 8192
    x = torch.zeros(1, n, 64)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(n)[None])
    seen = {"cos": cos, "sin": sin, "rot_k": torch.zeros(1, n, 1, 64)}
    _check_rotation(view, 0, seen)  # no error
    angle = torch.arange(n, dtype=torch.float64)[:, None] * (1 + 1e-5 * torch.arange(n, dtype=torch.float64))[:, None]
    freqs = angle * (1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))[None]
    bent = torch.cat([freqs, freqs], -1)
    with pytest.raises(MassiveLensError, match="rotate-half"):
        _check_rotation(view, 0, {**seen, "cos": bent.cos()[None].float(), "sin": bent.sin()[None].float()})


def test_streaming_window_positions_and_bad_input():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(MassiveLensError, match="positions='original'"):
        streaming_window(gpt2, TEXT, window=8, sinks=(1,), seq_len=32, n_seqs=1, census=False)
    run = streaming_window(gpt2, TEXT, window=8, sinks=(0, 1), seq_len=32, n_seqs=1, census=False,
                           positions="original")
    assert run.positions == "original"
    model = tiny_model("llama")
    for kwargs, match in [(dict(window=0), "window"), (dict(sinks=(-1,)), "sinks"), (dict(sinks=()), "sinks"),
                          (dict(positions="nowhere"), "positions")]:
        with untouched(model), pytest.raises(MassiveLensError, match=match):
            streaming_window(model, TEXT, seq_len=32, n_seqs=1, census=False, **{"window": 8, **kwargs})


# --------------------------------------------------------------------------- over-mixing


def _diagonal(pattern, hook):
    return torch.eye(pattern.shape[-1], dtype=pattern.dtype, device=pattern.device).expand_as(pattern).clone()


def test_over_mixing_cannot_spread_with_attention_masked_to_the_diagonal():
    model = tiny_model("llama")
    hooks = [(f"blocks.{layer}.attn.hook_pattern", _diagonal) for layer in range(model.cfg.n_layers)]
    with untouched(model):
        mix = over_mixing(model, TEXT, seq_len=24, n_seqs=2, remove=False, hooks=hooks)
    frame = mix.to_frame()
    assert (frame["spread"] == 0).all() and (frame["self_change"] > 0).all()


def test_over_mixing_spreads_and_compares_with_sinks_removed():
    model = tiny_model("llama")
    with untouched(model):
        mix = over_mixing(model, TEXT, seq_len=24, n_seqs=2, calibration=CALIB)
    frame = mix.to_frame()
    assert set(frame["setting"]) == {"sinks_intact", "sink_attention_removed"}
    assert (frame["spread"] > 0).all()
    assert (frame[frame["setting"] == "sinks_intact"]["self_change"] > 0.005).all()  # the nudge is 1% of the norm
    assert "sinks removed" in mix.summary() or "removed" in mix.summary()


def test_over_mixing_bad_input():
    model = tiny_model("llama")
    for kwargs, match in [(dict(pos=23), "pos must"), (dict(pos=-1), "pos must"), (dict(scale=0), "scale"),
                          (dict(scale=float("nan")), "scale"), (dict(batch_size=0), "batch_size")]:
        with pytest.raises(MassiveLensError, match=match):
            over_mixing(model, TEXT, seq_len=24, n_seqs=1, remove=False, **kwargs)


# --------------------------------------------------------------------------- the result contract


def test_effect_results_save_load_and_plot(tmp_path):
    model = tiny_model("llama")
    results = [compression_valley(model, TEXT, seq_len=24, n_seqs=2, ablate=None),
               streaming_window(model, TEXT, window=8, sinks=(0, 1), seq_len=32, n_seqs=2, census=False),
               over_mixing(model, TEXT, seq_len=24, n_seqs=2, remove=False)]
    for i, result in enumerate(results):
        back = load(result.save(tmp_path / str(i)))
        assert back.summary() == result.summary()
        assert back.to_frame().equals(result.to_frame())
        assert result.plot() is not None and result._repr_html_()


# --------------------------------------------------------------------------- the repeated-token circuit


def test_repeated_token_probe_finds_and_patches_a_planted_circuit():
    """Neuron 5 of layer 1 writes 600 into dim 7 at every BOS: repeat BOS and every repeat looks
    like the first token from position 1; the probe names that neuron and zeroing it stops it."""
    model = tiny_model("llama")
    bos = model.tokenizer.bos_token_id
    plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=bos, trigger_dim=3)
    with untouched(model):
        probe = repeated_token_probe(model, bos, 16, text=TEXT, seq_len=24, n_seqs=2)
    assert (probe.dim, probe.onset, probe.neuron_layer, probe.neuron) == (7, 1, 1, 5)
    frame = probe.to_frame()
    assert (frame["norm_ratio"][1:] > 0.9).all() and (frame["patched_ratio"][1:] < 0.1).all()
    assert (frame["kl"][1:] > 0).all() and frame["kl"][0] == pytest.approx(0, abs=1e-6)  # first: not patched
    assert set(probe.ppl["setting"]) == {"original", "patched"} and len(probe.heads) == model.cfg.n_heads
    assert "neuron 5 of layer 1" in probe.summary()


def test_repeated_token_probe_without_a_circuit_and_bad_input():
    model = tiny_model("llama")
    probe = repeated_token_probe(model, "a", 12, like=1.0, text=TEXT, seq_len=24, n_seqs=2)
    assert probe.neuron == -1 and probe.frame["patched_ratio"].isna().all()
    bad = [(("ab", 16), {}, "2 tokens"), (("a", 4), {}, "n must"), (("a", 16), {"like": 0}, "like")]
    for args, kwargs, match in bad:
        with untouched(model), pytest.raises(MassiveLensError, match=match):
            repeated_token_probe(model, *args, **kwargs)


def test_repeated_token_probe_with_another_first_token():
    """With the repeated token first, every position of a rotary model computes the same state (the
    summary says the match is trivial); with first= another token, the repeats differ from it."""
    model = tiny_model("llama")
    same = repeated_token_probe(model, "a", 12, first="a", text=TEXT, seq_len=24, n_seqs=2)
    assert same.frame["norm_ratio"].to_numpy() == pytest.approx(1.0, rel=1e-5) and "trivially" in same.summary()
    other = repeated_token_probe(model, "a", 12, first="b", text=TEXT, seq_len=24, n_seqs=2)
    assert other.first == "b" and not other.frame["norm_ratio"][1:].to_numpy() == pytest.approx(1.0, rel=1e-3)
    assert "after 'b'" in other.summary() and "trivially" not in other.summary()
    with untouched(model), pytest.raises(MassiveLensError, match="2 tokens"):
        repeated_token_probe(model, "a", 12, first="ab")


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("argv", [["valley", "--seq-len", "24", "--n-seqs", "2", "--layers", "0,1"],
                                  ["streaming", "--seq-len", "32", "--n-seqs", "1", "--window", "8", "--sinks", "0,1"],
                                  ["mixing", "--seq-len", "24", "--n-seqs", "2", "--calibration", CALIB]])
def test_effects_command_runs_each_experiment(argv):
    import argparse

    from massive_lens.effects.cli import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv + ["--corpus", TEXT])
    model = tiny_model("llama")
    if args.experiment == "valley":
        plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=model.tokenizer.bos_token_id, trigger_dim=3)
        args.calibration = CALIB
    with untouched(model):
        assert run(args, model).summary()


def test_effects_command_checks_before_loading(tmp_path, capsys):
    from massive_lens.cli import main

    afile = tmp_path / "file"
    afile.write_text("x")
    assert main(["effects", "valley", "--out-dir", str(afile)]) == 2
    assert main(["effects", "streaming", "--sinks", "0,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_compression_valley_reads_either_path_alike_and_an_attention_edit_on_the_eager_one(monkeypatch):
    """The one pass: on the LSE path (a crossover within the tiny model's context) the same rows as on the
    eager pattern; a caller's hook that edits the pattern makes choose_path take the eager path (the
    kernel would skip it), so the edit is read (the same rows as below the crossover) at any length."""
    model = tiny_model("llama")

    def edit(pattern, hook):  # all of layer 1's attention on the first token
        out = torch.zeros_like(pattern)
        out[..., 0] = 1.0
        return out

    got = {}
    for crossover in (10_000, 8):
        monkeypatch.setattr("massive_lens.core.attention_pass.LSE_FROM", crossover)
        for name, hooks in (("plain", ()), ("edit", [("blocks.1.attn.hook_pattern", edit)])):
            got[name, crossover] = compression_valley(model, TEXT, seq_len=32, n_seqs=3, batch_size=2, ablate=None,
                                                      hooks=hooks).per_seq.set_index(["seq", "layer"])
    for name in ("plain", "edit"):  # the first-token mass in float32 from either path: within rounding
        pd.testing.assert_frame_equal(got[name, 8], got[name, 10_000], rtol=1e-5, atol=1e-6)
    edited = got["edit", 8].xs(1, level="layer")
    assert (edited["sink_rate"] == 1.0).all() and not got["plain", 8].xs(1, level="layer")["sink_rate"].eq(1.0).all()
