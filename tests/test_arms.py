"""The controls of zero ablation (``resample``, ``noise``, ``template``): known answers on planted
tiny models, the calibration that feeds them (saved and loaded, old saves refused clearly), the
summary's "zero only" flag, and the nnsight backend."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch
from helpers import untouched
from planting import SINK_DIM, TEXT, bos_tokens, plant_sink

from massive_lens import load, perplexity, run_interventions, tiny_model
from massive_lens.attention.sinks import SinkSet
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import ablate_massive, calibrate
from massive_lens.interventions.arm_stats import POOL_COLUMNS, arm_lines

FAMILIES = ("llama", "gpt2", "gemma3", "qwen2")


@pytest.fixture(scope="module", params=FAMILIES)
def planted(request):
    model = tiny_model(request.param)
    plant_sink(model)
    calib = calibrate(model, bos_tokens(model, TEXT, 24, 4), progress=False)
    return model, calib, bos_tokens(model, TEXT, 24, 4, offset=200)


def first_edit(model, iv, tokens):
    """The residual stream at the planted dim just after the intervention's edit at its first layer."""
    seen = {}
    name = ModelView(model).hook_name(min(iv._state.calib.dims), "resid_post")

    def grab(resid, hook):
        seen["x"] = resid[..., SINK_DIM].detach().clone()

    with torch.no_grad(), iv, model.hooks(fwd_hooks=[(name, grab)]):
        model(tokens)
    return seen["x"]


def test_template_on_a_first_token_sink_is_the_untouched_model(planted):
    """A BOS sees only itself, so its post-norm vectors are the same for every input: clamping its
    spike and restoring the calibrated vectors gives the untouched losses (to float rounding), while
    zero does not; the spike itself is gone downstream."""
    model, calib, tokens = planted
    base = perplexity(model, tokens, progress=False).per_seq
    with untouched(model):
        iv = ablate_massive(model, "template", calibration=calib)
        template = perplexity(model, tokens, hooks=iv, progress=False).per_seq
        zero = perplexity(model, tokens, hooks=ablate_massive(model, "zero", calibration=calib),
                          progress=False).per_seq
    torch.testing.assert_close(template, base, rtol=1e-5, atol=1e-5)
    assert (zero - base).abs().max() > 1e-3
    assert iv.check(tokens).attrs["verdict"].startswith("template (first layer): removed downstream")


def test_template_leaves_the_embeddings_when_the_final_norm_also_runs_first(planted):
    """NanoChat normalizes its embeddings with its final norm, so ``ln_final.hook_out`` fires before
    block 0 too. The template belongs to the last firing only: with the embeddings normalized that
    way, template is still the untouched model on every batch (it wrote the final template into the
    embeddings of the targeted positions from the second batch on, when targets were left over)."""
    model, _, tokens = planted
    embed = model.original_model.get_input_embeddings()

    def norm_first(module, args, out):  # the embeddings go through the final norm, as in NanoChat
        return model.ln_final(out)

    handle = embed.register_forward_hook(norm_first)
    try:
        calib = calibrate(model, bos_tokens(model, TEXT, 24, 4), progress=False)
        base = perplexity(model, tokens, batch_size=2, progress=False).per_seq
        with untouched(model):
            iv = ablate_massive(model, "template", calibration=calib)
            template = perplexity(model, tokens, hooks=iv, batch_size=2, progress=False).per_seq
    finally:
        handle.remove()
    assert calib.dims and len(tokens) > 2  # a second batch, with the first one's targets left over
    torch.testing.assert_close(template, base, rtol=1e-5, atol=1e-5)


def test_noise_draws_the_calibrated_gaussian(planted):
    """``noise`` writes mean + std * N(0, 1) from a generator seeded by seed + layer: recomputed here
    from the calibration's mean and a variance set on purpose."""
    model, calib, tokens = planted
    layer = min(calib.dims)
    col = calib.dims_at[layer].tolist().index(SINK_DIM)
    var = calib.vars_at[layer].clone()
    var[col] = 400.0
    calib = dataclasses.replace(calib, vars_at={**calib.vars_at, layer: var})
    got = first_edit(model, ablate_massive(model, "noise", calibration=calib, seed=3), tokens)
    col_dims = calib.dims_at[layer].tolist()
    want = calib.means_at[layer][col] + 20.0 * torch.randn(*tokens.shape, 1, generator=torch.Generator().manual_seed(
        3 + layer))[..., 0]
    assert len(col_dims) == 1  # one planted dim: the draw's only column
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-5, atol=1e-3)  # BOS: the targeted entries


def test_resample_takes_values_of_the_same_token_kind(planted):
    """A pool with one value per token kind: the BOS entry gets the ``bos`` value when the kinds are
    given (as run_interventions gives them) and when they are not (the first token is taken as bos)."""
    model, calib, tokens = planted
    layer = min(calib.dims)
    pool = torch.tensor([[layer, 0, TOKEN_KINDS.index("bos"), SINK_DIM, 1234.0],
                         [layer, 1, TOKEN_KINDS.index("other"), SINK_DIM, -77.0]], dtype=torch.float64)
    calib = dataclasses.replace(calib, pool=pool)
    kinds = ModelView(model).token_kinds(ModelView(model).full_batch(tokens))
    sinks = SinkSet(torch.zeros(tokens.shape, dtype=torch.bool), kinds, "test")
    for given in (sinks, None):
        got = first_edit(model, ablate_massive(model, "resample", calibration=calib, sinks=given), tokens)
        assert got[:, 0].tolist() == [1234.0] * len(tokens)


def test_calibration_keeps_what_the_arms_need_through_save_and_load(planted, tmp_path):
    model, calib, _ = planted
    assert calib.pool.shape[1] == len(POOL_COLUMNS) and len(calib.pool)
    assert set(calib.vars_at) == set(calib.dims_at)
    assert calib.template.shape == (model.cfg.n_layers + 1, 2, model.cfg.d_model)
    again = load(calib.save(tmp_path / "calib"))
    assert torch.equal(again.pool, calib.pool) and torch.equal(again.template, calib.template)
    assert torch.equal(again.template_seen, calib.template_seen)
    assert bool(calib.template_seen[1:-1].all() and calib.template_seen[-1, 0])  # every norm after the birth
    assert all(torch.equal(again.vars_at[k], v) for k, v in calib.vars_at.items())


def test_an_old_calibration_loads_and_the_arms_refuse_it(planted, tmp_path):
    """A Calibration saved before the arms' statistics (its manifest without them) still loads and
    serves zero and mean; the arms refuse it with what to do."""
    model, calib, tokens = planted
    folder = calib.save(tmp_path / "old")
    manifest = json.loads((folder / "manifest.json").read_text())
    for key in ("vars_at", "pool", "template", "template_seen"):
        manifest["fields"].pop(key)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    old = load(folder)
    assert not old.vars_at and not old.template.numel()
    perplexity(model, tokens, hooks=ablate_massive(model, "mean", calibration=old), progress=False)
    for mode in ("resample", "noise", "template"):
        with pytest.raises(MassiveLensError, match="calibrate again"):
            ablate_massive(model, mode, calibration=old)


@pytest.mark.parametrize("kw", [dict(mode="bogus"), dict(mode="template", where="every"),
                                dict(mode="noise", control=True)])
def test_bad_arm_options_are_refused(kw):
    model = tiny_model("llama")
    plant_sink(model)
    with untouched(model), pytest.raises(MassiveLensError):
        ablate_massive(model, calibration=bos_tokens(model, TEXT, 24, 2), **kw)


def frame(**ratios):
    return pd.DataFrame([dict(setting=s, ratio=r[0], ratio_low=r[1], ratio_high=r[2]) for s, r in ratios.items()])


def test_a_zero_verdict_is_set_beside_its_controls():
    alone = arm_lines(frame(original=(1, 1, 1), zero=(50.0, 40.0, 60.0)))
    assert len(alone) == 1 and "zero only; mean/resample/noise were not run" in alone[0]
    shock = arm_lines(frame(original=(1, 1, 1), zero=(50.0, 40.0, 60.0), mean=(1.01, 1.0, 1.02),
                            resample=(1.02, 1.0, 1.05), noise=(45.0, 35.0, 55.0)))
    assert "zero only; mean/resample/noise say mean x1.010 [1.000, 1.020]" in shock[0]
    assert "mean, resample cost(s) clearly less" in shock[0]
    agree = arm_lines(frame(original=(1, 1, 1), zero=(50.0, 40.0, 60.0), mean=(48.0, 39.0, 58.0)))
    assert "the controls agree" in agree[0]
    assert arm_lines(frame(original=(1, 1, 1), zero=(1.0, 0.99, 1.01))) == []  # no zero verdict to check


def test_run_interventions_has_every_arm_and_flags_zero(planted):
    model, calib, tokens = planted
    table = run_interventions(model, tokens, calibration=calib, settings=["original", "zero", "mean", "resample",
                                                                         "noise", "template"], progress=False)
    rows = table.to_frame().set_index("setting")
    assert list(rows.index[:6]) == ["original", "zero", "mean", "resample", "noise", "template"]
    # the planted value is the same in every calibration sequence: resample, noise (variance 0) and mean agree
    assert rows.loc["resample", "ratio"] == rows.loc["noise", "ratio"] == rows.loc["mean", "ratio"]
    assert rows.loc["template", "ratio"] == pytest.approx(1.0, abs=1e-5)
    if rows.loc["zero", "ratio_low"] > 1:
        assert "zero only" in table.summary()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_resample_and_noise_run_on_nnsight_as_on_the_bridge():
    from test_nnsight import bos_rows, same_table, untied_twins  # noqa: PLC0415 - the nnsight twins

    bridge, lm = untied_twins("llama")
    text = "The cat sat on the mat. A dog ran off to the park and back. " * 4
    evaluate, calibration = bos_rows(text, 4), bos_rows(text[::-1].replace(".", "!"), 4)
    kw = dict(calibration=calibration, settings=["original", "resample", "noise", "resample_every", "noise_every"],
              progress=False)
    a = run_interventions(bridge, evaluate, **kw)
    with untouched(ModelView(lm).hf):
        b = run_interventions(lm, evaluate, **kw)
    same_table(a, b)
    with pytest.raises(MassiveLensError, match="template"):
        run_interventions(lm, evaluate, calibration=calibration, settings=["template"], progress=False)
