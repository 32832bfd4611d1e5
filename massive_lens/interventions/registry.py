"""One registry of the Table 3 settings: name -> what it does and how to build it.

Every setting is built from a model and a :class:`~massive_lens.interventions.Calibration`,
so :func:`~massive_lens.run_interventions` and the report evaluate the same thing.

>>> list(SETTINGS)[:3]
['original', 'zero', 'mean']
>>> REGISTRY["zero"].description
'massive activations set to zero where they appear'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from massive_lens.interventions.builders import (
    DESCRIPTIONS,
    ablate_massive,
    bias_surgery,
    fix_sink_term,
    remove_sink_attention,
)
from massive_lens.interventions.calibration import Calibration


@dataclass(frozen=True)
class Setting:
    """A named intervention of Table 3: ``build(model, calibration)`` gives its hooks."""

    name: str
    build: Callable[[Any, Calibration], Any]

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.name]

    @property
    def needs_massive(self) -> bool:
        """Whether it edits massive activations (so needs some in the calibration text)."""
        return self.name in MASSIVE_SETTINGS


_BUILDERS: dict[str, Callable[[Any, Calibration], Any]] = {
    "original": lambda model, calib: (),
    "zero": lambda model, calib: ablate_massive(model, "zero", calibration=calib),
    "mean": lambda model, calib: ablate_massive(model, "mean", calibration=calib),
    "control": lambda model, calib: ablate_massive(model, "zero", calibration=calib, control=True),
    "sink_term_mean": lambda model, calib: fix_sink_term(model, "mean", calibration=calib),
    "sink_term_zero": lambda model, calib: fix_sink_term(model, "zero", calibration=calib),
    "sink_attention_removed": lambda model, calib: remove_sink_attention(model, calibration=calib),
    "bias_surgery": lambda model, calib: bias_surgery(model, calibration=calib),
}
REGISTRY: dict[str, Setting] = {name: Setting(name, build) for name, build in _BUILDERS.items()}
SETTINGS: tuple[str, ...] = tuple(REGISTRY)
MASSIVE_SETTINGS = ("zero", "mean", "control", "bias_surgery")
