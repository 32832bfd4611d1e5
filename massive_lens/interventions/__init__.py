"""Causal tests of the claim that massive activations and attention sinks act as a fixed bias.

Every intervention is an :class:`Intervention`: a context manager (``with fix_sink_term(m):``)
that is also a hook list (``perplexity(model, hooks=iv)``), and records what its targets hold
downstream (``iv.record``, ``iv.check(text)``). :func:`calibrate` measures what the
interventions need on calibration text; :data:`REGISTRY` names the settings of the paper's
Table 3 (and their ``_every`` variants), which :func:`~massive_lens.run_interventions`
evaluates and checks.

>>> from massive_lens import tiny_model
>>> from massive_lens.interventions import remove_sink_attention
>>> remove_sink_attention(tiny_model("llama"), calibration="Some text. " * 20).name
'sink_attention_removed'
"""

from massive_lens.interventions.assemble import observe
from massive_lens.interventions.builders import (
    ablate_massive,
    bias_surgery,
    fix_sink_term,
    patch_sink_from,
    remove_sink_attention,
)
from massive_lens.interventions.calibration import calibrate
from massive_lens.interventions.calibration_result import Calibration
from massive_lens.interventions.checks import REBUILT
from massive_lens.interventions.dependence import SinkDependence, sink_dependence
from massive_lens.interventions.head_curve import HeadCurve, head_curve
from massive_lens.interventions.heads import zero_dormant_heads
from massive_lens.interventions.intervention import Intervention
from massive_lens.interventions.plant import (
    force_self_attention,
    planted_writers,
    shift_rotary_position,
    sink_strength,
)
from massive_lens.interventions.registry import EVERY, REGISTRY, SETTINGS, InterventionSetting, register
from massive_lens.interventions.sink_scale import scale_sink_attention
from massive_lens.interventions.sink_sweep import SinkScaleSweep, sink_scale_sweep
from massive_lens.interventions.table import InterventionTable, run_interventions

__all__ = [
    "EVERY", "REBUILT", "REGISTRY", "SETTINGS", "Calibration", "HeadCurve", "Intervention", "InterventionSetting",
    "InterventionTable", "SinkDependence", "SinkScaleSweep", "ablate_massive", "bias_surgery", "calibrate",
    "fix_sink_term", "force_self_attention", "head_curve", "observe", "patch_sink_from", "planted_writers", "register",
    "remove_sink_attention", "run_interventions", "scale_sink_attention", "shift_rotary_position", "sink_dependence",
    "sink_scale_sweep", "sink_strength", "zero_dormant_heads",
]
