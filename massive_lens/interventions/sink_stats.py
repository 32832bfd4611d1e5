"""Per layer and head, what the sinks hold on calibration text: the mean sink term (over
non-sink queries), the mean sink key and value, and the attention paid to the sinks (the
second pass of :func:`~massive_lens.interventions.calibrate`), reduced from the attention pass
(:func:`~massive_lens.core.attention_pass.attention_pass`) whichever path read it."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.model_view import ModelView
from massive_lens.interventions.access import attention_access


def sink_pass(view: ModelView, model: Any, chunks: list[tuple[int, Tensor]], mask: Bool[Tensor, "seq pos"],
              attn_layers: tuple[int, ...], bar: Any, *, attention: str = "auto") -> dict[str, Tensor]:
    """Mean sink term (non-sink queries), sink key and value, and attention to the sinks, per
    layer and head, from one attention pass per chunk on the path ``attention`` asks for
    (:func:`~massive_lens.core.attention_pass.choose_path`). The eager path reads the keys and
    values only where the bridge gives them per head (see :mod:`~massive_lens.interventions.access`;
    elsewhere those quantities are NaN); the LSE path reads them from the kernel at every layer."""
    sums = SinkSums()
    reads = eager_reads(model, attn_layers) if view.serves_patterns else None  # nnsight: no eager hooks to probe
    for start, chunk in chunks:
        sinks = mask[start:start + len(chunk)]
        sums.counts += torch.tensor([float((~sinks).sum()), float(sinks.sum())], dtype=torch.float64)
        if attn_layers:
            batch = view.full_batch(chunk)
            cols = sinks.any(0).nonzero().flatten()
            sums.sinks, sums.cols = sinks, cols
            # stop at the last layer's resid_post, which must fire: a bridge that never runs it is refused
            attention_pass(view, batch, sums.take, path=choose_path(view, attention, batch), columns=cols,
                           want=("k", "v"), layers=attn_layers, eager_reads=reads,
                           stop_after=view.hook_name(attn_layers[-1], "resid_post"))
        bar.update()
    return _stacked(view, model, sums.sums, sums.counts, attn_layers)


def eager_reads(model: Any, layers: tuple[int, ...]) -> dict[str, list[int]]:
    """The layers whose eager hooks give the values (``"v"``) and the keys as the scores use them
    (``"k"``: after the rotary embedding) per head, by :func:`~massive_lens.interventions.access.attention_access`'s
    probe: latent attention gives neither per head, and a bridge that rotates inside the Hugging
    Face module never shows the rotated keys."""
    access = attention_access(model)
    values = [layer for layer in layers if access[layer].per_head("v")]
    return {"v": values, "k": [layer for layer in values if access[layer].key_hook is not None]}


class SinkSums:
    """Sums over the calibration text of each layer's sink quantities (``sums[key, layer]``: ``z``,
    ``mass`` over non-sink queries, ``k``, ``v`` over sink keys) and the two counts, taken from each
    :class:`~massive_lens.core.attention_pass.PassLayer` of the chunk whose ``sinks [batch pos]`` and
    sink columns ``cols`` are set."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, int], Tensor] = {}
        self.counts = torch.zeros(2, dtype=torch.float64)  # non-sink queries, sink keys
        self.sinks = torch.zeros(0, 0, dtype=torch.bool)
        self.cols = torch.zeros(0, dtype=torch.long)

    def add(self, key: str, layer: int, value: Tensor) -> None:
        value = value.double().cpu()
        self.sums[key, layer] = self.sums[key, layer] + value if (key, layer) in self.sums else value

    def take(self, at: PassLayer) -> None:
        """One layer: the attention on the sink columns, the keys and values at the sinks (where read)."""
        s = self.sinks.to(at.cols.device)
        p, on, queries = at.cols.double(), s[:, self.cols].double(), (~s).double()  # p [batch head query col]
        self.add("mass", at.layer, torch.einsum("bhqc,bc,bq->h", p, on, queries))
        if at.v is not None:
            v = at.v[:, self.cols.to(at.v.device)].double()  # [batch col kv_head d_head]
            v = v.repeat_interleave(p.shape[1] // v.shape[2], 2)
            self.add("z", at.layer, torch.einsum("bhqc,bc,bchd,bq->hd", p, on, v, queries))
            self.add("v", at.layer, torch.einsum("bkhd,bk->hd", at.v.double(), s.double()))
        if at.k is not None:
            self.add("k", at.layer, torch.einsum("bkhd,bk->hd", at.k.double(), s.double()))


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
