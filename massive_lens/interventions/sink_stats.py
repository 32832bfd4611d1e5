"""Per layer and head, what the sinks hold on calibration text: the mean sink term (over
non-sink queries), the mean sink key and value, and the attention paid to the sinks (the
second pass of :func:`~massive_lens.interventions.calibrate`)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from massive_lens.attention.sinks import sink_term
from massive_lens.core.gather import LayerGather
from massive_lens.core.layer_attention import LayerAttention
from massive_lens.core.lse import lse_run
from massive_lens.core.model_view import ModelView
from massive_lens.interventions.access import attention_access


def sink_pass(view: ModelView, model: Any, chunks: list[tuple[int, Tensor]], mask: Bool[Tensor, "seq pos"],
               attn_layers: tuple[int, ...], bar: Any) -> dict[str, Tensor]:
    """Mean sink term (non-sink queries), sink key and value, and attention to the sinks, per
    layer and head. Read in whatever order the bridge fires the hooks; a quantity whose hooks
    the bridge does not give per head (see :mod:`~massive_lens.interventions.access`) is NaN.
    On a view that serves no attention pattern (nnsight), all four come from q, k, v and the
    fused kernel's log-sum-exp (:mod:`massive_lens.core.lse`), inside the pass."""
    sums: dict[tuple[str, int], Tensor] = {}
    counts = torch.zeros(2, dtype=torch.float64)  # non-sink queries, sink keys

    def add(key: str, layer: int, value: Tensor) -> None:
        value = value.double().cpu()
        sums[key, layer] = sums[key, layer] + value if (key, layer) in sums else value

    if not view.serves_patterns:  # a view that serves no per-head hooks or patterns (nnsight): the LSE path
        for start, chunk in chunks:
            sinks = mask[start:start + len(chunk)]
            counts += torch.tensor([float((~sinks).sum()), float(sinks.sum())], dtype=torch.float64)
            if attn_layers:
                with lse_run(view, partial(_lse_layer, add=add, sinks=sinks, layers=set(attn_layers))):
                    view.forward(view.full_batch(chunk), [],
                                 stop_after=view.hook_name(attn_layers[-1], "resid_post"))
            bar.update()
        return _stacked(view, model, sums, counts, attn_layers)
    access = attention_access(model)

    def on_act(act: Tensor, hook: Any, layer: int, kind: str, sinks: Tensor) -> None:
        sinks = sinks.to(act.device)
        if kind == "pattern":
            add("mass", layer, torch.einsum("bhqk,bk,bq->h", act.double(), sinks.double(), (~sinks).double()))
        else:
            add(kind, layer, torch.einsum("bkhd,bk->hd", act.double(), sinks.double()))

    def on_term(layer: int, pattern: Tensor, v: Tensor, sinks: Tensor) -> None:
        sinks = sinks.to(v.device)
        term = sink_term(pattern, v, sinks)
        add("z", layer, torch.einsum("bqhd,bq->hd", term.double(), (~sinks).double()))

    for start, chunk in chunks:
        sinks = mask[start:start + len(chunk)]
        counts += torch.tensor([float((~sinks).sum()), float(sinks.sum())], dtype=torch.float64)
        hooks, term = [], LayerGather(("pattern", "v"), partial(on_term, sinks=sinks))  # the two in any order
        for layer in attn_layers:
            a = access[layer]
            per_head = a.per_head("v")  # else (latent attention) neither keys nor values are per head
            reads = {"pattern": "pattern" if a.fires("pattern") else None,
                     "v": "v" if per_head else None, "k": a.key_hook if per_head else None}
            for kind, hook in reads.items():
                if hook is not None:
                    name = view.hook_name(layer, f"attn.hook_{hook}")
                    hooks.append((name, partial(on_act, layer=layer, kind=kind, sinks=sinks)))
                    if kind in term.keys:
                        hooks.append((name, term.hook(kind, layer)))
        if hooks:
            view.forward(view.full_batch(chunk), hooks, stop_after=view.hook_name(attn_layers[-1], "resid_post"))
        bar.update()
    return _stacked(view, model, sums, counts, attn_layers)


def _lse_layer(att: LayerAttention, *, add: Any, sinks: Tensor, layers: set[int]) -> None:
    """One layer's sums of :func:`sink_pass` from q, k, v and the kernel's log-sum-exp: the
    attention on the sink columns only (keys after rotary, as the kernel gets them)."""
    if att.layer not in layers:
        return
    s = sinks.to(att.q.device)
    cols = s.any(0).nonzero().flatten()
    p = att.columns(cols).double()  # [batch head query col]
    at, queries = s[:, cols].double(), (~s).double()
    v = att.v[:, :, cols].double().repeat_interleave(att.group, 1)  # [batch head col d_head]
    add("mass", att.layer, torch.einsum("bhqc,bc,bq->h", p, at, queries))
    add("k", att.layer, torch.einsum("bhkd,bk->hd", att.k.double(), s.double()))
    add("v", att.layer, torch.einsum("bhkd,bk->hd", att.v.double(), s.double()))
    add("z", att.layer, torch.einsum("bhqc,bc,bhcd,bq->hd", p, at, v, queries))


def _stacked(view: ModelView, model: Any, sums: dict[tuple[str, int], Tensor], counts: Tensor,
             attn_layers: tuple[int, ...]) -> dict[str, Tensor]:
    """The means of :func:`sink_pass`, stacked ``[layer ...]`` (NaN where not measured)."""
    scale = {"z": counts[0], "mass": counts[0], "k": counts[1], "v": counts[1]}
    widest: dict[str, tuple[int, ...]] = {}
    for (key, _), t in sums.items():  # layers may differ in heads or head width (e.g. local and global layers)
        widest[key] = tuple(max(a, b) for a, b in zip(widest.get(key, t.shape), t.shape, strict=True))
    shapes = _shapes(model, widest)
    out = {}
    for key in ("z", "k", "v", "mass"):
        stacked = torch.full((view.n_layers, *shapes[key]), float("nan"), dtype=torch.float64)
        for layer in attn_layers:
            if (key, layer) in sums:
                value = sums[key, layer] / scale[key].clamp(min=1)
                stacked[(layer, *(slice(0, n) for n in value.shape))] = value
        out["sink_" + key] = stacked.float()
    return out


def unpad(value: Tensor) -> Tensor:
    """One layer's sink quantity without the NaN padding that a narrower layer carries in the
    stacked tensor (rows and columns that are NaN throughout).

    >>> unpad(torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")]])).tolist()
    [[1.0]]
    """
    seen = ~value.isnan()
    ends = []
    for axis in range(seen.dim()):
        along = seen.movedim(axis, 0).reshape(seen.shape[axis], -1).any(1).nonzero()
        ends.append(int(along.max()) + 1 if len(along) else 0)
    return value[tuple(slice(0, n) for n in ends)]


def _shapes(model: Any, seen: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The per-layer shape of each sink quantity (the widest layer's): as measured, else from
    the other quantities or the model's config (that quantity is then NaN)."""
    cfg = ModelView(model).cfg
    heads = seen["mass"][0] if "mass" in seen else int(cfg.n_heads)
    kv = seen.get("v") or seen.get("k") or (int(getattr(cfg, "n_key_value_heads", None) or heads), int(cfg.d_head))
    return {"mass": (heads,), "k": seen.get("k") or kv, "v": seen.get("v") or kv,
            "z": seen.get("z") or (heads, kv[-1])}
