"""matrix_entropy (massive_lens.effects.valley) against the definition it computes faster: the entropy
of the normalized squared singular values (an SVD, float64) of the centered input, on the shapes and
edge cases the valley meets (pos below and above d_model, rank one, all zero, a massive entry, half
precision) and on a real layer's residual stream."""

from __future__ import annotations

import math

import pytest
import torch

from massive_lens import tiny_model
from massive_lens.core.model_view import ModelView
from massive_lens.effects import matrix_entropy

# the two routes to the spectrum differ by float64 round-off: measured within 2e-14 on every case here
TOL = 1e-12


def _by_svd(x: torch.Tensor) -> float:
    """The definition: singular values of the centered matrix, in float64."""
    centered = x.double() - x.double().mean(0, keepdim=True)
    s2 = torch.linalg.svdvals(centered).pow(2)
    if s2.sum() <= 0:
        return 0.0
    p = s2[s2 > 0] / s2.sum()
    return float(-(p * p.log()).sum() / math.log(min(x.shape)))


def _low_rank(pos: int, d: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pos, rank, generator=g) @ torch.randn(rank, d, generator=g)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    massive = torch.randn(128, 96, generator=g)
    massive[0, 3] = 3000.0  # one token's massive activation: nearly rank one
    return {"pos < d_model": torch.randn(20, 64, generator=g), "pos > d_model": torch.randn(200, 16, generator=g),
            "square": torch.randn(32, 32, generator=g), "two positions": torch.randn(2, 9, generator=g),
            "rank 1": _low_rank(40, 24, 1, 1), "rank 3, wide": _low_rank(12, 40, 3, 2),
            "rank 2, tall": _low_rank(300, 10, 2, 3), "massive": massive, "scaled up": torch.randn(64, 48) * 1e4,
            "scaled down": torch.randn(30, 20, generator=g) * 1e-20,
            "float16": torch.randn(64, 32, generator=g).half(), "bfloat16": torch.randn(64, 32, generator=g).bfloat16(),
            "float64": torch.randn(50, 30, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize(("name", "x"), list(_cases().items()), ids=list(_cases()))
def test_matrix_entropy_is_the_svd_spectrum_entropy(name, x):
    got = matrix_entropy(x)
    assert got == pytest.approx(_by_svd(x), abs=TOL)
    assert 0.0 <= got <= 1.0 + TOL


def test_rank_one_and_all_zero_give_zero_and_never_a_negative_zero():
    for x in (_low_rank(128, 64, 1, 4), _low_rank(10, 300, 1, 5), torch.zeros(6, 5), torch.ones(5, 3)):
        got = matrix_entropy(x)
        assert got == pytest.approx(0.0, abs=TOL) and math.copysign(1.0, got) == 1.0


def test_matrix_entropy_of_every_layer_of_a_model_is_the_svd_one():
    model = tiny_model("gemma3")
    view = ModelView(model)
    tokens = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens)
    for layer in range(view.n_layers):
        for resid in cache[view.hook_name(layer, "resid_post")]:
            assert matrix_entropy(resid) == pytest.approx(_by_svd(resid), abs=TOL)
