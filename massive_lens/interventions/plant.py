"""A sink planted on purpose: make a later position attend only to itself.

Under the causal mask the first token is the only position that can attend to nothing but
itself, in every layer; every other query mixes in the tokens before it. If that is what makes
the first token the model's sink, then forcing some position ``pos`` to attend only to itself
(its row of each chosen layer's attention is one-hot on ``pos``) should make a second sink there,
with its own massive activation, and the sink analyses get a known answer: the census should
name ``pos``, ``find_massive``/``trace_origin`` its massive dims and where they are born, and
the sink logit at ``pos`` should be split by the writers the plant set off.

:func:`force_self_attention` does it at each chosen layer's ``attn.hook_attn_scores``: query
``pos`` gets the most negative logit on every key but ``pos`` (weight zero after the softmax), the
other queries are untouched. It runs where the pattern is built, the eager path; analyses run under
it read the eager pattern by themselves (``attention="auto"`` sees the edit), and ``"lse"`` refuses.
:func:`shift_rotary_position` is the control on the other explanation, the first token's rotary
position: it gives ``pos`` the rotary ``cos``/``sin`` of position ``to`` (``attn.hook_cos``/``hook_sin``:
exactly what passing ``position_ids`` with ``pos`` at ``to`` to the Hugging Face model computes) and
nothing else.
:func:`planted_writers` splits the sink logit at any position, per head, into its writers (the
split of :func:`~massive_lens.attention.sink_circuit`, which reads the first token only);
:func:`sink_strength` measures how much of a sink any position is, per sequence.

>>> from massive_lens import tiny_model
>>> iv = force_self_attention(tiny_model("llama"), 3, layers=[0, 1])
>>> iv.name, iv.pos, iv.layers
('self_attention_forced', 3, (0, 1))
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.attention.circuit import chosen_heads
from massive_lens.attention.circuit_split import CircuitCapture, split_layer
from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.criterion import SINK_THRESHOLD, Criterion, SinkRule
from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import rel_error
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.assemble import acts_on
from massive_lens.interventions.intervention import Intervention

Position = Any  # an int; checked by _position / shift_rotary_position with a clear error
Layers = Any  # an int, a sequence of ints or None; checked by ModelView.chosen_layers

WRITER_COLUMNS = ["layer", "head", "pos", "sink_mass", "logit", "dominant", "dominant_share", "massive_share",
                  "runner_up", "runner_up_share", "check"]


def _position(view: ModelView, pos: Any, what: str) -> int:
    if isinstance(pos, bool) or not isinstance(pos, int):
        raise MassiveLensError(f"{what} must be an int (a token position), got {pos!r}")
    if pos < 1:
        raise MassiveLensError(f"{what} must be >= 1, got {pos}: position 0, the first token, already attends only "
                               "to itself under the causal mask (plant at a later position)")
    if view.n_ctx is not None and pos >= view.n_ctx:
        raise MassiveLensError(f"{what} {pos} is out of range: {view.name} reads at most {view.n_ctx} tokens")
    return pos


def _self_only(scores: Float[Tensor, "batch head_index query_pos key_pos"], hook: Any, *, pos: int) -> Tensor:
    if scores.shape[-2] <= pos:  # a text that ends before pos (e.g. perplexity's probe of its first tokens)
        return scores
    out = scores.clone()
    others = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
    others[pos] = False
    out[..., pos, others] = torch.finfo(scores.dtype).min
    return out


def force_self_attention(model: Any, pos: Position, layers: Layers = None) -> Intervention:
    """Make position ``pos`` attend only to itself in ``layers`` (a planted sink; see the module docstring).

    Args:
        model: a TransformerLens-style model with ``attn.hook_attn_scores`` in the chosen layers.
        pos: the position to plant at (>= 1; the first token already attends only to itself).
        layers: an int or a sequence of ints; None: every layer.

    Returns:
        An :class:`Intervention` named ``"self_attention_forced"``, with ``.pos`` and ``.layers``.
        It edits the scores, so an analysis run under it reads the eager pattern (``attention="auto"``
        sees the edit and takes it; ``"lse"`` is refused).

    Raises:
        MassiveLensError: ``pos`` not an int, below 1 or past the model's context; ``layers`` empty,
            not ints or out of range; a layer without attention scores. A pass over a text that ends
            before ``pos`` is left as it is (there is no position ``pos`` to plant at; the library's
            own probes of a text's first tokens, such as perplexity's check of its output head, run
            under the plant too).

    >>> from massive_lens import tiny_model
    >>> from massive_lens.core.model_view import ModelView
    >>> m = tiny_model("llama")
    >>> view = ModelView(m)
    >>> with force_self_attention(m, 3, layers=0):
    ...     p = view.activation(view.tokenize("Hello there, world."), "blocks.0.attn.hook_pattern")
    >>> p[0, :, 3, 3].tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    view = ModelView(model)
    pos = _position(view, pos, "pos")
    chosen = view.chosen_layers(layers)
    hooks = [(view.hook_name(layer, "attn.hook_attn_scores"), partial(_self_only, pos=pos)) for layer in chosen]
    iv = Intervention(model, "self_attention_forced", hooks,
                      acts_on=acts_on(model, attn=chosen, inside=f"position {pos}'s attention (scores: itself only)"))
    iv.pos, iv.layers = pos, tuple(chosen)
    return iv


def _moved(table: Float[Tensor, "... pos rotary_dim"], hook: Any, *, pos: int, to: int, sign: float) -> Tensor:
    n = table.shape[-2]
    if n <= max(pos, abs(to)):
        raise MassiveLensError(f"shift_rotary_position: the text has {n} tokens, so {hook.name} holds the rotation "
                               f"of positions 0..{n - 1}; moving position {pos} to {to} needs at least "
                               f"{max(pos, abs(to)) + 1} tokens (give a longer text or a smaller shift)")
    out = table.clone()
    out[..., pos, :] = sign * table[..., abs(to), :]
    return out


def shift_rotary_position(model: Any, pos: Position = 0, to: Position = 1) -> Intervention:
    """Give position ``pos`` the rotary position ``to`` (its ``cos``/``sin``) in every layer, nothing else.

    The same as passing ``position_ids`` with ``pos`` at ``to`` to the Hugging Face model: the
    rotation of every other token and every token's content are untouched. ``to`` may be negative
    (``cos`` is even, ``sin`` odd), within the text's length either way.

    Args:
        model: a rotary model whose attention layers have ``attn.hook_cos`` and ``attn.hook_sin``.
        pos: the position whose rotary position changes (default 0, the first token).
        to: the rotary position it gets.

    Returns:
        An :class:`Intervention` named ``"rotary_shifted"``, with ``.pos`` and ``.to``.

    Raises:
        MassiveLensError: ``pos`` or ``to`` not an int, ``pos`` negative, a model without rotary
            ``cos``/``sin`` hooks (learned or no positions), or (when it runs) a text shorter than
            ``max(pos, |to|) + 1`` tokens.

    >>> from massive_lens import tiny_model
    >>> iv = shift_rotary_position(tiny_model("llama"), to=4)
    >>> iv.name, iv.pos, iv.to
    ('rotary_shifted', 0, 4)
    """
    view = ModelView(model)
    for name, value in (("pos", pos), ("to", to)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise MassiveLensError(f"shift_rotary_position: {name} must be an int (a position), got {value!r}")
    if pos < 0:
        raise MassiveLensError(f"shift_rotary_position: pos must be >= 0, got {pos}")
    layers = [layer for layer in range(view.n_layers)
              if view.has_hook(layer, "attn.hook_cos") and view.has_hook(layer, "attn.hook_sin")]
    if not layers:
        raise MassiveLensError(f"{view.name} has no rotary cos/sin hooks (attn.hook_cos, attn.hook_sin): its positions "
                               "are learned or absent, so there is no rotary position to shift")
    hooks = [(view.hook_name(layer, f"attn.hook_{which}"),
              partial(_moved, pos=pos, to=to, sign=-1.0 if which == "sin" and to < 0 else 1.0))
             for layer in layers for which in ("cos", "sin")]
    iv = Intervention(model, "rotary_shifted", hooks,
                      acts_on=acts_on(model, attn=layers, inside=f"position {pos}'s rotary cos/sin (moved to {to})"))
    iv.pos, iv.to = pos, to
    return iv


def sink_strength(model: Any, text: Any, *, pos: Any = 0, threshold: float = SINK_THRESHOLD,
                  batch_size: int = 4) -> pd.DataFrame:
    """Per sequence, how much of a sink each position in ``pos`` is: Gu et al.'s sink metric applied to it.

    A head counts when its mean attention to the position, over the (up to 64) real queries after
    it, exceeds ``threshold`` (the census's per-head test); the strength is the share of all heads of
    all layers that count. Read from the attention pass on the path
    :func:`~massive_lens.core.attention_pass.choose_path` takes (the eager pattern under an intervention
    entered around it, ``with force_self_attention(...)``, which the fused kernel would skip).

    Args:
        model: a TransformerLens-style model with attention patterns.
        text: a string, a list of strings or a token tensor.
        pos: a position or a list of positions (0: the first token).
        threshold: the attention share that makes a head count, in (0, 1).
        batch_size: sequences per forward pass.

    Returns:
        A DataFrame, one row per sequence and position: ``seq``, ``pos``, ``strength`` (share of heads),
        ``mass`` (their mean attention to it, over heads and layers), ``queries`` (later real queries).

    Raises:
        MassiveLensError: a position out of range of the text, a threshold outside (0, 1).

    >>> from massive_lens import tiny_model
    >>> s = sink_strength(tiny_model("llama"), "Hello there, world. " * 4, pos=[0, 3])
    >>> s.columns.tolist(), s["pos"].tolist()
    (['seq', 'pos', 'strength', 'mass', 'queries'], [0, 3])
    """
    view = ModelView(model)
    positions = list(pos) if isinstance(pos, (list, tuple)) else [pos]
    if not positions or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in positions):
        raise MassiveLensError(f"pos must be a position (an int >= 0) or a list of them, got {pos!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
        raise MassiveLensError(f"threshold is an attention share in (0, 1), got {threshold!r}")
    whole = view.tokenize(text)
    if max(positions) >= whole.tokens.shape[1]:
        raise MassiveLensError(f"position {max(positions)} is past the end of the text ({whole.tokens.shape[1]} "
                               "tokens)")
    rows, seq0 = [], 0
    for batch in whole.split(batch_size):
        seen: list[Tensor] = []  # per layer [batch head n_pos]
        attention_pass(view, batch, partial(_key_attention_at, positions=positions, seen=seen),
                       path=choose_path(view, "auto", batch), band=True)
        per = torch.stack(seen, 1)  # [B L H n_pos]
        strength, mass = (per > threshold).float().mean((1, 2)), per.mean((1, 2))
        lengths = batch.mask.sum(1)
        for b in range(per.shape[0]):
            for i, p in enumerate(positions):
                rows.append(dict(seq=seq0 + b, pos=p, strength=float(strength[b, i]), mass=float(mass[b, i]),
                                 queries=max(0, int(lengths[b]) - p - 1)))
        seq0 += per.shape[0]
    return pd.DataFrame(rows, columns=["seq", "pos", "strength", "mass", "queries"])


def _key_attention_at(at: PassLayer, *, positions: list[int], seen: list[Tensor]) -> None:
    """One layer's key attention (:func:`~massive_lens.core.criterion.key_attention`, the pass's band) at
    ``positions``, ``[batch head n_pos]``."""
    seen.append(at.band[0][:, :, positions].float().cpu())


def planted_writers(model: Any, text: Any, *, pos: Position, heads: Sequence[Any] | None = None, n_heads: int = 12,
                    rule: SinkRule | None = None, criterion: Criterion | None = None) -> pd.DataFrame:
    """Per sink head of position ``pos``: its attention logit on ``pos`` split by writers, the largest named.

    The exact split of :func:`~massive_lens.attention.sink_circuit` (the key at ``pos`` by its
    writers: embedding, each attention and MLP output, through the layer's norm, ``W_K`` and
    rotary), read at ``pos`` instead of the first token, without the causal check. Run it inside
    ``with force_self_attention(...)`` to ask which writer the plant set off.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings or a token tensor with more than ``pos + 1`` tokens.
        pos: the sink position (>= 1; ``sink_circuit`` reads the first token).
        heads: (layer, head) pairs; None: the top ``n_heads`` by attention to ``pos`` among those
            above the rule's threshold.
        n_heads: how many heads ``heads=None`` picks.
        rule: its threshold names sink heads (default ``SinkRule()``).
        criterion: what counts as a massive dim of the key input (default ``Criterion()``).

    Returns:
        A DataFrame, one row per head: ``layer``, ``head``, ``pos``, ``sink_mass`` (mean attention
        of the later queries to ``pos``), ``logit`` (their mean logit on it), ``dominant`` (the
        key-side writer with the largest part, e.g. ``mlp 3``), ``dominant_share`` (its part over
        the logit), ``massive_share`` (the massive dims' part over the logit), ``runner_up`` and
        ``runner_up_share``, ``check`` (largest relative error of the parts' sum against the scores).

    Raises:
        MassiveLensError: ``pos`` out of range, no head over the threshold on ``pos``, or what
            ``sink_circuit`` refuses (a model without the hooks the split reads).

    >>> from massive_lens import tiny_model
    >>> w = planted_writers(tiny_model("llama"), "Hello there, world. " * 4, pos=2, n_heads=2,
    ...                     rule=SinkRule(threshold=0.01))
    >>> bool((w["check"] < 1e-4).all()), w["pos"].tolist()
    (True, [2, 2])
    """
    view = ModelView(model)
    pos = _position(view, pos, "pos")
    batch = view.tokenize(text)
    if int(batch.lengths.min()) < pos + 2:
        raise MassiveLensError(f"planted_writers needs queries after position {pos}; the shortest sequence has "
                               f"{int(batch.lengths.min())} tokens")
    rule = rule or SinkRule()
    chosen = list(range(view.n_layers))
    cap = CircuitCapture(view, batch, chosen, criterion or Criterion(), sink=pos)
    cap.run(lambda hooks: view.forward(batch, hooks))
    rows = []
    splits: dict[int, Any] = {}
    for layer, head in chosen_heads(view, cap, heads, n_heads, rule.threshold):
        split = splits.setdefault(layer, split_layer(view, cap, layer))
        rows.append(_writer_row(split, cap.keep[layer], layer, head, pos))
    return pd.DataFrame(rows, columns=WRITER_COLUMNS)


def _writer_row(split: Any, keep: Any, layer: int, head: int, pos: int) -> dict[str, Any]:
    kv = head // (split.q.shape[2] // split.keys.shape[2])
    v = split.valid
    parts = split.scale * torch.einsum("bqe,bpe->bqp", split.q[:, :, head], split.keys[:, :, kv])[v]  # [n part]
    total = keep.scores[:, head][v]
    logit = float(total.mean())
    mean = parts.mean(0)
    by_writer: dict[str, float] = {}
    for i, name in enumerate(split.names):
        if name.split(" ")[0] in ("embed", "pos_embed", "attn", "mlp"):
            by_writer[name] = by_writer.get(name, 0.0) + float(mean[i])
    ranked = sorted(by_writer.items(), key=lambda kv_: kv_[1], reverse=True)
    massive = sum(float(mean[i]) for i, d in enumerate(split.dims) if d == "massive")
    share = (lambda x: x / logit) if logit else (lambda x: float("nan"))
    (top, top_v), (second, second_v) = ranked[0], ranked[1] if len(ranked) > 1 else ("", float("nan"))
    return dict(layer=layer, head=head, pos=pos, sink_mass=float(keep.pattern[:, head][v].mean()), logit=logit,
                dominant=top, dominant_share=share(top_v), massive_share=share(massive), runner_up=second,
                runner_up_share=share(second_v),
                check=rel_error(parts.sum(-1), total))
