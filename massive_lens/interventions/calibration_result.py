"""The result of :func:`~massive_lens.interventions.calibration.calibrate`: what the interventions
need to know about a model's massive activations and sinks (:class:`Calibration`), and what reads
it during an intervention on new text (:func:`online_sinks`, :func:`massive_entries`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.attention.sinks import LEVEL, SinkSet
from massive_lens.core.charts import sink_mass_axes
from massive_lens.core.criterion import Criterion, SinkRule, massive_mask
from massive_lens.core.fmt import num
from massive_lens.core.outliers import token_specific
from massive_lens.core.results import Result
from massive_lens.interventions.arm_stats import empty_pool


def _long() -> Tensor:
    return torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True, kw_only=True)
class Calibration(Result):
    """What the interventions need to know about a model, measured on calibration text.

    ``dims[layer]``: massive dims whose first massive layer is ``layer``; ``means[layer]``:
    their mean value at massive entries there; ``dims_at[layer]``/``means_at[layer]``: every
    dim massive at ``layer`` (any position) and its mean there (what ``where="every"`` edits);
    ``sinks``: the calibration sinks (:class:`~massive_lens.attention.SinkSet`, found by
    ``rule``); ``attn_layers``: the layers after the sinks first carry a massive activation
    (all layers when they carry none), where the sink interventions act; ``sink_z [layer
    head d_head]``: each head's mean sink term over non-sink query positions;
    ``sink_k``/``sink_v [layer kv_head d_head]``: mean key (post-RoPE) and value at the sinks;
    ``sink_mass [layer head]``. The online sink rule: ``sink_first`` (the first token is a
    sink), ``sink_dims``/``sink_gate`` at ``sink_layer`` (later positions; -1: none), and
    ``online_missed``/``online_extra``: sink positions of the calibration text it misses or
    adds, compared with the full rule (None: not measured). ``outlier_dims``: dims that are outlier dimensions
    (massive at most tokens of a layer) somewhere in the calibration text; whether their
    entries are among ``dims`` and edited is ``criterion.outliers`` (``"exclude"`` by
    default: the interventions never target them). They never make a position a sink.

    ``model_name`` and ``d_model``: the model it was measured on; every consumer refuses a
    Calibration of another model (``""`` and 0 in one saved before they were kept: sizes only).
    The arms' (:mod:`~massive_lens.interventions.arm_stats`): ``vars_at`` (variances beside ``means_at``),
    ``pool`` (token-specific massive entries: layer, seq, kind, dim, value), ``template [layer+1 norm
    d_model]`` (post-norm vectors of spike-carrying tokens; ``template_seen``: where measured); empty in
    an older save (the arms refuse it).

    ``to_frame()``: one row per fact, ``kind`` (``massive_mean``: ``layer``, ``dim``,
    ``value`` at the first massive layer; ``massive_mean_at``: the same at every massive
    layer; ``sink_mass``: ``layer``, ``head``, ``value``).
    """

    source: str
    dims: dict[int, Tensor]
    means: dict[int, Tensor]
    attn_layers: tuple[int, ...]
    sink_z: Float[Tensor, "layer head_index d_head"]
    sink_k: Float[Tensor, "layer kv_head d_head"]
    sink_v: Float[Tensor, "layer kv_head d_head"]
    sink_mass: Float[Tensor, "layer head_index"]
    criterion: Criterion
    n_seqs: int
    dims_at: dict[int, Tensor] = field(default_factory=dict)
    means_at: dict[int, Tensor] = field(default_factory=dict)
    sinks: SinkSet | None = None
    rule: SinkRule = field(default_factory=SinkRule)
    sink_first: bool = True
    sink_dims: Tensor = field(default_factory=_long)
    sink_gate: Tensor = field(default_factory=lambda: torch.zeros(0))
    sink_layer: int = -1
    online_missed: int | None = None  # None: not measured (a Calibration built without the online rule's check)
    online_extra: int | None = None
    outlier_dims: Tensor = field(default_factory=_long)
    model_name: str = ""
    d_model: int = 0
    vars_at: dict[int, Tensor] = field(default_factory=dict)
    pool: Tensor = field(default_factory=empty_pool)
    template: Tensor = field(default_factory=lambda: torch.zeros(0))
    template_seen: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    @property
    def detect_layer(self) -> int | None:
        """The first layer where a massive activation appears (None: none in the text)."""
        return min(self.dims) if self.dims else None

    @property
    def first_layer(self) -> dict[int, int]:
        """Each massive dim -> the layer where it is first massive."""
        return {int(d): layer for layer, dims in self.dims.items() for d in dims.tolist()}

    @property
    def massive_layers(self) -> dict[int, set[int]]:
        """Each massive dim -> every layer where it is massive in calibration."""
        out: dict[int, set[int]] = {}
        for layer, dims in self.dims_at.items():
            for d in dims.tolist():
                out.setdefault(int(d), set()).add(layer)
        return out

    def online_rule(self) -> str:
        """The rule an intervention without ``sinks=`` uses to find sinks during its pass."""
        parts = ["the first token"] if self.sink_first else []
        if self.sink_layer >= 0:
            parts.append(f"later positions where dim(s) {', '.join(map(str, self.sink_dims.tolist()))} are massive "
                         f"at layer {self.sink_layer} (above {', '.join(num(g) for g in self.sink_gate.tolist())})")
        return " and ".join(parts) or "the first token"

    def outlier_text(self) -> str:
        """The outlier dimensions, for people: ``dim 7`` or ``dims 7, 40 and 3 more``."""
        dims = self.outlier_dims.tolist()
        more = f" and {len(dims) - 6} more" if len(dims) > 6 else ""
        return ("dim " if len(dims) == 1 else "dims ") + ", ".join(map(str, dims[:6])) + more

    def to_frame(self) -> pd.DataFrame:
        rows = [("massive_mean", layer, dim, -1, float(mean))
                for layer, dims in sorted(self.dims.items())
                for dim, mean in zip(dims.tolist(), self.means[layer].tolist(), strict=True)]
        rows += [("massive_mean_at", layer, dim, -1, float(mean))
                 for layer, dims in sorted(self.dims_at.items())
                 for dim, mean in zip(dims.tolist(), self.means_at[layer].tolist(), strict=True)]
        rows += [("sink_mass", layer, -1, head, float(self.sink_mass[layer, head]))
                 for layer in self.attn_layers for head in range(self.sink_mass.shape[1])]
        return pd.DataFrame(rows, columns=["kind", "layer", "dim", "head", "value"])

    def summary(self) -> str:
        if not self.dims:
            found = "no massive activations"
        else:
            found = "massive dims " + "; ".join(
                f"{', '.join(map(str, dims.tolist()))} from layer {layer} (mean "
                f"{', '.join(num(m) for m in self.means[layer].tolist())})"
                for layer, dims in sorted(self.dims.items()))
        mass = float(self.sink_mass[list(self.attn_layers)].mean()) if self.attn_layers else float("nan")
        sinks = self.sinks.describe() if self.sinks is not None else "?"
        if len(self.outlier_dims):
            how = "excluded from" if self.criterion.outliers == "exclude" else "included in"
            kept = sorted(set(self.outlier_dims.tolist()) & set(self.first_layer))
            part = (f" (dim(s) {', '.join(map(str, kept))} kept at the layers where their entries are token-specific)"
                    if kept and self.criterion.outliers == "exclude" else "")
            found += (f"; outlier dimensions (massive at most tokens of a layer) {self.outlier_text()}, {how} "
                      f"the massive dims{part}")
        return (f"calibration on {self.source} ({self.n_seqs} sequences, {self.criterion}): {found}; sinks "
                f"(positions that draw attention as sinks or carry persistent massive activations; {LEVEL}) {sinks}; "
                f"mean attention to the sinks after them {mass:.2f}. Online sink rule (interventions without "
                f"sinks=): {self.online_rule()}; " + (
                    "its misses on this text not measured" if self.online_missed is None or self.online_extra is None
                    else f"on this text it misses {self.online_missed} and adds {self.online_extra} sink positions"))

    def plot(self, ax: Any = None) -> Any:
        """Mean attention of non-sink queries to the sinks, per layer (range over heads)."""
        frame = self.to_frame()
        frame = frame[frame.kind == "sink_mass"].rename(columns={"value": "sink_mass"})
        return sink_mass_axes(frame.assign(first_token_mass=float("nan")), ax=ax,
                              title=f"calibration: attention to sinks ({self.source})")


def online_sinks(resid: Float[Tensor, "batch pos d_model"], calib: Calibration) -> Bool[Tensor, "batch pos"]:
    """Later positions (not the first) that the online rule calls sinks at ``calib.sink_layer``."""
    dims = calib.sink_dims.to(resid.device)
    values = resid[..., dims].abs()
    hits = token_specific(massive_mask(resid, calib.criterion))[..., dims] & (values >= calib.sink_gate.to(values))
    found = hits.any(-1)
    found[:, 0] = False
    return found


def massive_entries(resid: Float[Tensor, "batch pos d_model"], dims: Tensor, criterion: Criterion) -> Tensor:
    """Bool [batch pos n_dims]: which calibrated dims are massive at which positions."""
    return massive_mask(resid, criterion)[..., dims.to(resid.device)]
