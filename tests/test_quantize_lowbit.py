"""Low-bit settings (massive_lens.quant): rotations exact before quantization, a plain-torch
reference of W4A4 and of a fused Hadamard rotation, kept sinks, the model left as found, bad input."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import plant_massive, untouched
from matrix import LAYERS, decoder_architectures, tiny_hf

from massive_lens import load
from massive_lens.errors import MassiveLensError
from massive_lens.models import byte_tokenizer, tiny_model, wrap_hf_model
from massive_lens.quant import Quantization, Setting, quantize, quantize_grid
from massive_lens.quant.fake import fake_quant, rtn
from massive_lens.quant.rotation import Rotation, hadamard_factors
from massive_lens.quant.simulate import Bits, Simulator
from massive_lens.quant.sites import rotation_sites

TEXT = "The cat sat on the mat. The dog ran, and the bird flew.\n" * 40
LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")  # must rotate exactly


def bridge_and_ref(arch: str, layers: int = LAYERS) -> tuple:
    """A bridge over a seeded tiny ``arch`` and a clean, never wrapped copy with the same weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return wrap_hf_model(tiny_hf(arch, layers), byte_tokenizer(), name=f"tiny-{arch}"), tiny_hf(arch, layers)


def rotated_logits(model, tokens, kind: str, seed: int = 0) -> torch.Tensor:
    sites = rotation_sites(model, include_head=False)
    residual = Rotation(kind, model.cfg.d_model, seed=seed)
    online = {w: Rotation("hadamard", w, seed=seed + 1) for w in {s.module.in_features for s in sites
                                                                  if s.role == "down"}}
    with torch.no_grad(), Simulator(sites, Bits(None, None, None), residual, online).attached():
        return model(tokens)


# --------------------------------------------------------------------------- rotations


@pytest.mark.parametrize("n", [1, 2, 12, 20, 36, 64, 140, 576, 1536])
def test_hadamard_factors_make_a_hadamard_matrix(n):
    a, b = hadamard_factors(n)
    h = torch.kron(a, b)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, n * torch.eye(n, dtype=h.dtype))


def test_no_hadamard_is_an_error():
    with pytest.raises(MassiveLensError, match="no Hadamard matrix of order 92"):
        hadamard_factors(92)


@pytest.mark.parametrize("kind", ["orthogonal", "hadamard"])
def test_rotations_are_orthogonal_and_randomized(kind):
    q = Rotation(kind, 48, seed=0).apply(torch.eye(48))
    torch.testing.assert_close(q @ q.T, torch.eye(48), atol=1e-5, rtol=0)
    torch.testing.assert_close(Rotation(kind, 48, seed=0).apply_t(torch.eye(48)), q.T, atol=1e-6, rtol=0)
    assert not torch.allclose(q, Rotation(kind, 48, seed=1).apply(torch.eye(48)))
    if kind == "hadamard":  # a signed Hadamard matrix, scaled: every entry +-1/sqrt(n)
        torch.testing.assert_close(q.abs(), torch.full((48, 48), 48**-0.5), atol=1e-6, rtol=0)


def _rotation_cases() -> list:
    """Every decoder of the architecture matrix; the quick loop (tiny llama models only) keeps the llama."""
    return [pytest.param(arch, id=arch, marks=() if arch == "LlamaForCausalLM" else pytest.mark.heavy)
            for arch in decoder_architectures()]


@pytest.mark.parametrize("arch", _rotation_cases())
def test_rotation_is_exact_before_quantization_or_a_clear_error(arch):
    """Every decoder of the matrix: the rotated model equals the model to 1e-5 (float32), or
    rotation_sites refuses it with a MassiveLensError that says why."""
    errors = []
    for layers in (LAYERS, 4):  # as the matrix: a hybrid whose first three layers are all linear attention needs a 4th
        try:
            model, _ = bridge_and_ref(arch, layers)
            tokens = torch.tensor([[model.tokenizer.bos_token_id, 72, 105, 46, 10, 84, 104, 101]])
            with torch.no_grad():
                full = model(tokens)
            break
        except Exception as exc:  # noqa: BLE001 - the matrix skips what transformers cannot build offline
            errors.append(exc)
    else:
        pytest.skip(f"unbuildable: {errors[-1]}")
    with untouched(model):
        try:
            logits = {kind: rotated_logits(model, tokens, kind) for kind in ("hadamard", "orthogonal")}
        except MassiveLensError as exc:
            assert arch not in LLAMA_LIKE, f"{arch} refused: {exc}"
            assert "rotation=None" in str(exc)
            return
    for kind, got in logits.items():
        err = float((got - full).abs().max() / full.abs().max())
        assert err < 1e-5, f"{arch} {kind}: rotated logits differ by {err:.1e}"


@pytest.mark.parametrize(("family", "why"), [("gpt2", "not an RMSNorm"), ("gemma3", "post-norm")])
def test_rotation_names_why_it_cannot_apply(family, why):
    model = tiny_model(family, num_hidden_layers=1)
    with untouched(model), pytest.raises(MassiveLensError, match=why):
        quantize(model, TEXT, rotation="hadamard", seq_len=32, n_seqs=2)


# --------------------------------------------------------------------------- an independent reference


def _ref_quant(t: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Symmetric round-to-nearest, one scale per row of the last axis (written here, not imported)."""
    qmax = 2 ** (bits - 1) - 1
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    return torch.clamp(torch.round(t / scale), -qmax, qmax) * scale


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while len(h) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def _fuse(hf, q: torch.Tensor, h_mlp: torch.Tensor) -> list:
    """QuaRot on a Hugging Face Llama, by hand: gains folded, Q fused into every weight, the online
    Hadamard before down_proj as a pre-hook. Returns the hooks to remove."""
    inner = hf.model
    with torch.no_grad():
        inner.embed_tokens.weight.copy_(inner.embed_tokens.weight @ q)
        for layer in inner.layers:
            for norm, readers in ((layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                           layer.self_attn.v_proj]),
                                  (layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj])):
                for lin in readers:
                    lin.weight.copy_((lin.weight * norm.weight) @ q)
                norm.weight.fill_(1.0)
            layer.self_attn.o_proj.weight.copy_(q.T @ layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight.copy_(q.T @ layer.mlp.down_proj.weight @ h_mlp)
        hf.lm_head.weight.copy_((hf.lm_head.weight * inner.norm.weight) @ q)
        inner.norm.weight.fill_(1.0)
    return [layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: (a[0] @ h_mlp,)) for layer in inner.layers]


def _w4a4(hf) -> list:
    """Per-token 4-bit inputs and per-channel 4-bit weights on every linear layer but the head."""
    handles = []
    for module in hf.model.modules():
        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.copy_(_ref_quant(module.weight))
            handles.append(module.register_forward_pre_hook(lambda m, a: (_ref_quant(a[0]),)))
    return handles


def _ref_logits(hf, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens).logits


def _lib_logits(model, tokens, rotation: str | None) -> torch.Tensor:
    """The library's W4A4 (per-token activations, per-channel weights), seen as logits."""
    sites = rotation_sites(model, include_head=False)
    residual = Rotation(rotation, model.cfg.d_model, seed=0) if rotation else None
    online = {model.cfg.d_mlp: Rotation("hadamard", model.cfg.d_mlp, seed=1)} if rotation else None
    with torch.no_grad(), Simulator(sites, Bits(4, 4, None), residual, online).attached():
        return model(tokens)


@pytest.fixture(scope="module")
def planted_llama():
    """A tiny Llama bridge with a planted massive activation, and a clean Hugging Face copy."""
    model, ref = bridge_and_ref("LlamaForCausalLM", layers=3)
    bos = model.tokenizer.bos_token_id
    plant_massive(model, layer=1, neuron=5, dim=7, value=3000.0, trigger=bos, trigger_dim=3)
    state = {k.replace("._original_component", ""): v for k, v in model.original_model.state_dict().items()}
    assert not ref.load_state_dict(state, strict=False).missing_keys
    return model, ref


def test_w4a4_and_hadamard_agree_with_a_plain_torch_reference(planted_llama):
    model, ref = planted_llama
    tokens = torch.cat([model.to_tokens(TEXT[:60])[:, :32], model.to_tokens(TEXT[5:70])[:, :32]])
    d, d_mlp = model.cfg.d_model, model.cfg.d_mlp
    full = _ref_logits(ref, tokens)
    plain = copy.deepcopy(ref)
    hooks = _w4a4(plain)
    want = {None: _ref_logits(plain, tokens)}
    rotated = copy.deepcopy(ref)
    q = Rotation("hadamard", d, seed=0).apply(torch.eye(d))  # the library's random signs:
    signs = torch.sign(q[:, 0]) * torch.sign(_sylvester(d)[:, 0])
    torch.testing.assert_close(q, signs[:, None] * _sylvester(d) / d**0.5)  # diag(s) H / sqrt(n), H Sylvester
    h_mlp = Rotation("hadamard", d_mlp, seed=1).apply(torch.eye(d_mlp))
    hooks += _fuse(rotated, q, h_mlp)
    torch.testing.assert_close(_ref_logits(rotated, tokens), full, atol=1e-5, rtol=1e-5)  # fused = the model
    hooks += _w4a4(rotated)
    want["hadamard"] = _ref_logits(rotated, tokens)
    for handle in hooks:
        handle.remove()
    with untouched(model):
        for rotation, ref_logits in want.items():
            effect = (ref_logits - full).abs().max()
            got = _lib_logits(model, tokens, rotation)
            assert effect > 0.01 and (got - ref_logits).abs().max() < effect / 20, rotation
        frame = quantize_grid(model, torch.cat([tokens, tokens]), settings=["W4A4", "W4A4+hadamard"]).to_frame()
    assert frame.max_abs[1] < frame.max_abs[0] / 1.5  # the planted outlier (sqrt(d) once normalized), spread


# --------------------------------------------------------------------------- kept sinks and readings


def test_kept_sinks_are_exact_and_help_static_per_tensor(planted_llama):
    model, _ = planted_llama
    grid = quantize_grid(model, TEXT, settings=["W8A8@tensor", "W8A8@tensor+kvsink", "W8A8KV4@tensor+prefix",
                                                 "W16A16@tensor+kvsink"], seq_len=32, n_seqs=2)
    f = grid.to_frame().set_index("setting")
    assert f.loc["W8A8@tensor+kvsink", "err_sink"] == 0.0  # the sink (BOS) stays in full precision
    assert f.loc["W8A8@tensor", "err_sink"] > 0
    assert f.loc["W8A8@tensor+kvsink", "gap"] < f.loc["W8A8@tensor", "gap"] / 4
    assert f.loc["W16A16@tensor+kvsink", "gap"] == pytest.approx(0.0, abs=1e-6)
    assert f.loc["W8A8KV4@tensor+prefix", "err_other"] > 0 and f.kv.tolist() == [16, 16, 4, 16]
    tokens = grid.tokens
    assert set(tokens.group) <= {"sink", "massive", "other"} and (tokens.error >= 0).all()


def test_result_contract(planted_llama, tmp_path):
    model, _ = planted_llama
    result = quantize(model, TEXT, weights=8, activations=8, kv=8, granularity="group", symmetric=False,
                      group_size=16, seq_len=32, n_seqs=3)
    row = result.to_frame().iloc[0]
    assert row.setting == "W8A8KV8" and row.granularity == "group" and not row.symmetric
    assert row.gap_low <= row.gap <= row.gap_high and row.n_seqs == 3
    assert row.ppl_ratio == pytest.approx(math.exp(row.gap), rel=1e-12)  # both in float64 (not a float32 exp)
    assert "W8A8KV8" in result.summary() and "no GPTQ" in result.summary()
    assert result.plot() is not None
    loaded = load(result.save(tmp_path / "q"))
    assert isinstance(loaded, Quantization) and loaded.summary() == result.summary()
    assert loaded.tokens.equals(result.tokens)


def test_group_and_asymmetric_rounding():
    x = torch.randn(3, 200)
    x[0, 150] = 100.0
    grouped = fake_quant(x, 4, "group", group_size=128)
    assert (grouped[0, :128] - x[0, :128]).abs().max() < 0.5  # the outlier's group is the only one hurt
    assert (fake_quant(x, 4, "token")[0, :128] - x[0, :128]).abs().max() > 1.0
    levels = rtn(torch.linspace(0, 3, 100), 4, 0.0, 3.0, symmetric=False).unique()
    assert len(levels) == 16 and levels.min() == 0 and levels.max() == pytest.approx(3.0)


# --------------------------------------------------------------------------- left as found, bad input


def test_model_left_as_found_after_an_error_mid_run(planted_llama, monkeypatch):
    model, _ = planted_llama
    model.train()
    calls = {"n": 0}
    real = fake_quant

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr("massive_lens.quant.simulate.fake_quant", flaky)
    try:
        with untouched(model), pytest.raises(RuntimeError, match="boom"):
            quantize(model, TEXT, kv=4, rotation="hadamard", seq_len=32, n_seqs=2)
        assert calls["n"] == 20
        assert all(m.training for m in model.modules())  # every module's mode put back
        assert next(model.parameters()).dtype == torch.float32
    finally:
        model.eval()


def test_every_setting_leaves_the_model_as_found(planted_llama):
    model, _ = planted_llama
    with untouched(model):
        quantize_grid(model, TEXT, settings=["W4A4KV4@tensor+orthogonal+kvsink", "W4A4@channel+prefix",
                                             "W8A4KV8@group+hadamard"], seq_len=32, n_seqs=2, include_head=True)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(settings=["W4"]), "bad low-bit setting"),
    (dict(settings=["W4A4+gptq"]), "bad low-bit setting"),
    (dict(settings=[]), "settings is empty"),
    (dict(settings=["W1A4"]), "from 2 to 16"),
    (dict(granularity="row"), "granularity"),
    (dict(group_size=0), "group_size"),
])
def test_bad_grid_input(planted_llama, kwargs, match):
    model, _ = planted_llama
    with untouched(model), pytest.raises(MassiveLensError, match=match):
        quantize_grid(model, TEXT, seq_len=32, n_seqs=2, **kwargs)


def test_bad_quantize_input(planted_llama):
    model, _ = planted_llama
    for kwargs, match in ((dict(rotation="quarot"), "rotation must be"), (dict(keep_sinks="all"), "keep_sinks"),
                          (dict(kv=32), "kv bits"), (dict(n_seq=3), "unknown options")):
        with pytest.raises(MassiveLensError, match=match):
            quantize(model, TEXT, seq_len=32, n_seqs=2, **kwargs)
    assert Setting.parse("W4A16").name == "W4A16"
    with pytest.raises(MassiveLensError, match="kv"):
        quantize(tiny_model("gpt2", num_hidden_layers=1), TEXT, kv=4, seq_len=32, n_seqs=2)


# --------------------------------------------------------------------------- the command


def test_quantize_command(monkeypatch, tmp_path, capsys):
    from massive_lens.cli import COMMANDS, build_parser, main
    from massive_lens.quant import cli

    assert "quantize" in COMMANDS
    assert build_parser().parse_args(["quantize", "--granularity", "tensor"]).granularity == "tensor"
    monkeypatch.setattr(cli, "load_model", lambda *args: tiny_model("llama", num_hidden_layers=2))
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "out"
    assert main(["quantize", "--corpus", str(corpus), "--settings", "W8A8,W4A4KV4+hadamard", "--seq-len", "32",
                 "--n-seqs", "2", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "W4A4KV4+hadamard" in printed and "gap_low" in printed
    assert isinstance(load(out / "result"), Quantization)
    assert (out / "quantization.csv").is_file() and (out / "quantization.png").is_file()
    for argv, match in ((["--settings", "W4"], "bad low-bit setting"), (["--corpus", str(tmp_path / "no.txt")],
                                                                        "no such file"),
                        (["--n-seqs", "0"], "at least 1"), (["--out-dir", str(corpus)], "is a file")):
        assert main(["quantize", *argv]) == 2
        assert match in capsys.readouterr().err


# --------------------------------------------------------------------------- memory: the loss at the head


def test_chunked_loss_equals_the_full_logits_and_holds_none(planted_llama, monkeypatch):
    from massive_lens.core import loss as chunked
    from massive_lens.core.loss import next_token_stats
    from massive_lens.core.model_view import ModelView

    model, _ = planted_llama
    view = ModelView(model)
    tokens = torch.cat([model.to_tokens(TEXT[:60])[:, :40], model.to_tokens(TEXT[7:70])[:, :40]])
    want = next_token_stats(model(tokens), tokens)[0]
    loss = chunked.NextTokenLoss(model, lambda x, hooks: view.forward(view.tokenize(x), list(hooks),
                                                                      check_finite=False))
    monkeypatch.setattr(chunked, "head_positions", lambda d_vocab, weights: 7)  # several slices, the last short
    assert loss.check(tokens)
    seen = []
    handle = loss.head.register_forward_hook(lambda m, a, out: seen.append(out.shape[:-1]))
    try:
        got = loss(tokens).loss
    finally:
        handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert max(s.numel() for s in seen) <= 7  # the head never ran on more than one slice
    with untouched(model):
        grid = quantize_grid(model, tokens, settings=["W16A16", "W8A8"], seq_len=40, n_seqs=1)
    assert grid.to_frame().gap[0] == pytest.approx(0.0, abs=1e-6)


def test_logits_changed_after_the_head_fall_back_to_the_full_logits(planted_llama):
    from massive_lens.core.loss import NextTokenLoss
    from massive_lens.core.model_view import ModelView

    model, _ = planted_llama
    view = ModelView(model)
    tokens = model.to_tokens(TEXT[:60])[:, :24]
    model.add_hook("unembed.hook_out", lambda x, hook: x * 2.0, is_permanent=True)  # a logit scale (Granite's)
    try:
        loss = NextTokenLoss(model, lambda x, hooks: view.forward(view.tokenize(x), list(hooks), check_finite=False))
        assert not loss.check(tokens)
        grid = quantize_grid(model, torch.cat([tokens, tokens]), settings=["W16A16"], seq_len=24, n_seqs=1)
        assert grid.to_frame().gap[0] == pytest.approx(0.0, abs=1e-6)
    finally:
        model.reset_hooks(including_permanent=True)


def test_the_grid_checks_every_setting_first_and_runs_those_that_can(monkeypatch):
    """Issue 37: on a post-norm model a rotated setting used to raise after the settings before it
    had run, discarding them, and pointed at ``rotation=None``, which the grid does not take. Now
    it is named with the reason before any setting's pass, and the others run."""
    from massive_lens.quant.run import Run

    model = tiny_model("gemma3", num_hidden_layers=1)
    evaluated = []
    evaluate = Run.evaluate
    monkeypatch.setattr(Run, "evaluate", lambda run, s, b, **kw: evaluated.append(s.name) or evaluate(run, s, b, **kw))
    with untouched(model):
        grid = quantize_grid(model, TEXT, settings=["W4A4+hadamard", "W4A4", "W4A4+hadamard+kvsink"],
                             seq_len=32, n_seqs=2)
    assert evaluated == ["W4A4"] and grid.to_frame().setting.tolist() == ["W4A4"]
    assert [name for name, _ in grid.skipped] == ["W4A4+hadamard", "W4A4+hadamard+kvsink"]
    assert all("post-norm" in why and "rotation=None" not in why for _, why in grid.skipped)
    assert "leave the rotation out ('W4A4+kvsink')" in grid.skipped[1][1]
    assert "W4A4+hadamard: not run: " in grid.summary()
    with pytest.raises(MassiveLensError, match="none of the settings can run.*post-norm"):
        quantize_grid(model, TEXT, settings=["W4A4+hadamard"], seq_len=32, n_seqs=2)
