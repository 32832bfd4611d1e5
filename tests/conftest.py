"""Shared fixtures: seeding, tiny models of each family, a planted model, the real default
model (loaded once per session), and a check that a call leaves a model as it found it."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from massive_lens import load_model, tiny_model
from massive_lens.core.corpora import data_file
from massive_lens.models import FAMILIES

WIKITEXT_TEST = data_file("wikitext-2/test.txt")  # evaluation text
WIKITEXT_VALID = data_file("wikitext-2/valid.txt")  # calibration text, never the same as evaluation


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny(family):
    return tiny_model(family)


@pytest.fixture(scope="session")
def default_model():
    """The real offline default (SmolLM2-135M-Instruct), shared by the whole session."""
    return load_model()


def _hook_count(model) -> int:
    """Torch hooks on every submodule, minus TransformerBridge's own capture hooks (which it
    wires lazily on a block's first forward pass and keeps for the model's lifetime)."""
    total = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )
    return total - sum(len(getattr(m, "_capture_hook_handles", ())) for m in model.modules())


@contextlib.contextmanager
def _untouched(model):
    """Assert the block leaves no hooks behind and every weight bit-identical."""
    hooks = _hook_count(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        assert _hook_count(model) == hooks, "hooks left on the model"
        after = model.state_dict()
        assert state.keys() == after.keys()
        changed = [k for k, v in state.items() if not torch.equal(v, after[k])]
        assert not changed, f"weights changed: {changed[:5]}"


@pytest.fixture
def untouched():
    return _untouched


def wire_neuron(mlp, neuron: int, read_dim: int, gain: float = 3.0) -> None:
    """Make MLP ``neuron`` read only residual dim ``read_dim`` (gate and up alike), no bias."""
    for name in ("W_in", "W_gate"):
        weight = getattr(mlp, name, None)
        if weight is not None:
            weight[:, neuron] = 0.0
            weight[read_dim, neuron] = gain
    if getattr(mlp, "b_in", None) is not None:
        mlp.b_in[neuron] = 0.0


def plant_massive(model, layer: int, neuron: int, dim: int, value: float, trigger: int, trigger_dim: int):
    """Edit a pre-norm tiny model so MLP ``neuron`` of ``layer`` writes ``value`` into ``dim``
    at every occurrence of token ``trigger`` and (nearly) nothing elsewhere.

    The trigger token's embedding becomes a one-hot on ``trigger_dim``; the neuron reads only
    that dim and writes only ``dim``. Its output scale is then set from a measured run so the
    planted contribution at the trigger is exactly ``value``. Returns the neuron's activation
    at the trigger (for exact expectations).
    """
    mlp = model.blocks[layer].mlp
    with torch.no_grad():
        model.W_E[trigger].zero_()
        model.W_E[trigger, trigger_dim] = 1.0
        wire_neuron(mlp, neuron, trigger_dim)
        mlp.W_out[neuron] = 0.0
        mlp.W_out[neuron, dim] = 1.0
    seen = {}

    def grab(post, hook):
        seen["post"] = post[0, :, neuron].clone()

    tokens = torch.tensor([[trigger, 65, 66, 67]])
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", grab)])
    act = float(seen["post"][0])
    with torch.no_grad():
        mlp.W_out[neuron, dim] = value / act
    return act


@pytest.fixture
def plant():
    return plant_massive
