"""One registry of the Table 3 settings: name -> what it does and how to build it.

Every setting is built from a model, a :class:`~massive_lens.interventions.Calibration` and
(optionally) the sinks of the tokens it will run on, so :func:`~massive_lens.run_interventions`
and the report evaluate the same thing. :data:`SETTINGS` are the rows of the paper's Table 3
(the default); :data:`REGISTRY` also holds the ``_every`` variants, which
:func:`~massive_lens.run_interventions` adds when a first-layer removal does not hold
(:data:`EVERY`), and ``original`` builds :func:`~massive_lens.interventions.observe`, which
edits nothing and measures the baseline of every check.

>>> list(SETTINGS)[:3]
['original', 'zero', 'mean']
>>> REGISTRY["zero"].description
'massive activations set to zero where they appear'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from massive_lens.interventions.assemble import observe
from massive_lens.interventions.builders import ablate_massive, bias_surgery, fix_sink_term, remove_sink_attention
from massive_lens.interventions.intervention import DESCRIPTIONS


@dataclass(frozen=True)
class Setting:
    """A named intervention of Table 3: ``build(model, calibration, sinks=None)`` gives its
    :class:`~massive_lens.interventions.Intervention`."""

    name: str
    build: Callable[..., Any]

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.name]

    @property
    def needs_massive(self) -> bool:
        """Whether it edits massive activations (so needs some in the calibration text)."""
        return self.name in MASSIVE_SETTINGS


_BUILDERS: dict[str, Callable[..., Any]] = {
    "original": lambda model, calib, sinks=None: observe(model, calibration=calib, sinks=sinks),
    "zero": lambda model, calib, sinks=None: ablate_massive(model, "zero", calibration=calib),
    "mean": lambda model, calib, sinks=None: ablate_massive(model, "mean", calibration=calib),
    "control": lambda model, calib, sinks=None: ablate_massive(model, "zero", calibration=calib, control=True),
    "sink_term_mean": lambda model, calib, sinks=None: fix_sink_term(model, "mean", calibration=calib, sinks=sinks),
    "sink_term_zero": lambda model, calib, sinks=None: fix_sink_term(model, "zero", calibration=calib, sinks=sinks),
    "sink_attention_removed": lambda model, calib, sinks=None: remove_sink_attention(model, calibration=calib,
                                                                                     sinks=sinks),
    "bias_surgery": lambda model, calib, sinks=None: bias_surgery(model, calibration=calib, sinks=sinks),
    "zero_every": lambda model, calib, sinks=None: ablate_massive(model, "zero", calibration=calib, where="every"),
    "mean_every": lambda model, calib, sinks=None: ablate_massive(model, "mean", calibration=calib, where="every"),
    "bias_surgery_every": lambda model, calib, sinks=None: bias_surgery(model, calibration=calib, where="every",
                                                                       sinks=sinks),
}
REGISTRY: dict[str, Setting] = {name: Setting(name, build) for name, build in _BUILDERS.items()}
SETTINGS: tuple[str, ...] = ("original", "zero", "mean", "control", "sink_term_mean", "sink_term_zero",
                             "sink_attention_removed", "bias_surgery")
EVERY = {"zero": "zero_every", "mean": "mean_every", "bias_surgery": "bias_surgery_every"}  # first -> every
MASSIVE_SETTINGS = ("zero", "mean", "control", "bias_surgery", "zero_every", "mean_every", "bias_surgery_every")
