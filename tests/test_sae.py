"""massive_lens.handover.sae_check with SAEs built through sae-lens's own API, on a planted tiny
model, and the SAELens snippet of docs/handover.md. sae-lens pins transformer-lens<4: these
tests run in the TL 3.x environment (``make test-tl3``) and skip elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import untouched
from planting import SINK_DIM, TEXT, WORD, bos_tokens, plant_brief
from test_docs import ROOT, python_blocks

from massive_lens import MassiveLensError, exclusion_mask, tiny_model
from massive_lens.handover import sae_check

sae_lens = pytest.importorskip("sae_lens")

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    """BOS: a persistent massive value in SINK_DIM; every WORD token: a massive value in layer 0 only."""
    return plant_brief(tiny_model("llama"))


@pytest.fixture(scope="module")
def tokens(model):
    return bos_tokens(model, TEXT, seq_len=32, n_seqs=3)


def standard_sae(d_in: int, d_sae: int, hook: str = HOOK, seed: int = 0):
    """A StandardSAE as sae-lens builds and initialises it, reading ``hook``."""
    torch.manual_seed(seed)
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=d_in, d_sae=d_sae))
    sae.cfg.metadata.hook_name = hook
    return sae


def _resid(model, tokens, hook=HOOK):
    """The activation at ``hook`` by plain TransformerLens hooks (independent of massive_lens)."""
    seen = {}

    def grab(x, hook):
        seen["x"] = x.detach().clone()

    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(hook, grab)])
    return seen["x"]


def test_the_planted_massive_activation_carries_the_error(model, tokens):
    sae = standard_sae(model.cfg.d_model, 4 * model.cfg.d_model)
    model.train()
    try:
        with untouched(model), untouched(sae):
            check = sae_check(model, sae, tokens)
        assert model.training and all(m.training for m in model.modules())  # mode put back
    finally:
        model.eval()
    # the massive positions are the planted ones: BOS, and every WORD token (massive at layer 0)
    planted = (tokens == WORD) | (torch.arange(tokens.shape[1]) == 0)
    assert torch.equal(check.massive, planted)
    # the squared error per position agrees with sae-lens's own encode/decode on plain hooks
    x = _resid(model, tokens)
    with torch.no_grad():
        expected = (sae.decode(sae.encode(x)) - x).pow(2).sum(-1)
    torch.testing.assert_close(check.sq_error, expected, rtol=1e-4, atol=1e-4)
    groups = check.to_frame().set_index("group")
    massive = groups.loc["massive"]
    assert massive.position_share < 0.5 and massive.error_share > 0.99  # a third of the positions ("e" is common)
    assert check.error_share("excluded") >= massive.error_share > 100 * groups.loc["rest"].error_share
    assert groups.loc["all"].error_share == pytest.approx(1.0)
    assert groups.loc["excluded", "n_positions"] + groups.loc["rest", "n_positions"] == tokens.numel()
    share = float(expected[planted].sum() / expected.sum())
    assert massive.error_share == pytest.approx(share, rel=1e-4)
    assert "dead latents" in check.summary() and check.plot() is not None


def test_a_latent_that_reads_only_the_massive_dim_fires_only_there(model, tokens):
    sae = standard_sae(model.cfg.d_model, 4 * model.cfg.d_model, seed=1)
    latent = 7
    with torch.no_grad():  # fires where SINK_DIM exceeds 1,000: at BOS alone (the dim is clean elsewhere)
        sae.W_enc[:, latent] = 0.0
        sae.W_enc[SINK_DIM, latent] = 1.0
        sae.b_enc[latent] = -1000.0
    check = sae_check(model, sae, tokens)
    row = check.latents.set_index("latent").loc[latent]
    assert row.fires_massive == row.fires_excluded == tokens.shape[0] and "massive" in row.only
    # every listed latent fires at an excluded position and at no kept one (checked on sae-lens's encode)
    with torch.no_grad():
        fired = sae.encode(_resid(model, tokens)) > 0
    excluded = check.massive | check.sink
    only = (fired[excluded].any(0) & ~fired[~excluded].any(0)).nonzero().flatten().tolist()
    assert sorted(check.latents["latent"]) == only
    assert check.n_dead == int((~fired.flatten(0, 1).any(0)).sum())


def test_an_sae_on_hook_z_reads_the_heads_concatenated(model, tokens):
    """An SAE at ``attn.hook_z`` ([batch, pos, head, d_head]) sees each position's heads
    concatenated, as SAELens's attention SAEs are trained; its error agrees with sae-lens's own
    encode/decode on that flattening."""
    hook = "blocks.1.attn.hook_z"
    z = _resid(model, tokens, hook)
    assert z.ndim == 4
    sae = standard_sae(z.shape[2] * z.shape[3], 64, hook=hook, seed=2)
    with untouched(model), untouched(sae):
        check = sae_check(model, sae, tokens)
    x = z.flatten(2)
    with torch.no_grad():
        expected = (sae.decode(sae.encode(x)) - x).pow(2).sum(-1)
    torch.testing.assert_close(check.sq_error, expected, rtol=1e-4, atol=1e-4)
    groups = check.to_frame().set_index("group")
    assert groups.loc["all"].error_share == pytest.approx(1.0)
    assert groups.loc["excluded", "n_positions"] + groups.loc["rest", "n_positions"] == tokens.numel()
    with pytest.raises(MassiveLensError):  # the per-head width alone is not what hook_z holds per position
        sae_check(model, standard_sae(z.shape[3], 16, hook=hook), tokens)


def test_the_older_cfg_hook_name_reads_the_same(model, tokens):
    sae = standard_sae(model.cfg.d_model, 2 * model.cfg.d_model)
    older = SimpleNamespace(encode=sae.encode, decode=sae.decode,  # sae-lens < 6 kept hook_name on cfg itself
                            cfg=SimpleNamespace(d_in=model.cfg.d_model, hook_name=HOOK))
    a, b = sae_check(model, sae, tokens), sae_check(model, older, tokens)
    assert torch.equal(a.sq_error, b.sq_error) and a.to_frame().equals(b.to_frame())


def _no_hook_name(sae):
    del sae.cfg.metadata.hook_name
    return sae


def _nan_decoder(sae):
    with torch.no_grad():
        sae.W_dec[3, 0] = float("nan")
    return sae


@pytest.mark.parametrize("make, words", [
    (lambda d: standard_sae(d // 2, d), "d_in=32"),
    (lambda d: standard_sae(d, d, hook="blocks.9.hook_resid_post"), "no hook 'blocks.9.hook_resid_post'"),
    (lambda d: _no_hook_name(standard_sae(d, d)), "metadata.hook_name"),
    (lambda d: _nan_decoder(standard_sae(d, d)), "NaN or inf"),
    (lambda d: standard_sae(d, d).cfg, "no encode/decode"),
], ids=["d_in-mismatch", "hook-missing", "no-hook-name", "nan-weights", "not-an-sae"])
def test_bad_saes_are_clear_errors(model, tokens, make, words):
    sae = make(model.cfg.d_model)
    with untouched(model), pytest.raises(MassiveLensError, match=words.replace(".", r"\.")):
        sae_check(model, sae, tokens)
    assert not model.training


# --------------------------------------------------------------------------- docs/handover.md


def _snippet(marker: str) -> str:
    """The one Python block of docs/handover.md that holds ``marker``."""
    blocks = ["\n".join(body) for _, body in python_blocks((ROOT / "docs" / "handover.md").read_text())]
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} blocks hold {marker!r}"
    return found[0]


def test_the_saelens_snippet_runs(model):
    """The ``exclude_special_tokens`` snippet (on a tiny model; the page's own ``model`` is the default one)."""
    ex = exclusion_mask(model, ["The bee sees three geese.", "Hi there"])
    namespace = {"model": model, "ex": ex}
    exec(compile(_snippet("LanguageModelSAERunnerConfig("), "docs/handover.md", "exec"), namespace)
    cfg = namespace["cfg"]
    assert cfg.exclude_special_tokens == ex.token_ids() and model.tokenizer.bos_token_id in ex.token_ids()
    assert cfg.hook_name == "blocks.12.hook_resid_post" and cfg.sae.d_in == model.cfg.d_model
