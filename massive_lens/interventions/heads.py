"""Zeroing heads: the dormant heads of :func:`~massive_lens.attention.dormant.dormant_heads`, or any
heads you name.

Sandoval-Segura et al. (2025) zero the output of dormant heads and find accuracy kept; this
builder makes that edit an :class:`~massive_lens.interventions.Intervention`, so that
``run_interventions`` and the report evaluate it like every other setting. The heads are found
on calibration text (never the evaluation text), and the edit sets each chosen head's output
``z_h`` (``blocks.{l}.attn.hook_z``, before ``W_O``) to zero at every position; ``b_O`` stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.attention.dormant import NORM_RATIO, SINK_SHARE, DormantHeads, dormant_heads
from massive_lens.attention.output_weights import output_weights
from massive_lens.core.corpora import default_text, sequences
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.assemble import acts_on
from massive_lens.interventions.calibration_result import Calibration
from massive_lens.interventions.intervention import Intervention


def _zero_heads(z: Tensor, hook: Any, *, heads: list[int]) -> Tensor:
    z = z.clone()
    z[:, :, heads] = 0.0
    return z


def ranked_heads(found: DormantHeads) -> list[tuple[int, int]]:
    """Every head, most dormant first: by the share of sequences where it is dormant, then by its
    mean output norm ratio (smallest first).

    Args:
        found: a :class:`~massive_lens.attention.dormant.DormantHeads`.

    Returns:
        ``(layer, head)`` pairs.
    """
    f = found.to_frame().groupby(["layer", "head"], as_index=False).agg(dormant=("dormant", "mean"),
                                                                          ratio=("norm_ratio", "mean"))
    f = f.sort_values(["dormant", "ratio"], ascending=[False, True])
    return [(int(layer), int(head)) for layer, head in zip(f["layer"], f["head"], strict=True)]


# the orders in which heads are zeroed: most dormant first; the highest first-token sink score
# first (Sok et al. 2026's sink-aware pruning); the smallest mean output norm first (activation
# norm); the smallest ||W_O[h]|| first (weight magnitude); random heads (a control)
ORDERS = ("dormant", "sink", "activation", "weight", "random")


def head_order(model: Any, found: DormantHeads, order: str) -> list[tuple[int, int]]:
    """Every head, in the order ``order`` zeroes them, ranked on ``found`` (calibration text).

    Args:
        model: the model ``found`` was measured on (``"weight"`` reads its ``W_O``).
        found: a :class:`~massive_lens.attention.dormant.DormantHeads` of the calibration text.
        order: one of :data:`ORDERS` but ``"random"``: ``"dormant"`` (:func:`ranked_heads`),
            ``"sink"`` (mean attention to the sinks, largest first), ``"activation"`` (mean output
            norm ``|z_h W_O[h]|``, smallest first) or ``"weight"`` (Frobenius norm of ``W_O[h]``,
            smallest first); ties keep (layer, head) order.

    Returns:
        ``(layer, head)`` pairs.

    Raises:
        MassiveLensError: for an unknown order.
    """
    if order == "dormant":
        return ranked_heads(found)
    f = found.to_frame().groupby(["layer", "head"], as_index=False).agg(sink=("sink_mass", "mean"),
                                                                          activation=("out_norm", "mean"))
    if order == "weight":
        view = ModelView(model)
        norms = {layer: output_weights(view, layer)[0].detach().float().flatten(1).norm(dim=1)
                 for layer in sorted(set(f["layer"]))}
        f["weight"] = [float(norms[layer][head]) for layer, head in zip(f["layer"], f["head"], strict=True)]
    elif order not in ("sink", "activation"):
        raise MassiveLensError(f"order must be one of {ORDERS[:-1]} to rank heads on text, got {order!r}")
    f = f.sort_values(order, ascending=order != "sink", kind="stable")
    return [(int(layer), int(head)) for layer, head in zip(f["layer"], f["head"], strict=True)]


def zero_dormant_heads(model: Any, *, calibration: Any = None, heads: Sequence[tuple[int, int]] | None = None,
                       share: float | None = None, order: str = "dormant", seed: int = 0, min_share: float = 0.5,
                       sink_share: float = SINK_SHARE, norm_ratio: float = NORM_RATIO, seq_len: int = 128,
                       n_seqs: int = 4) -> Intervention:
    """Zero the output of the dormant heads, of a share of heads (most dormant or random first), or of ``heads``.

    Args:
        model: a TransformerLens-style model.
        calibration: the text the dormant heads are found on (a corpus, cut into ``n_seqs``
            sequences of ``seq_len`` tokens; None or a ``Calibration``, which holds no text: the
            offline default text). Use other text than the evaluation text.
        heads: ``(layer, head)`` pairs to zero instead of finding them.
        share: zero this share of all heads (at least one), taken in ``order``; None: exactly the
            heads dormant on at least ``min_share`` of the calibration sequences.
        order: with ``share``, ``"dormant"`` (most dormant first, :func:`ranked_heads`) or
            ``"random"`` (a control: random heads, drawn with ``seed``).
        seed: the random draw of ``order="random"``.
        min_share: without ``share``, a head is zeroed when dormant on at least this share of the
            calibration sequences.
        sink_share: the sink-mass threshold of :func:`~massive_lens.attention.dormant.dormant_heads`.
        norm_ratio: the output-norm threshold of :func:`~massive_lens.attention.dormant.dormant_heads`.
        seq_len: tokens per calibration sequence.
        n_seqs: calibration sequences.

    Returns:
        An :class:`Intervention` named ``"zero_dormant_heads"``; ``.heads`` lists the zeroed heads.

    Raises:
        MassiveLensError: for a head or layer out of range, a ``share`` outside (0, 1] or an unknown ``order``.

    >>> from massive_lens import tiny_model
    >>> iv = zero_dormant_heads(tiny_model("llama"), heads=[(1, 0)])
    >>> iv.name, iv.heads, len(iv)
    ('zero_dormant_heads', [(1, 0)], 1)
    """
    view = ModelView(model)
    if share is not None and not 0 < share <= 1 or order not in ("dormant", "random"):
        raise MassiveLensError(f"share must be in (0, 1] (or None) and order 'dormant' or 'random', got {share!r}, "
                               f"{order!r}")
    if heads is None and share is not None and order == "random":
        every = [(layer, h) for layer in range(view.n_layers) for h in range(view.cfg.n_heads)]
        draw = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed)).tolist()
        heads = [every[i] for i in draw[:max(1, round(share * len(every)))]]
    elif heads is None:
        text = default_text() if calibration is None or isinstance(calibration, Calibration) else calibration
        tokens = sequences(view, text, min(seq_len, view.n_ctx or seq_len), n_seqs)
        found = dormant_heads(model, tokens, sink_share=sink_share, norm_ratio=norm_ratio)
        ranked = ranked_heads(found)
        heads = found.heads(min_share) if share is None else ranked[:max(1, round(share * len(ranked)))]
    chosen = sorted({(int(layer), int(head)) for layer, head in heads})
    by_layer: dict[int, list[int]] = {}
    for layer, head in chosen:
        if not 0 <= head < view.cfg.n_heads:
            raise MassiveLensError(f"head {head} out of range: {view.name} has {view.cfg.n_heads} heads per layer")
        by_layer.setdefault(view.chosen_layers(layer)[0], []).append(head)
    hooks = [(view.hook_name(layer, "attn.hook_z"), partial(_zero_heads, heads=hs)) for layer, hs in by_layer.items()]
    iv = Intervention(model, "zero_dormant_heads", hooks,
                      acts_on=acts_on(model, attn=sorted(by_layer), inside=f"{len(chosen)} heads' outputs (hook_z)"))
    iv.heads = chosen
    return iv
