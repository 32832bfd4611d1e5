"""Interventions that check themselves: what the targets hold downstream, with and without.

An intervention is a claim about the forward pass ("the massive activations are gone", "no
attention reaches the sinks"), and a model can undo it: zero a massive activation at the
layer where it first appears and a later MLP may write it back within a few layers, so a
perplexity that barely moves would be read as "massive activations do not matter" when
they were never removed. Every :class:`~massive_lens.interventions.Intervention` therefore
records, on the text it runs on, in a :class:`Record`:

- for massive-activation edits: each calibrated massive dim's mean ``|value|`` at the
  positions it targeted (where the dim was massive at its first layer), at every later
  layer, read after the intervention's own edit at that layer (what the layers above see);
- for sink interventions: the attention the non-sink queries still pay to the sinks, per
  layer (after the intervention's own edit of the pattern), and the positions it treated as
  sinks.

:func:`downstream` sets that against the same record of the untouched model;
:func:`reading` turns it into the table's columns and a one-line verdict, e.g. "zero (first
layer): dim 5 back to 95% of its value by layer 2; the model rebuilds it". A removal counts
as undone when a target gets back to at least ``REBUILT`` of its untouched value at a later
layer where it is massive in calibration.

>>> rec = Record(); rec.add_values(3, [7], torch.tensor([50.0]), torch.tensor([1.0]))
>>> rec.frame().to_dict("records")
[{'kind': 'massive', 'dim': 7, 'layer': 3, 'value': 50.0}]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.fmt import pct

REBUILT = 0.5  # a removed target that gets back to >= half its untouched |value| later was rebuilt


class Record:
    """What one intervention (or the untouched model) measured over its forward passes.

    ``values[(dim, layer)]`` and ``mass[layer]``/``slot[layer]`` hold ``[sum, count]``;
    ``sinks`` and ``targets`` the ``[batch pos]`` masks of each forward pass (the positions
    treated as sinks, and those whose massive entries were targeted).
    """

    def __init__(self) -> None:
        self.values: dict[tuple[int, int], list[float]] = {}
        self.mass: dict[int, list[float]] = {}
        self.slot: dict[int, list[float]] = {}
        self.sinks: list[Tensor] = []
        self.targets: list[Tensor] = []
        self.edited: dict[int, int] = {}  # dim -> residual entries an edit set (what the summaries say was edited)

    def add_values(self, layer: int, dims: Sequence[int], sums: Tensor, counts: Tensor) -> None:
        """Add ``|value|`` sums and counts of ``dims`` at ``layer``."""
        for dim, total, n in zip(dims, sums.tolist(), counts.tolist(), strict=True):
            if n:
                acc = self.values.setdefault((int(dim), layer), [0.0, 0.0])
                acc[0] += total
                acc[1] += n

    def add_mass(self, table: dict[int, list[float]], layer: int, total: float, n: float) -> None:
        """Add an attention-mass sum and count at ``layer`` to ``table`` (``mass`` or ``slot``)."""
        acc = table.setdefault(layer, [0.0, 0.0])
        acc[0] += total
        acc[1] += n

    def merge(self, other: Record) -> None:
        """Add ``other``'s measurements to this record."""
        for (dim, layer), (total, n) in other.values.items():
            self.add_values(layer, [dim], torch.tensor([total]), torch.tensor([n]))
        for mine, theirs in ((self.mass, other.mass), (self.slot, other.slot)):
            for layer, (total, n) in theirs.items():
                self.add_mass(mine, layer, total, n)
        self.sinks += other.sinks
        self.targets += other.targets
        for dim, n in other.edited.items():
            self.edited[dim] = self.edited.get(dim, 0) + n

    def clear(self) -> None:
        """Forget everything measured so far."""
        self.__init__()

    def frame(self) -> pd.DataFrame:
        """Long table: ``kind`` (``massive``, ``sink_mass``, ``slot_mass``), ``dim`` (-1 for
        attention), ``layer``, ``value`` (the mean)."""
        rows = [("massive", dim, layer, total / n) for (dim, layer), (total, n) in sorted(self.values.items())]
        for kind, table in (("sink_mass", self.mass), ("slot_mass", self.slot)):
            rows += [(kind, -1, layer, total / max(n, 1)) for layer, (total, n) in sorted(table.items())]
        return pd.DataFrame(rows, columns=["kind", "dim", "layer", "value"])


DOWNSTREAM_COLUMNS = ["kind", "dim", "layer", "without", "with", "kept"]


def downstream(without: Record, with_: Record) -> pd.DataFrame:
    """Per target and layer, the untouched value, the value under the intervention, and
    ``kept`` = with / without. Columns: ``kind``, ``dim``, ``layer``, ``without``, ``with``,
    ``kept``.

    >>> a, b = Record(), Record()
    >>> a.add_values(2, [5], torch.tensor([100.0]), torch.tensor([1.0]))
    >>> b.add_values(2, [5], torch.tensor([95.0]), torch.tensor([1.0]))
    >>> downstream(a, b)["kept"].tolist()
    [0.95]
    """
    base, mine = without.frame(), with_.frame()
    if base.empty or mine.empty:
        return pd.DataFrame(columns=DOWNSTREAM_COLUMNS)
    frame = base.merge(mine, on=["kind", "dim", "layer"], suffixes=("_without", "_with"))
    frame = frame.rename(columns={"value_without": "without", "value_with": "with"})
    frame["kept"] = frame["with"] / frame["without"].where(frame["without"] != 0)
    return frame[DOWNSTREAM_COLUMNS].reset_index(drop=True)


def reading(checks: pd.DataFrame, *, label: str, first_layer: dict[int, int], massive_layers: dict[int, set[int]],
            removes: bool, edits_massive: bool, uses_sinks: bool) -> dict[str, Any]:
    """The table's check columns for one setting, and its one-line verdict (``check``).

    ``first_layer[dim]``: the layer where the dim is first massive (in calibration), where
    ``first`` edits it; ``massive_layers[dim]``: every layer where it is massive in
    calibration. The *later layers* of a dim are those after its first layer where it is
    massive; its *peak layer* is where its untouched value is largest among them (its first
    layer when there are none). A removal (``removes``) was undone when a dim gets back to
    ``REBUILT`` of its untouched value at a later layer. A removal's verdict also names any
    layer *after* a dim's massive layers where it is back to ``REBUILT`` of its untouched
    value there (no longer a massive activation, so not flagged).
    """
    out: dict[str, Any] = dict(target_kept=math.nan, peak_layer=math.nan, target_back=math.nan,
                               back_layer=math.nan, sink_mass=math.nan, sink_mass_original=math.nan,
                               rebuilt=False)
    parts = []
    massive = checks[checks["kind"] == "massive"] if len(checks) else checks
    if edits_massive and len(massive):
        per_dim, beyond = [], []
        for dim, rows in massive.groupby("dim"):
            rows = rows.dropna(subset=["kept"])
            if rows.empty:
                continue
            later = rows[(rows["layer"] > first_layer.get(int(dim), -1))
                         & rows["layer"].isin(massive_layers.get(int(dim), set()))]
            peak = (later if len(later) else rows).loc[lambda f: f["without"].idxmax()]
            back = later.loc[later["kept"].idxmax()] if len(later) else None
            tail = rows[(rows["layer"] > max(massive_layers.get(int(dim), {-1}))) & (rows["kept"] >= REBUILT)]
            if len(tail):  # after the layers where it is massive: not a rebuilt massive activation, but say so
                beyond.append(f"dim {int(dim)} at {pct(float(tail['kept'].iloc[0]))} of its untouched value at "
                              f"layer {int(tail['layer'].iloc[0])}")
            per_dim.append((int(dim), float(peak["kept"]), int(peak["layer"]),
                            float(back["kept"]) if back is not None else math.nan,
                            int(back["layer"]) if back is not None else -1))
        if per_dim:
            worst_peak = max(per_dim, key=lambda r: r[1])
            with_back = [r for r in per_dim if not math.isnan(r[3])]
            worst_back = max(with_back, key=lambda r: r[3]) if with_back else None
            out.update(target_kept=worst_peak[1], peak_layer=worst_peak[2])
            if worst_back is not None:
                out.update(target_back=worst_back[3], back_layer=worst_back[4])
            rebuilt = [r for r in with_back if r[3] >= REBUILT]
            one = len(per_dim) == 1
            dims = ("dim " if one else "dims ") + ", ".join(str(r[0]) for r in per_dim)
            its, was = ("its", "it was") if one else ("their", "they were")
            if removes and rebuilt:
                out["rebuilt"] = True
                parts.append("; ".join(f"dim {d} back to {pct(b)} of its value by layer {layer}"
                                       for d, _, _, b, layer in rebuilt) + "; the model rebuilds it")
            elif removes:
                later_text = f"at most {pct(worst_back[3])} of {its} value at the later layers where {was} " \
                             "massive, " if worst_back is not None else ""
                parts.append(f"removed downstream: {dims} {later_text}{pct(worst_peak[1])} at the peak "
                             f"layer {worst_peak[2]}")
            else:
                parts.append(f"{dims} at {pct(worst_peak[1])} of {its} untouched value at the peak layer "
                             f"{worst_peak[2]}")
            if removes and beyond:
                parts.append("after the layers where it is massive, " + ", ".join(beyond))
    elif edits_massive:
        parts.append("no targeted massive activation in the evaluation text")
    if uses_sinks:
        mass = checks[checks["kind"] == "sink_mass"] if len(checks) else checks
        if len(mass):
            out.update(sink_mass=float(mass["with"].mean()), sink_mass_original=float(mass["without"].mean()))
            parts.append(f"attention to the sinks {out['sink_mass']:.2f} (untouched {out['sink_mass_original']:.2f})")
    out["check"] = f"{label}: " + ("; ".join(parts) if parts else "nothing to check")
    return out
