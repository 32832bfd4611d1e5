"""Per-forward scratch shared by the hooks of one intervention, and the sinks it is given.

>>> state = HookState(sinks=[0])
>>> state.mask(1, 3, torch.device("cpu")).tolist()
[[True, False, False]]
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from massive_lens.attention.sinks import Sinks, SinkSet
from massive_lens.core.pass_reader import PassReader
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.calibration_result import Calibration
from massive_lens.interventions.checks import Record


class HookState:
    """Per-forward scratch shared by the hooks of one intervention: the sinks (given, or found
    online), the positions each massive dim targets, the current layer's pattern, values and
    queries, the :class:`~massive_lens.interventions.checks.Record` of what it measured, and the
    attention pass's ``reading`` that records the attention on the sinks (None: not recorded)."""

    def __init__(self, calib: Calibration | None = None, sinks: Sinks = None):
        self.calib = calib
        self.given = given_sinks(sinks)
        self.sinks: Tensor | None = None  # found online in this forward pass (later positions)
        self.targets: Tensor | None = None  # [batch pos n_dims] where each dim was massive at its first layer
        self.stash: dict[str, Tensor] = {}
        self.record = Record()
        self.reading: PassReader | None = None
        self.passes = 0  # forward passes with its hooks so far (reset() starts one)

    def reset(self) -> None:
        self.sinks, self.targets = None, None
        self.passes += 1
        self.stash.clear()

    def reading_context(self) -> contextlib.AbstractContextManager:
        """What a forward run with these hooks needs around it for the attention record: the
        reading (on the LSE path the fused kernel runs there), else nothing."""
        return self.reading if self.reading is not None else contextlib.nullcontext()

    def sink_columns(self, layer: int, batch: int, pos: int) -> Tensor:
        """The key columns of the current forward's sinks (any sequence's): what the attention pass
        reads at ``layer`` for the record (none in a pass its hooks do not run in, such as the
        perplexity's check of its output head, which the fused kernel reads too)."""
        if not self.passes:
            return torch.zeros(0, dtype=torch.long)
        return self.mask(batch, pos, torch.device("cpu")).any(0).nonzero().flatten()

    def mask(self, batch: int, pos: int, device: torch.device) -> Bool[Tensor, "batch pos"]:
        """The sinks of the current forward pass (a sequence with none: its first token)."""
        if isinstance(self.given, Tensor):
            if tuple(self.given.shape) != (batch, pos):
                raise MassiveLensError(
                    f"sinks= was given for {list(self.given.shape)} [batch, pos] but the model runs on "
                    f"{[batch, pos]}; pass the sinks of these tokens, a list of positions, or none (found online)")
            found = self.given.to(device)
        else:
            found = torch.zeros(batch, pos, dtype=torch.bool, device=device)
            if self.given is not None:
                found[:, [p for p in self.given if p < pos]] = True
            else:
                found[:, 0] = self.calib.sink_first if self.calib is not None else True
                if self.sinks is not None and tuple(self.sinks.shape) == (batch, pos):
                    found |= self.sinks.to(device)
        none = ~found.any(-1)
        if bool(none.any()):
            found = found.clone()
            found[none, 0] = True
        return found


def given_sinks(sinks: Sinks) -> Tensor | list[int] | None:
    if sinks is None:
        return None
    if isinstance(sinks, SinkSet):
        sinks = sinks.mask
    if isinstance(sinks, Tensor):
        if sinks.dtype != torch.bool or sinks.ndim != 2:
            raise MassiveLensError(f"sinks= as a tensor must be a bool [batch, pos] mask, got {sinks.dtype} "
                                   f"{list(sinks.shape)}; or pass a list of positions")
        return sinks.cpu()
    positions = [int(p) for p in sinks]
    if not positions or min(positions) < 0:
        raise MassiveLensError(f"sinks= positions must be a non-empty list of positions >= 0, got {positions}")
    return positions


def stash(act: Tensor, hook: Any, *, state: HookState, key: str) -> None:
    """Keep ``act`` in ``state.stash[key]`` for a later hook of the same pass."""
    state.stash[key] = act
