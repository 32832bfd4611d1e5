"""outlier_severity (γ = ‖μ‖/‖σ‖) on planted tiny models, the dead-share fit and the Spearman interval."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import untouched
from planting import SINK_DIM, TEXT, bos_tokens, plant_sink

from massive_lens import MassiveLensError, tiny_model
from massive_lens.handover import DeadShareFit, fit_dead_share, gamma_of, outlier_severity, sae_check, spearman_interval

F32_REL = 16 * torch.finfo(torch.float32).eps  # a few float32 ulps


def _independent_gamma(model, tokens, hook, keep=None):
    """γ from plain TransformerLens hooks and numpy (independent of massive_lens)."""
    seen = {}
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(hook, lambda x, hook: seen.__setitem__("x", x.detach()))])
    x = seen["x"].double()
    x = (x[keep] if keep is not None else x.flatten(0, 1)).numpy()
    return np.linalg.norm(x.mean(0)) / np.linalg.norm(x.std(0, ddof=1))


def test_a_massive_first_token_lowers_gamma_and_the_mask_takes_it_out():
    model = tiny_model("llama")
    plant_sink(model, 3000.0)
    tokens = bos_tokens(model, TEXT, seq_len=16, n_seqs=3)
    with untouched(model):
        sev = outlier_severity(model, tokens, levels=())
    frame = sev.to_frame()
    assert set(frame["hook"]) == {"resid_post", "attn_out", "mlp_out"} and len(frame) == 3 * model.cfg.n_layers
    last = model.cfg.n_layers - 1
    hook = f"blocks.{last}.hook_resid_post"
    # float32 activations of two forward passes, the moments in float64: a few float32 ulps
    assert sev.gamma(last) == pytest.approx(_independent_gamma(model, tokens, hook), rel=F32_REL)
    keep = torch.ones(tokens.shape, dtype=torch.bool)
    keep[:, 0] = False  # the planted BOS: the only massive position
    assert sev.mask.equal(~keep)
    assert sev.gamma(last, kept=True) == pytest.approx(_independent_gamma(model, tokens, hook, keep), rel=F32_REL)
    # one position in 16 carrying 3,000: γ ≈ sqrt(p / (1 - p)), far below the kept positions' γ
    p = 1 / tokens.shape[1]
    assert sev.gamma(last) == pytest.approx(math.sqrt(p / (1 - p)), rel=0.05)
    assert sev.gamma(last, kept=True) > 2 * sev.gamma(last)
    assert frame["predicted_dead"].isna().all() and "outlier severity" in sev.summary() and sev.plot() is not None


def test_an_offset_at_every_token_raises_gamma_and_the_fit_predicts_from_it():
    model = tiny_model("llama")
    tokens = bos_tokens(model, TEXT, seq_len=16, n_seqs=2)
    before = outlier_severity(model, tokens, levels=(), hooks="resid_post").gamma(0)
    with torch.no_grad():
        model.W_E[:, SINK_DIM] += 100.0  # an outlier dimension: every position shifted alike
    fit = DeadShareFit(slope=1.0, intercept=0.0, n_points=3)
    after = outlier_severity(model, tokens, levels=(), hooks="resid_post", fit=fit)
    assert after.gamma(0) > 20 * before
    row = after.to_frame().iloc[0]
    assert row.predicted_dead == pytest.approx(fit.predict(row.gamma)) and row.predicted_dead > 0.9


def test_spearman_interval_matches_ranks_and_an_exact_permutation_test():
    x, y = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0], [0.02, 0.01, 0.05, 0.2, 0.15, 0.4]
    r = spearman_interval(x, y)
    def spearman(a, b):  # Pearson's r of the ranks
        return pd.Series(a).rank().corr(pd.Series(b).rank())

    rho = spearman(x, y)
    assert r["rho"] == pytest.approx(rho)
    assert r["low"] < r["rho"] < r["high"] <= 1 and r["n"] == 6
    null = [spearman(x, v) for v in itertools.permutations(y)]
    exact = float(np.mean(np.abs(null) >= abs(rho) - 1e-12))
    assert r["p"] == pytest.approx(exact)
    wide = spearman_interval(x[:4], y[:4])
    assert wide["high"] - wide["low"] > r["high"] - r["low"]  # fewer layers, a wider interval


def test_fit_dead_share_recovers_a_planted_curve():
    gammas = [0.3, 1.0, 3.0, 10.0, 30.0]
    dead = [1 / (1 + math.exp(-(-2.0 + 1.5 * math.log10(g)))) for g in gammas]
    fit = fit_dead_share(gammas, dead)
    assert fit.slope == pytest.approx(1.5, rel=1e-6) and fit.intercept == pytest.approx(-2.0, rel=1e-6)
    assert gamma_of(torch.tensor([[1.0, 2.0], [3.0, 2.0]])) == pytest.approx(math.sqrt(8) / math.sqrt(2))


@pytest.mark.parametrize("call, match", [
    (lambda: fit_dead_share([1.0], [0.5]), "at least 2"),
    (lambda: fit_dead_share([1.0, -1.0], [0.5, 0.5]), "gammas must be > 0"),
    (lambda: fit_dead_share([1.0, 2.0], [0.5, 1.5]), "dead shares in"),
    (lambda: fit_dead_share([2.0, 2.0], [0.1, 0.5]), "all gammas are equal"),
    (lambda: spearman_interval([1, 2, 3], [1, 2, 3]), "at least 4"),
    (lambda: spearman_interval([1, 2, 3, 4], [1, 2, 3, 4], level=1.5), "coverage"),
    (lambda: gamma_of(torch.ones(1, 3)), "n >= 2"),
    (lambda: DeadShareFit(slope=1.0, intercept=0.0, n_points=2).predict(0.0), "gamma is an outlier severity"),
])
def test_bad_inputs(call, match):
    with pytest.raises(MassiveLensError, match=match):
        call()


def test_bad_model_inputs_leave_the_model_as_found():
    model = tiny_model("llama")
    with untouched(model):
        with pytest.raises(MassiveLensError, match="no hook"):
            outlier_severity(model, "Some text. " * 10, seq_len=8, n_seqs=1, hooks=("resid_post", "nope_out"))
        with pytest.raises(MassiveLensError, match="DeadShareFit"):
            outlier_severity(model, "Some text. " * 10, seq_len=8, n_seqs=1, fit=(1.0, 0.0))


def test_an_sae_without_a_hook_name_is_a_clear_error():
    from types import SimpleNamespace

    class NoHook:
        cfg = SimpleNamespace(d_in=8, metadata=SimpleNamespace(hook_name=None))

        def encode(self, x):
            return x

        def decode(self, z):
            return z

    with pytest.raises(MassiveLensError, match="cannot tell which hook"):
        sae_check(tiny_model("llama"), NoHook(), "Some text. " * 10, seq_len=8, n_seqs=1)
