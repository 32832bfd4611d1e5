"""Planted fixtures for the sink rule and the interventions' downstream checks, on any tiny family.

Import with ``from planting import ...`` (``tests/`` is on ``sys.path``, as for ``helpers``).

Planting is exact because the dims involved are *clean*: no embedding, position embedding,
attention output or MLP writes them except the planted neurons, so they are exactly zero
wherever nothing was planted. A trigger token's embedding becomes a one-hot on a clean
trigger dim; a neuron reading only that dim is then silent everywhere else (RMSNorm maps 0
to 0; under GPT-2's LayerNorm, which centres, a negative input bias keeps it silent).

- :func:`plant_rebuild`: BOS carries a massive value in ``SINK_DIM`` from layer 0; a neuron of
  layer ``REBUILD_LAYER`` reads BOS's trigger dim, which the massive value drowns under the
  pre-norm in the untouched model, so it writes back ``VALUE`` exactly when that value has been
  zeroed: zeroing at the first layer does not hold, zeroing at every massive layer does.
- :func:`plant_brief`: BOS carries a persistent massive value in ``SINK_DIM`` (the true sink),
  while ``BRIEF_DIM`` is massive at every ``WORD`` token (an ordinary letter) in layer 0 only:
  a layer-1 neuron erases it.
- :func:`plant_story` (pre-norm families): both phenomena a real model can show at once. BOS's
  ``SINK_DIM`` grows gradually over three MLPs (``GROWTH``: 200, 1,200, 5,000, then cut to 3,000
  by the last layer's MLP), a token-specific massive activation; ``OUTLIER_DIM`` carries
  ``OUTLIER_VALUE`` at every token but BOS from the embedding on (an *outlier dimension*),
  until a neuron of ``OUTLIER_END`` erases it.
- :func:`plant_key_writers` (pre-norm families): a sink key with known writers, MLP ``i`` writing
  ``values[i]`` at BOS into a dim every later key reads; equal values give a sink made of equal
  parts (distributed), one large value a writer that dominates (singled out).
"""

from __future__ import annotations

from typing import Any

import torch
from helpers import wire_neuron

from massive_lens.models import byte_tokenizer

SINK_DIM, BRIEF_DIM, BOS_TRIGGER, WORD_TRIGGER = 5, 9, 11, 13
BIRTH, WORD_NEURON, ERASER, REBUILDER = 17, 23, 42, 88
REBUILD_LAYER = 2
VALUE, BRIEF_VALUE = 5000.0, 2500.0  # massive on every family (gemma3's post-norms lift the median near 2)
WORD = byte_tokenizer()("e", add_special_tokens=False)["input_ids"][0]  # an ordinary, frequent token
GPT2_THRESHOLD = 8.0  # input bias that keeps a LayerNorm model's planted neuron silent off its trigger
TEXT = ("The bee sees the tree. Here we see three geese, and the deer feed there.\n"
        "Every evening the breeze eases the heat; the reeds bend near the green creek. ") * 6


def bos_tokens(model: Any, text: str, seq_len: int, n_seqs: int, offset: int = 0) -> torch.Tensor:
    """``n_seqs`` rows of ``seq_len`` tokens of ``text`` (from token ``offset``), each starting with
    BOS, on every family (Qwen2 prepends none by default; the planted sink is BOS)."""
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"][offset:]
    rows = torch.tensor(ids[: n_seqs * (seq_len - 1)]).view(n_seqs, seq_len - 1)
    return torch.cat([torch.full((n_seqs, 1), model.tokenizer.bos_token_id), rows], 1)


def post_norm(model: Any) -> bool:
    return "blocks.0.ln2_post.hook_out" in model.hook_dict


def clean_dim(model: Any, dim: int) -> None:
    """Nothing but planted neurons writes ``dim`` (embeddings, positions, attention, MLPs)."""
    with torch.no_grad():
        model.W_E[:, dim] = 0.0
        if hasattr(model, "W_pos"):
            model.W_pos[:, dim] = 0.0
        for block in model.blocks:
            block.attn.W_O[:, :, dim] = 0.0
            block.mlp.W_out[:, dim] = 0.0
            for bias in (getattr(block.attn, "b_O", None), getattr(block.mlp, "b_out", None)):
                if bias is not None:
                    bias[dim] = 0.0


def set_trigger(model: Any, token: int, dim: int) -> None:
    """``token``'s embedding becomes a one-hot on the clean dim ``dim``."""
    clean_dim(model, dim)
    with torch.no_grad():
        model.W_E[token].zero_()
        model.W_E[token, dim] = 1.0


def wire(model: Any, layer: int, neuron: int, read_dim: int, write_dim: int, sign: float = 1.0) -> None:
    """MLP ``neuron`` of ``layer`` reads only ``read_dim`` and writes only ``write_dim``."""
    mlp = model.blocks[layer].mlp
    with torch.no_grad():
        wire_neuron(mlp, neuron, read_dim)
        if getattr(mlp, "b_in", None) is not None:
            mlp.b_in[neuron] = -GPT2_THRESHOLD
        if post_norm(model):
            mlp.W_out[:, write_dim] = 0.0  # the post-norm amplifies write_dim: only this neuron may write it
        mlp.W_out[neuron] = 0.0
        mlp.W_out[neuron, write_dim] = sign


def _grab(model: Any, tokens: torch.Tensor, name: str, hooks: list) -> torch.Tensor:
    seen = {}

    def keep(act, hook):
        seen["x"] = act.detach().clone()

    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[*hooks, (name, keep)])
    return seen["x"]


def scale_write(model: Any, layer: int, neuron: int, dim: int, target: float, tokens: torch.Tensor, pos: int,
                hooks: list | None = None) -> None:
    """Scale the neuron's write so that it adds exactly ``target`` to ``dim`` at ``tokens[0, pos]``
    (measured with ``hooks`` attached)."""
    hooks = hooks or []
    if not post_norm(model):
        act = float(_grab(model, tokens, f"blocks.{layer}.mlp.hook_post", hooks)[0, pos, neuron])
        assert abs(act) > 1.0, f"planted neuron {layer}.{neuron} barely fires ({act})"
        with torch.no_grad():
            model.blocks[layer].mlp.W_out[neuron, dim] = target / act
        return
    out = float(_grab(model, tokens, f"blocks.{layer}.ln2_post.hook_out", hooks)[0, pos, dim])
    weight = model.blocks[layer].ln2_post._original_component.weight  # Gemma: x * (1 + weight)
    with torch.no_grad():
        weight[dim] = (1.0 + weight[dim]) * target / out - 1.0


def _probe(model: Any) -> torch.Tensor:
    bos = model.tokenizer.bos_token_id
    return torch.tensor([[bos, 84, WORD, 32, 98, WORD, WORD, 46]])


def plant_sink(model: Any, value: float = VALUE) -> None:
    """BOS writes ``value`` into ``SINK_DIM`` at layer 0 (a persistent massive activation)."""
    bos = model.tokenizer.bos_token_id
    set_trigger(model, bos, BOS_TRIGGER)
    clean_dim(model, SINK_DIM)
    wire(model, 0, BIRTH, BOS_TRIGGER, SINK_DIM)
    scale_write(model, 0, BIRTH, SINK_DIM, value, _probe(model), 0)


GROWTH = (200.0, 1200.0, 5000.0, 3000.0)  # BOS's SINK_DIM after layers 0-3 in plant_story
OUTLIER_DIM, OUTLIER_VALUE, OUTLIER_END = 7, 400.0, 2  # every token but BOS, layers 0 to OUTLIER_END - 1
GROWER, OUTLIER_ERASER = 31, 55


def plant_story(model: Any) -> Any:
    """See the module docstring (pre-norm families, four layers); returns the model, edited in place."""
    assert not post_norm(model) and model.cfg.n_layers == len(GROWTH), "plant_story: a 4-layer pre-norm model"
    plant_sink(model, GROWTH[0])
    clean_dim(model, OUTLIER_DIM)
    with torch.no_grad():
        model.W_E[:, OUTLIER_DIM] = OUTLIER_VALUE
        model.W_E[model.tokenizer.bos_token_id, OUTLIER_DIM] = 0.0
    probe = _probe(model)
    wire(model, OUTLIER_END, OUTLIER_ERASER, OUTLIER_DIM, OUTLIER_DIM, sign=-1.0)
    scale_write(model, OUTLIER_END, OUTLIER_ERASER, OUTLIER_DIM, -OUTLIER_VALUE, probe, 1)
    for layer in range(1, len(GROWTH)):
        wire(model, layer, GROWER, SINK_DIM, SINK_DIM)
        scale_write(model, layer, GROWER, SINK_DIM, GROWTH[layer] - GROWTH[layer - 1], probe, 0)
    return model


def plant_rebuild(model: Any) -> Any:
    """See the module docstring; returns the model, edited in place."""
    plant_sink(model)
    wire(model, REBUILD_LAYER, REBUILDER, BOS_TRIGGER, SINK_DIM)

    def zero_sink(resid, hook):
        resid = resid.clone()
        resid[:, 0, SINK_DIM] = 0.0
        return resid

    scale_write(model, REBUILD_LAYER, REBUILDER, SINK_DIM, VALUE, _probe(model), 0,
                hooks=[("blocks.0.hook_resid_post", zero_sink)])
    return model


def plant_brief(model: Any) -> Any:
    """See the module docstring; returns the model, edited in place."""
    plant_sink(model)
    set_trigger(model, WORD, WORD_TRIGGER)
    clean_dim(model, BRIEF_DIM)
    wire(model, 0, WORD_NEURON, WORD_TRIGGER, BRIEF_DIM)
    scale_write(model, 0, WORD_NEURON, BRIEF_DIM, BRIEF_VALUE, _probe(model), 2)
    wire(model, 1, ERASER, BRIEF_DIM, BRIEF_DIM, sign=-1.0)
    scale_write(model, 1, ERASER, BRIEF_DIM, -BRIEF_VALUE, _probe(model), 2)
    return model


DIP_TRIGGER, DIPPER, DIP_LAYER = 15, 61, 1  # plant_dip: OUTLIER_DIM dips under the outlier share at DIP_LAYER


def plant_dip(model: Any) -> Any:
    """:func:`plant_story` (Llama-style), then ``OUTLIER_DIM`` dips under the outlier share at
    ``DIP_LAYER``: a neuron there erases it at every token but ``WORD`` (and BOS, where it is
    zero), so at that layer it stays massive at the ``WORD`` tokens only, fewer than half of a
    text's tokens but more than ``OUTLIER_DIM_MIN_TOKENS``; ``OUTLIER_END``'s neuron then erases
    the rest. Its entries at ``DIP_LAYER`` look token-specific to a rule decided per layer.
    Returns the model, edited in place."""
    plant_story(model)
    clean_dim(model, DIP_TRIGGER)
    with torch.no_grad():
        model.W_E[:, DIP_TRIGGER] = 1.0
        model.W_E[[model.tokenizer.bos_token_id, WORD], DIP_TRIGGER] = 0.0
    wire(model, DIP_LAYER, DIPPER, DIP_TRIGGER, OUTLIER_DIM, sign=-1.0)
    with torch.no_grad():  # the trigger is small beside OUTLIER_VALUE under the pre-norm: read it louder
        wire_neuron(model.blocks[DIP_LAYER].mlp, DIPPER, DIP_TRIGGER, gain=3.0 * OUTLIER_VALUE)
    scale_write(model, DIP_LAYER, DIPPER, OUTLIER_DIM, -OUTLIER_VALUE, _probe(model), 1)
    return model


KEY_DIMS = (SINK_DIM, 24, 25)  # plant_key_writers: MLP i writes KEY_DIMS[i] at BOS
QUERY_DIM, QUERY_CONST, KEY_NEURON = 26, 0.05, 37  # every token but BOS carries QUERY_CONST in QUERY_DIM
SINK_LOGIT = 8.0  # the sink logit plant_key_writers aims at in every sink layer


def _rotary_pair(model: Any) -> list[int]:
    d_head = model.cfg.d_head
    return [d_head // 2 - 1, d_head - 1]  # the lowest rotary frequency (rotate-half layout): barely turns


def _sink_logit(model: Any, tokens: torch.Tensor, layer: int) -> float:
    scores = _grab(model, tokens, f"blocks.{layer}.attn.hook_attn_scores", [])
    return float(scores[:, :, 1:, 0].mean())


def plant_key_writers(model: Any, values: tuple[float, ...], logit: float = SINK_LOGIT) -> Any:
    """A sink whose key has known writers (pre-norm families; ``len(values) + 2`` layers or more):
    MLP ``i`` writes ``values[i]`` into the clean dim ``KEY_DIMS[i]`` at BOS only (MLP 0 from BOS's
    trigger, the later ones from BOS's ``SINK_DIM``). From layer ``len(values)`` on every key head
    reads each of those dims with the same weight into the lowest-frequency rotary pair, and every
    query head reads ``QUERY_DIM`` (a constant at every token but BOS) there, scaled so that the
    sink logit is about ``logit`` in each such layer, a few nats over the content keys: every head
    there is a sink head whose logit the writers share in proportion to ``values`` (RMSNorm keeps
    the proportions). Equal values: a sink built from equal parts, none of which kills it alone;
    one large value: one writer that dominates. The layers before read nothing into the pair.
    Returns the model, edited in place."""
    n = len(values)
    assert not post_norm(model) and model.cfg.n_layers >= n + 2 and n <= len(KEY_DIMS)
    plant_sink(model, values[0])
    bos, pair = model.tokenizer.bos_token_id, _rotary_pair(model)
    clean_dim(model, QUERY_DIM)
    with torch.no_grad():
        model.W_E[:, QUERY_DIM] = QUERY_CONST
        model.W_E[bos, QUERY_DIM] = 0.0
    probe = _probe(model)
    for i in range(1, n):
        clean_dim(model, KEY_DIMS[i])
        wire(model, i, KEY_NEURON, SINK_DIM, KEY_DIMS[i])
        scale_write(model, i, KEY_NEURON, KEY_DIMS[i], values[i], probe, 0)
    tokens = bos_tokens(model, TEXT, 32, 2)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            for weight in (attn.W_Q, attn.W_K):
                weight[:, :, pair] = 0.0
            for bias in (getattr(attn, "b_Q", None), getattr(attn, "b_K", None)):
                if bias is not None:
                    bias[:, pair] = 0.0
            if layer < n:
                continue
            attn.W_Q[:, QUERY_DIM, pair[0]] = 1.0
            for dim in KEY_DIMS[:n]:
                attn.W_K[:, dim, pair[0]] = 1.0
        for layer in range(n, model.cfg.n_layers):  # in order: a layer's queries depend on the sinks before it
            now = _sink_logit(model, tokens, layer)
            model.blocks[layer].attn.W_Q[:, QUERY_DIM, pair[0]] *= logit / now
    return model


SHARED_TRIGGER, DECOY, CULPRIT = 19, 17, 29  # plant_misranked: the detector's top neuron and the damaging one
DECOY_VALUE, CULPRIT_VALUE = 5000.0, 1000.0  # their writes into SINK_DIM at BOS (MLP 0)


def plant_misranked(model: Any, boost: float = 4.0) -> Any:
    """A sink whose detector ranks the harmless weight first (pre-norm families): at BOS, MLP 0's
    ``DECOY`` writes ``DECOY_VALUE`` and ``CULPRIT`` ``CULPRIT_VALUE`` into the clean ``SINK_DIM``,
    so the detector (``|contribution|`` at BOS) ranks ``DECOY`` first. ``CULPRIT`` reads a trigger
    that ``WORD`` carries too, so it also writes a massive value at every ``WORD`` token, and the
    unembedding reads ``SINK_DIM`` as ``boost`` nats for the token that most often follows
    ``WORD`` in ``TEXT``: zeroing ``CULPRIT``'s weight takes that prediction away (the loss
    rises), while zeroing ``DECOY``'s leaves BOS's residual pointing the same way (1,000 still
    dwarfs the rest), which every RMSNorm reads alike, so the loss barely moves. Returns the
    model, edited in place."""
    assert not post_norm(model), "plant_misranked: a pre-norm family"
    bos = model.tokenizer.bos_token_id
    set_trigger(model, bos, BOS_TRIGGER)
    set_trigger(model, WORD, SHARED_TRIGGER)
    clean_dim(model, SHARED_TRIGGER)
    clean_dim(model, SINK_DIM)
    with torch.no_grad():
        model.W_E[[bos, WORD], SHARED_TRIGGER] = 1.0
    wire(model, 0, DECOY, BOS_TRIGGER, SINK_DIM)
    wire(model, 0, CULPRIT, SHARED_TRIGGER, SINK_DIM)
    probe = _probe(model)
    scale_write(model, 0, DECOY, SINK_DIM, DECOY_VALUE, probe, 0)
    scale_write(model, 0, CULPRIT, SINK_DIM, CULPRIT_VALUE, probe, 0)
    with torch.no_grad():
        model.W_U[SINK_DIM] = 0.0
        model.W_U[SINK_DIM, word_successor(model)] = boost / model.cfg.d_model ** 0.5
    return model


def word_successor(model: Any) -> int:
    """The token that most often follows ``WORD`` in ``TEXT``."""
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    after = [b for a, b in zip(ids, ids[1:], strict=False) if a == WORD]
    return max(set(after), key=after.count)


CHANNEL_DIM, COMMA_TRIGGER, SPIKER, UNSPIKER = 21, 27, 45, 46  # plant_channel_spike
CHANNEL_VALUE, SPIKE = 60.0, 200.0  # the channel at every token but BOS (under the 100 bar); the spike added at commas
COMMA = byte_tokenizer()(",", add_special_tokens=False)["input_ids"][0]


def plant_channel_spike(model: Any) -> Any:
    """:func:`plant_sink` (BOS's token-specific massive activation), and a *channel*:
    ``CHANNEL_DIM`` carries ``CHANNEL_VALUE`` at every token but BOS from the embedding on,
    large but under the massive bar, and MLP 0 adds ``SPIKE`` at every ``COMMA``, which MLP 1
    takes away: at layer 0 the channel passes the massive rule at the commas only, an ordinary
    token. It is the channel's tail, not a token that stands out. Pre-norm families; returns
    the model, edited in place."""
    assert not post_norm(model), "plant_channel_spike: a pre-norm family"
    plant_sink(model)
    set_trigger(model, COMMA, COMMA_TRIGGER)
    clean_dim(model, CHANNEL_DIM)
    with torch.no_grad():
        model.W_E[:, CHANNEL_DIM] = CHANNEL_VALUE
        model.W_E[model.tokenizer.bos_token_id, CHANNEL_DIM] = 0.0
    probe = torch.tensor([[model.tokenizer.bos_token_id, 84, COMMA, 32, 98, COMMA]])
    for layer, neuron, sign in ((0, SPIKER, 1.0), (1, UNSPIKER, -1.0)):
        wire(model, layer, neuron, COMMA_TRIGGER, CHANNEL_DIM, sign=sign)
        with torch.no_grad():  # the trigger is small beside the channel under the pre-norm: read it louder
            wire_neuron(model.blocks[layer].mlp, neuron, COMMA_TRIGGER, gain=3.0 * CHANNEL_VALUE)
        scale_write(model, layer, neuron, CHANNEL_DIM, sign * SPIKE, probe, 2)
    return model
