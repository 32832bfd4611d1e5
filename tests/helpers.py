"""Plain helpers shared by the tests (fixtures live in ``conftest.py``).

Import them with ``from helpers import ...``: pytest puts ``tests/`` on ``sys.path`` (it
holds ``conftest.py`` and no ``__init__.py``), for ``tests/train/`` too.

- the WikiText-2 files: :data:`WIKITEXT_TEST` (evaluation), :data:`WIKITEXT_VALID`
  (calibration);
- :func:`untouched`: a block leaves no hooks and every weight bit-identical;
- :func:`untyped_errors`: what calls raise as a user's install runs them, without the tests' type checks;
- :func:`plant_massive`: one known massive activation in a pre-norm tiny model;
- :func:`plant_story`: a birth -> erasure -> rebirth story with a known answer, any tiny family;
- :func:`tiny_lm`: a small seeded :class:`~massive_lens.train.model.MassiveLM`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jaxtyping
import pytest
import torch

from massive_lens.core.corpora import data_file
from massive_lens.models import tiny_model
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM

WIKITEXT_TEST = data_file("wikitext-2/test.txt")  # evaluation text
WIKITEXT_VALID = data_file("wikitext-2/valid.txt")  # calibration text, never the same as evaluation
# the shared WikiText-2 files sit beside the checkout here and in CI; a clone elsewhere skips these tests
needs_wikitext = pytest.mark.skipif(
    not (Path(WIKITEXT_TEST).is_file() and Path(WIKITEXT_VALID).is_file()),
    reason=f"WikiText-2 not found ({WIKITEXT_TEST}); set MASSIVE_LENS_DATA to the folder holding wikitext-2/")
TRAIN_TEXT = "The cat sat. The dog ran, and the bird flew.\nA new line. " * 60  # a small training corpus


# --------------------------------------------------------------------------- leaving a model as found


def hook_count(model: Any) -> int:
    """Torch hooks on every submodule, minus TransformerBridge's own capture hooks (which it
    wires lazily on a block's first forward pass and keeps for the model's lifetime)."""
    total = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )
    return total - sum(len(getattr(m, "_capture_hook_handles", ())) for m in model.modules())


@contextlib.contextmanager
def untouched(model: Any) -> Iterator[None]:
    """Assert the block leaves no hooks behind and every weight bit-identical."""
    hooks = hook_count(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        assert hook_count(model) == hooks, "hooks left on the model"
        after = model.state_dict()
        assert state.keys() == after.keys()
        changed = [k for k, v in state.items() if not torch.equal(v, after[k])]
        assert not changed, f"weights changed: {changed[:5]}"


# --------------------------------------------------------------------------- without the tests' type checks


@contextlib.contextmanager
def without_type_checks() -> Iterator[None]:
    """The package's functions as a user's install runs them: the test run wraps each in a jaxtyping type check
    (pytest's ``--jaxtyping-packages``), which reads its switch at every call; the block turns it off."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def untyped_errors(codes: list[str], namespace: dict[str, Any],
                   after: Callable[[], Any] | None = None) -> dict[str, list[Any]]:
    """``{code: [type of what it raised, message]}`` (``["no error", ""]`` where nothing was raised) for each
    source line in ``codes``, evaluated in ``namespace`` :func:`without_type_checks` and its warnings ignored;
    ``after()``'s answer appended after each."""
    out: dict[str, list[Any]] = {}
    with without_type_checks(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for code in codes:
            try:
                eval(code, namespace)
                out[code] = ["no error", ""]
            except Exception as exc:
                out[code] = [type(exc).__name__, str(exc)]
            if after is not None:
                out[code].append(after())
    return out


# --------------------------------------------------------------------------- one planted massive activation


def wire_neuron(mlp: Any, neuron: int, read_dim: int, gain: float = 3.0) -> None:
    """Make MLP ``neuron`` read only residual dim ``read_dim`` (gate and up alike), no bias."""
    for name in ("W_in", "W_gate"):
        weight = getattr(mlp, name, None)
        if weight is not None:
            weight[:, neuron] = 0.0
            weight[read_dim, neuron] = gain
    if getattr(mlp, "b_in", None) is not None:
        mlp.b_in[neuron] = 0.0


def plant_massive(model: Any, layer: int, neuron: int, dim: int, value: float, trigger: int,
                  trigger_dim: int) -> float:
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


# --------------------------------------------------------------------------- a planted origin story
#
# Neuron ``BIRTH`` of layer 0 reads the trigger dim of the BOS embedding and writes ``VALUE``
# into ``DIM``; neuron ``ERASE`` of layer 2 reads ``DIM`` and removes ``ERASED`` of it;
# neuron ``REBIRTH`` of layer 3 reads ``DIM`` and writes ``REBORN``. On pre-norm families the
# size is set by ``W_out[n, DIM]``; on post-norm (Gemma-style) families the MLP's output
# passes ``ln2_post``, so the neuron writes a unit and the post-norm weight of ``DIM`` scales it
# (and the layer's other neurons stop writing ``DIM``, so nothing else gets amplified).

DIM, TRIGGER_DIM = 5, 11
BIRTH, ERASE, REBIRTH = (0, 17), (2, 42), (3, 88)  # (layer, neuron)
VALUE, ERASED, REBORN = 1000.0, -880.0, 2000.0


@dataclass(frozen=True)
class Story:
    dim: int = DIM
    pos: int = 0
    birth: tuple[int, int] = BIRTH
    erase: tuple[int, int] = ERASE
    rebirth: tuple[int, int] = REBIRTH


def _measure_at_bos(model: Any, tokens: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    seen = {}

    def grab(name):
        def hook(act, hook):
            seen[name] = act[0, 0].detach().clone()

        return hook

    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(n, grab(n)) for n in names])
    return seen


def _wire_story_neuron(model: Any, layer: int, neuron: int, read_dim: int, sign: float, post_norm: bool) -> None:
    mlp = model.blocks[layer].mlp
    with torch.no_grad():
        wire_neuron(mlp, neuron, read_dim)
        if post_norm:
            mlp.W_out[:, DIM] = 0.0
        mlp.W_out[neuron] = 0.0
        mlp.W_out[neuron, DIM] = sign


def _set_story_size(model: Any, layer: int, neuron: int, target: float, tokens: torch.Tensor,
                    post_norm: bool) -> None:
    """Scale the planted write so that it adds exactly ``target`` to the residual at BOS."""
    if not post_norm:
        name = f"blocks.{layer}.mlp.hook_post"
        act = float(_measure_at_bos(model, tokens, [name])[name][neuron])
        with torch.no_grad():
            model.blocks[layer].mlp.W_out[neuron, DIM] = target / act
        return
    name = f"blocks.{layer}.ln2_post.hook_out"
    out = float(_measure_at_bos(model, tokens, [name])[name][DIM])
    weight = model.blocks[layer].ln2_post._original_component.weight  # Gemma: x * (1 + weight)
    with torch.no_grad():
        weight[DIM] = (1.0 + weight[DIM]) * target / out - 1.0


def plant_story(model: Any) -> Story:
    """Plant the three neurons (in place) and return the expected answer."""
    post_norm = "blocks.0.ln2_post.hook_out" in model.hook_dict
    bos = model.tokenizer.bos_token_id
    tokens = torch.tensor([[bos, 72, 105, 46]])
    with torch.no_grad():
        model.W_E[bos].zero_()
        model.W_E[bos, TRIGGER_DIM] = 1.0
    for (layer, neuron), read, target in ((BIRTH, TRIGGER_DIM, VALUE), (ERASE, DIM, ERASED), (REBIRTH, DIM, REBORN)):
        _wire_story_neuron(model, layer, neuron, read, 1.0 if target > 0 else -1.0, post_norm)
        _set_story_size(model, layer, neuron, target, tokens, post_norm)
    return Story()


# --------------------------------------------------------------------------- training models


def tiny_lm(attention: str = "softmax", style: str = "llama", seed: int = 0, **fields: Any) -> MassiveLM:
    """A 2-layer, 32-wide MassiveLM with seeded random weights (``fields`` override the shape)."""
    torch.manual_seed(seed)
    shape = dict(n_layers=2, d_model=32, n_heads=2, n_ctx=32)
    cfg = MassiveLMConfig(**{**shape, **fields}, style=style, attention=attention)
    return MassiveLM(cfg).eval()


def overflowing() -> Any:
    """A tiny llama in float16 whose layer-2 MLP overflows (inf, then NaN) on any text."""
    model = tiny_model("llama").to(torch.float16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layers.2." in name and ("up_proj" in name or "gate_proj" in name):
                param.fill_(100.0)
    return model
