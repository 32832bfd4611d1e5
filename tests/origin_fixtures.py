"""A planted birth -> erasure -> rebirth story with a known answer, on any tiny family.

Neuron ``BIRTH`` of layer 0 reads the trigger dim of the BOS embedding and writes ``VALUE``
into ``DIM``; neuron ``ERASE`` of layer 2 reads ``DIM`` and removes ``ERASED`` of it;
neuron ``REBIRTH`` of layer 3 reads ``DIM`` and writes ``REBORN``. On pre-norm families the
size is set by ``W_out[n, DIM]``; on post-norm (Gemma-style) families the MLP's output
passes ``ln2_post``, so the neuron writes a unit and the post-norm weight of ``DIM`` scales it
(and the layer's other neurons stop writing ``DIM``, so nothing else gets amplified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import wire_neuron

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


def _measure(model, tokens, names):
    seen = {}

    def grab(name):
        def hook(act, hook):
            seen[name] = act[0, 0].detach().clone()

        return hook

    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[(n, grab(n)) for n in names])
    return seen


def _wire(model, layer, neuron, read_dim, sign, post_norm):
    mlp = model.blocks[layer].mlp
    with torch.no_grad():
        wire_neuron(mlp, neuron, read_dim)
        if post_norm:
            mlp.W_out[:, DIM] = 0.0
        mlp.W_out[neuron] = 0.0
        mlp.W_out[neuron, DIM] = sign


def _set_size(model, layer, neuron, target, tokens, post_norm):
    """Scale the planted write so that it adds exactly ``target`` to the residual at BOS."""
    if not post_norm:
        act = float(_measure(model, tokens, [f"blocks.{layer}.mlp.hook_post"])[f"blocks.{layer}.mlp.hook_post"][neuron])
        with torch.no_grad():
            model.blocks[layer].mlp.W_out[neuron, DIM] = target / act
        return
    name = f"blocks.{layer}.ln2_post.hook_out"
    out = float(_measure(model, tokens, [name])[name][DIM])
    weight = model.blocks[layer].ln2_post._original_component.weight  # Gemma: x * (1 + weight)
    with torch.no_grad():
        weight[DIM] = (1.0 + weight[DIM]) * target / out - 1.0


def plant_story(model) -> Story:
    """Plant the three neurons (in place) and return the expected answer."""
    post_norm = "blocks.0.ln2_post.hook_out" in model.hook_dict
    bos = model.tokenizer.bos_token_id
    tokens = torch.tensor([[bos, 72, 105, 46]])
    with torch.no_grad():
        model.W_E[bos].zero_()
        model.W_E[bos, TRIGGER_DIM] = 1.0
    for (layer, neuron), read, target in ((BIRTH, TRIGGER_DIM, VALUE), (ERASE, DIM, ERASED), (REBIRTH, DIM, REBORN)):
        _wire(model, layer, neuron, read, 1.0 if target > 0 else -1.0, post_norm)
        _set_size(model, layer, neuron, target, tokens, post_norm)
    return Story()
