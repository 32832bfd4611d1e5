"""Issue 52 on the package's own trained models: the per-layer quantization analyses
(``layer_damage``, ``sink_predictor``) run on a ``MassiveLM``, whose linear layers are the plain
sites of ``quantization_sites``, each told apart by the block that holds its weight."""

from __future__ import annotations

import math

import pytest
import torch

from massive_lens.core.criterion import SINK_QUERIES
from massive_lens.core.model_view import ModelView
from massive_lens.quant.float16 import layer_damage
from massive_lens.quant.predictor import sink_predictor
from massive_lens.quant.sites import plain
from massive_lens.train import MassiveLM, MassiveLMConfig

N_LAYERS = 4


def massive_lm(attention: str = "softmax") -> MassiveLM:
    torch.manual_seed(0)
    return MassiveLM(MassiveLMConfig(n_layers=N_LAYERS, d_model=32, n_heads=2, n_ctx=64, attention=attention)).eval()


def tokens(n: int, seq_len: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attention", ["softmax", "gated"])
def test_plain_sites_know_their_block(attention: str) -> None:
    model = massive_lm(attention)
    sites = plain(model, include_head=False)
    assert len(sites) == len(model.quantization_sites(False))
    for site in sites:  # the layer is the block holding the weight, read independently here
        holders = [i for i, b in enumerate(model.blocks) if any(p is site.weight for p in b.parameters())]
        assert holders == [site.layer]
        assert dict(model.blocks[site.layer].named_parameters())[site.name] is site.weight
    assert {s.layer for s in sites} == set(range(N_LAYERS))
    head = plain(model, include_head=True)[-1]
    assert head.weight is model.W_U and head.layer == -1  # outside the blocks


def test_layer_damage_on_a_massive_lm() -> None:
    model = massive_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens(4)
    damage = layer_damage(model, x[:2], calibration=x[2:], seq_len=x.shape[1], n_seqs=2, setting="W4A4@tensor")
    assert damage.layer.tolist() == list(range(N_LAYERS))
    assert all(math.isfinite(d) for d in damage.damage)
    assert (damage.damage_low <= damage.damage + 1e-9).all() and (damage.damage <= damage.damage_high + 1e-9).all()
    assert damage.damage.abs().max() > 0  # 4-bit per-tensor rounding moves the loss of some layer
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is left as it was


def test_sink_predictor_on_a_massive_lm() -> None:
    model = massive_lm("softmax1")
    x = tokens(4)
    p = sink_predictor(model, x[:2], calibration=x[2:], seq_len=x.shape[1], n_seqs=2)
    frame = p.frame
    assert frame.layer.tolist() == list(range(N_LAYERS))
    view = ModelView(model)
    with torch.no_grad():  # the sink mass against the pattern read here: attention on the first token
        _, cache = model.run_with_cache(x[:2])
    queries = min(SINK_QUERIES, x.shape[1])  # Gu et al.'s alpha: the first queries' weight on the first key
    want = [float(cache[f"blocks.{layer}.attn.hook_pattern"][:, :, :queries, 0].mean()) for layer in range(N_LAYERS)]
    assert view.n_layers == N_LAYERS
    assert frame.sink_mass.tolist() == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert set(p.correlations.x) == {"sink_mass", "dispersion", "underflow"}
