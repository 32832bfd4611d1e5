"""Issue 52: quantization damage by granularity. D_sink against a hand computation, the
fewest-modules search on a planted fragile module, dispersion and underflow against numpy, and
the destroyed flag on a planted blow-up."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from massive_lens import load
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.models import tiny_model
from massive_lens.quant import measure_outliers, quantize_grid
from massive_lens.quant.dispersion import as_matrix, dispersion, underflow
from massive_lens.quant.fake import calibrated_ranges, fake_quant_activation, fake_quant_weight
from massive_lens.quant.float16 import fewest_float16
from massive_lens.quant.granularity import granularity_settings, granularity_table
from massive_lens.quant.outlier_stats import eval_and_calibration
from massive_lens.quant.predictor import sink_predictor
from massive_lens.quant.settings import Setting
from massive_lens.quant.sites import linear_sites

TEXT = "The cat sat on the mat. The dog ran, and the bird flew.\n" * 40
PLANT_LAYER = 1


def planted(gain: float) -> object:
    """A tiny llama that copies its input token: the writers (o_proj, down_proj) are zero, so the
    residual stream is the embedding, and the head is the embedding's directions (the current
    token wins). Layer ``PLANT_LAYER``'s down-projection then gets two channels that cancel
    exactly in full precision (``gain * v * h - gain * v / 2 * 2h``) but not on a quantization
    grid (``q(2h) != 2 q(h)``): a fragile module whose rounding error is ``gain`` times too large."""
    model = tiny_model("llama")
    hf = model.original_model
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        hf.lm_head.weight.copy_(2.0 * emb / emb.norm(dim=1, keepdim=True).clamp(min=1e-6))
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        mlp = hf.model.layers[PLANT_LAYER].mlp
        mlp.gate_proj.weight[1] = mlp.gate_proj.weight[0]
        mlp.up_proj.weight[1] = 2 * mlp.up_proj.weight[0]
        v = torch.randn(mlp.down_proj.weight.shape[0], generator=torch.Generator().manual_seed(0))
        mlp.down_proj.weight[:, 0] = gain * v
        mlp.down_proj.weight[:, 1] = -gain * v / 2
    return model


def copy_tokens(model: object) -> torch.Tensor:
    """Sequences of one repeated token each (BOS first): what the copying model predicts well."""
    bos = int(model.to_tokens("")[0, 0])
    tokens = torch.tensor([[64], [65], [66], [67]]).expand(4, 32).clone()
    tokens[:, 0] = bos
    return tokens


def test_d_sink_is_the_paired_difference_computed_by_hand():
    model = tiny_model("llama")
    table = granularity_table(model, TEXT, bases=["W4A4"], granularities=["tensor"], extra=[], seq_len=32, n_seqs=4)
    row = table.to_frame().iloc[0]
    # by hand: the two arms run alone, per sequence, on the same sequences
    plain = quantize_grid(model, TEXT, settings=["W4A4@tensor"], seq_len=32, n_seqs=4).sequences
    kept = quantize_grid(model, TEXT, settings=["W4A4@tensor+kvsink"], seq_len=32, n_seqs=4).sequences
    gap_plain = plain.loss.to_numpy() - plain.fp_loss.to_numpy()
    gap_kept = kept.loss.to_numpy() - kept.fp_loss.to_numpy()
    by_hand = gap_plain - gap_kept
    assert by_hand.std() > 0 and abs(by_hand.mean()) > 0  # the sinks matter on this model: a real difference
    assert row.d_sink == pytest.approx(by_hand.mean(), rel=1e-9, abs=1e-12)
    low, high = bootstrap_mean(torch.tensor(by_hand))
    assert (row.d_sink_low, row.d_sink_high) == pytest.approx((low, high), rel=1e-9, abs=1e-12)
    assert row.d_sink_low <= row.d_sink <= row.d_sink_high
    ppl = np.exp(plain.loss.to_numpy()) - np.exp(kept.loss.to_numpy())
    assert row.d_sink_ppl == pytest.approx(ppl.mean(), rel=1e-9)
    assert row.gap == pytest.approx(gap_plain.mean(), rel=1e-9)
    assert row.kept_gap == pytest.approx(gap_kept.mean(), rel=1e-9)
    assert row.weight_granularity == "tensor" and row.activation_granularity == "tensor"


def test_granularity_settings_pair_each_setting_with_its_kept_twin_and_the_asymmetric_baseline():
    names = [s.name for s in granularity_settings()]
    assert names[:2] == ["W8A8@tensor", "W8A8@tensor+kvsink"]
    assert "W4A4@group+asym" in names and "W4A4@group+kvsink+asym" in names
    assert Setting.parse("W4A4@group+asym").symmetric is False
    with pytest.raises(MassiveLensError, match="kept sinks"):
        granularity_settings(["W8A8"], ["token"], ["W4A4@token+kvsink"])
    with pytest.raises(MassiveLensError, match="both set symmetric"):
        Setting.parse("W4A4+asym+sym")


def test_the_destroyed_flag_on_a_planted_blow_up(tmp_path):
    model = planted(1e4)
    tokens = copy_tokens(model)
    grid = quantize_grid(model, tokens, settings=["W8A8@token", "W8A8@token+kvsink", "W16A16"])
    frame = grid.to_frame().set_index("setting")
    assert frame.loc["W16A16", "ppl_ratio"] == pytest.approx(1.0, abs=1e-6) and not frame.loc["W16A16", "destroyed"]
    assert frame.loc["W8A8@token", "ppl_ratio"] > 10 and frame.loc["W8A8@token", "destroyed"]
    assert "destroyed" in grid.summary() and "W8A8@token" in grid.summary().split("destroyed")[-1]
    healthy = quantize_grid(planted(0.0), tokens, settings=["W8A8@token"]).to_frame()
    assert not healthy.destroyed.iloc[0]  # the same model without the planted channels
    table = granularity_table(model, tokens, bases=["W8A8"], granularities=["tensor", "token"], extra=[])
    assert table.to_frame().set_index("setting").loc["W8A8@token", "destroyed"]
    assert math.isnan(table.ratios().ratio.iloc[0])  # left out of the ratio
    assert "left out of the ratios" in table.summary()
    again = load(table.save(tmp_path / "table"))
    assert again.summary() == table.summary()


def test_the_fewest_modules_search_finds_the_planted_fragile_module(tmp_path):
    model = planted(1e4)
    search = fewest_float16(model, copy_tokens(model), setting="W8A8@token", target=1.05)
    assert search.frame.ppl_ratio.iloc[0] > 10  # every module quantized: destroyed
    assert search.modules == (f"layer {PLANT_LAYER} mlp.out",)
    assert search.ranking.module.iloc[0] == f"layer {PLANT_LAYER} mlp.out"
    kept_one = search.frame.set_index("kept").loc[1, "ppl_ratio"]
    assert kept_one <= 1.05
    assert "keeping 1 of" in search.summary()
    assert load(search.save(tmp_path / "search")).summary() == search.summary()
    with pytest.raises(MassiveLensError, match="rotat"):
        fewest_float16(model, copy_tokens(model), setting="W4A4+hadamard")
    with pytest.raises(MassiveLensError, match="target"):
        fewest_float16(model, copy_tokens(model), target=0.5)


def test_dispersion_and_underflow_against_numpy():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=gen)
    w[2, 7] = 40.0
    a = w.abs().numpy()
    rows, cols = a.max(1), a.max(0)
    assert dispersion(w) == pytest.approx((rows.max() / np.median(rows), cols.max() / np.median(cols)), rel=1e-6)
    q = fake_quant_weight(w, None, 4)
    scale = np.abs(w.numpy()).max() / 7
    zero = np.round(w.numpy() / scale) == 0
    assert underflow(w, q) == pytest.approx(zero.sum() / w.numel())
    assert underflow(w, q) > 0.5  # the planted entry takes the grid


def test_measure_outliers_tensors_against_numpy():
    model = tiny_model("llama")
    report = measure_outliers(model, TEXT, seq_len=32, n_seqs=2)
    t = report.tensors
    sites = linear_sites(model)
    weights = t[t.kind == "weight"].reset_index(drop=True)
    assert len(weights) == len(sites) and set(t.kind) == {"weight", "activation"}
    assert set(weights.layer) == set(range(model.cfg.n_layers))
    for (_, weight, _), row in zip(sites, weights.itertuples(), strict=True):
        w = weight.detach().numpy()
        rows, cols = np.abs(w).max(1), np.abs(w).max(0)
        assert row.row_dispersion == pytest.approx(rows.max() / np.median(rows), rel=1e-5)
        assert row.col_dispersion == pytest.approx(cols.max() / np.median(cols), rel=1e-5)
        scale = rows / 127  # per output channel, 8 bits
        assert row.underflow == pytest.approx((np.round(w / scale[:, None]) == 0).sum() / (w != 0).sum(), abs=1e-9)
    # one activation input against numpy: the layer's input over the evaluation tokens
    module, weight, _ = sites[-1]
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().flatten(0, -2)))
    tokens = eval_and_calibration(ModelView(model), TEXT, None, 32, 2)[0]
    try:
        model(tokens)
    finally:
        handle.remove()
    x = torch.cat(seen).numpy()
    rows, cols = np.abs(x).max(1), np.abs(x).max(0)
    act = t[(t.kind == "activation")].iloc[-1]
    assert act.row_dispersion == pytest.approx(rows.max() / np.median(rows), rel=1e-4)
    assert act.col_dispersion == pytest.approx(cols.max() / np.median(cols), rel=1e-4)
    assert "worst column dispersion" in report.summary() and "most underflow" in report.summary()
    assert 0 <= act.underflow <= 1 and calibrated_ranges is not None and fake_quant_activation is not None
    assert as_matrix(weight, (1,)).shape == weight.shape


def test_sink_predictor_correlates_per_layer(tmp_path):
    p = sink_predictor(tiny_model("llama"), TEXT, seq_len=32, n_seqs=2)
    f = p.to_frame()
    assert list(f.layer) == list(range(len(f))) and {"sink_mass", "dispersion", "damage"} <= set(f)
    c = p.correlations
    assert (c.low <= c.rho + 1e-6).all() and (c.rho <= c.high + 1e-6).all()
    for x in ("sink_mass", "dispersion"):  # Spearman's rho: the correlation of the ranks
        rho = c[(c.x == x) & (c.y == "damage")].rho.iloc[0]
        assert rho == pytest.approx(np.corrcoef(f[x].rank(), f.damage.rank())[0, 1])
    assert load(p.save(tmp_path / "p")).summary() == p.summary()


@pytest.mark.heavy  # a (small) report
def test_the_report_quantization_section_leads_with_granularity(tmp_path):
    from massive_lens.report import write_report

    path = write_report(tiny_model("llama"), out_dir=tmp_path, quick=True, progress=False, tables=False,
                        skip="massive,origin,attention,sinks,circuit,interventions,lowbit")
    section = (path.parent / "report.md").read_text().split("## W8A8 quantization")[1].split("\n## ")[0]
    assert section.index("Damage by granularity first") < section.index("W8A8 here")
    assert "W8A8@tensor" in section and "W8A8@token" in section and "D_sink" in section
    assert "W4A4@tensor" not in section  # the light report: W8A8 only (full=True: every granularity)


def test_calibration_slices_the_head_where_that_is_exact(monkeypatch):
    """calibrated_ranges decides the slicing before its passes (it read the undecided ``exact``, None,
    and always ran the whole pass with the full logits); the ranges are the same either way."""
    model = tiny_model("llama")
    tokens = model.to_tokens(TEXT)[:, :32].repeat(2, 1)
    sites = linear_sites(model, include_head=True)
    stopped: list[int] = []
    hidden = NextTokenLoss.hidden
    monkeypatch.setattr(NextTokenLoss, "hidden", lambda self, *a, **k: stopped.append(1) or hidden(self, *a, **k))
    sliced = calibrated_ranges(model, sites, tokens)
    assert stopped  # the passes stopped at the head and ran it in slices
    monkeypatch.setattr(NextTokenLoss, "check", lambda self, tokens: False)  # the whole pass, full logits
    whole = calibrated_ranges(model, sites, tokens)
    assert whole.keys() == sliced.keys() and len(sliced) == len(sites)
    for i, (low, high) in whole.items():  # min / max of the same inputs: the head's slices change no value
        assert sliced[i] == pytest.approx([low, high], rel=1e-6, abs=1e-7)
