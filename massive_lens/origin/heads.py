"""Which attention heads write a traced entry: each attention term of the ledger, split by head.

An attention layer adds ``sum_h z_h @ W_O[h] + b_O`` to the residual stream (``z`` is the
heads' output, ``blocks.{l}.attn.hook_z``), so its ledger term at ``(pos, dim)`` splits
exactly into one term per head plus the bias (``head = -1``). On a model with post-sublayer
norms the ledger's term is read after ``ln1_post``; the head terms are then linearised
through that norm at its measured scale, so they still sum to the ledger's term. Each row
also says where the head looks from ``pos``: its attention on the first token and the
largest attention it puts on any one key (a head that writes a massive activation while
attending to the sink is the sink's doing). A layer whose output is not ``z @ W_O + b_O`` (a
norm between the heads and ``W_O``, latent attention) is left unsplit, with a note.

>>> from massive_lens import tiny_model, trace_origin
>>> trace = trace_origin(tiny_model("llama"), "Hi there.", dim=3, pos=0)
>>> attn = trace.ledger[trace.ledger.component == "attn"].set_index("layer").contribution
>>> sums = trace.heads.groupby("layer").contribution.sum()
>>> bool(((sums - attn).abs() <= 1e-4 * (attn.abs() + 1)).all())
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from massive_lens.attention.output_weights import output_weights
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.origin.capture import Capture

HEAD_COLUMNS = ["pos", "dim", "layer", "head", "contribution", "share", "first_token_attention", "max_attention"]
SPLIT_TOL = 1e-3  # relative error of sum_h z_h W_O[h] + b_O against the attention output, per position


def head_rows(view: ModelView, cap: Capture, targets: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per traced entry and attention layer, one row per head (and one for ``b_O``), and the
    notes on layers that could not be split."""
    rows: list[dict[str, Any]] = []
    unsplit: dict[int, str] = {}
    index = sorted({cap.index(t["pos"]) for t in targets})  # rows of the capture that are traced
    dims = sorted({t["dim"] for t in targets})  # and their columns
    for layer in range(len(cap.plans)):
        split = _layer_split(view, cap, layer, torch.tensor(index, dtype=torch.long), dims)
        if isinstance(split, str):
            unsplit[layer] = split
            continue
        per_head, bias, pattern = split  # [traced, head, dims], [d_model], [traced, head, 2] or None
        per_head = per_head.tolist()
        pattern = None if pattern is None else pattern.tolist()
        for t in targets:
            d, row = t["dim"], cap.index(t["pos"])
            i = index.index(row)
            term = float(cap.layers["attn"][layer, row, d])
            factor = _post_norm_factor(cap, layer, row, d)
            column = dims.index(d)
            values = [*(h[column] * factor for h in per_head[i]), float(bias[d]) * factor]
            nan = [float("nan")] * 2
            for head, value in enumerate(values):
                is_bias = head == len(values) - 1
                if is_bias and bias[d] == 0:
                    continue
                seen = pattern[i][head] if pattern is not None and not is_bias else nan
                rows.append(dict(pos=t["pos"], dim=d, layer=layer, head=-1 if is_bias else head,
                                 contribution=value, share=value / term if term else float("nan"),
                                 first_token_attention=seen[0], max_attention=seen[1]))
    notes = []
    if unsplit:
        layers = sorted(unsplit)
        notes.append(f"note: the attention of layer(s) {', '.join(map(str, layers))} is not split by head "
                     f"({unsplit[layers[0]]})")
    return rows, notes


def _layer_split(view: ModelView, cap: Capture, layer: int, index: Tensor, dims: list[int]
                 ) -> tuple[Tensor, Tensor, Tensor | None] | str:
    """``z_h @ W_O[h]`` per head at the capture rows ``index`` and columns ``dims``, ``b_O`` and
    the pattern summary there; or why the layer does not split (the heads' sum plus ``b_O`` must
    give the attention output at those entries)."""
    z = cap.at("z", layer)
    if z is None:
        return "no attn.hook_z fired"
    try:
        W_O, b_O = output_weights(view, layer)
    except MassiveLensError as exc:
        return str(exc).split(": ", 1)[-1]
    heads, d_head, d_model = W_O.shape
    if z.shape[-1] != heads * d_head:
        return f"hook_z has {z.shape[-1]} values per position, W_O {tuple(W_O.shape)}"
    W_O = W_O.float().cpu()
    z = z[index]
    per_head = torch.einsum("phd,hdk->phk", z.view(-1, heads, d_head), W_O[:, :, dims])  # [pos, head, dims]
    bias = torch.zeros(d_model) if b_O is None else b_O.float().cpu()
    raw = cap.at("attn_raw", layer) if cap.at("attn_raw", layer) is not None else cap.layers["attn"][layer]
    raw = raw[index]
    # the split must give the attention output at the entries it splits (relative to the output's norm)
    err = (per_head.sum(1) + bias[dims] - raw[:, dims]).norm(dim=-1) / raw.norm(dim=-1).clamp(min=1e-12)
    if float(err.max()) > SPLIT_TOL:
        return f"sum of z_h @ W_O[h] + b_O misses the attention output by {float(err.max()):.1e} (relative)"
    pattern = cap.at("pattern", layer)
    return per_head, bias, None if pattern is None else pattern[index]


def _post_norm_factor(cap: Capture, layer: int, index: int, dim: int) -> float:
    """``ln1_post`` output / input at one entry (1 without a post-attention norm)."""
    raw = cap.at("attn_raw", layer)
    if raw is None:
        return 1.0
    value = float(raw[index, dim])
    return 0.0 if value == 0.0 else float(cap.layers["attn"][layer, index, dim]) / value
