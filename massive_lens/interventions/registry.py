"""One registry of the intervention settings: one row per setting, everything about it in that row.

A row (:class:`InterventionSetting`) names the setting, how to build it (a builder of
:mod:`~massive_lens.interventions.builders` with fixed options, as ``functools.partial`` would
give), what it does, what it acts on, whether it edits massive activations (so needs some in
the calibration text), whether it is a row of the paper's Table 3, and its ``every`` form (the
same edit at every layer where the dims are massive), which
:func:`~massive_lens.run_interventions` adds when the first-layer edit is undone downstream.

Every row builds from a model, a :class:`~massive_lens.interventions.Calibration` and
(optionally) the sinks of the tokens it will run on, so :func:`~massive_lens.run_interventions`,
the report and a user calling the builder evaluate the same thing. Adding a setting is one
row in :data:`ROWS` (see ``docs/interventions.md``); ``tests/test_interventions.py`` walks
the registry and builds every row on a tiny model.

>>> list(SETTINGS)[:3]
['original', 'zero', 'mean']
>>> REGISTRY["zero"].description, REGISTRY["zero"].every
('massive activations set to zero where they appear', 'zero_every')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from massive_lens.core.corpora import default_text
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.assemble import observe
from massive_lens.interventions.builders import (
    ablate_massive,
    bias_surgery,
    fix_sink_term,
    patch_sink_from,
    remove_sink_attention,
)
from massive_lens.interventions.heads import zero_dormant_heads
from massive_lens.interventions.intervention import Intervention
from massive_lens.interventions.sink_scale import scale_sink_attention

RESID, ATTN, NOTHING = "residual stream", "attention", "nothing"


@dataclass(frozen=True, kw_only=True)
class InterventionSetting:
    """One intervention setting: ``build(model, calibration, sinks=None)`` gives its
    :class:`~massive_lens.interventions.Intervention`.

    ``builder`` and ``options``: the builder function and the keyword options it is called
    with; ``takes_sinks``: whether it is passed the sinks of the evaluated tokens;
    ``acts_on``: ``"residual stream"``, ``"attention"`` or ``"nothing"``;
    ``needs_massive``: it edits massive activations; ``in_table3``: a row of the paper's
    Table 3 (the default of :func:`~massive_lens.run_interventions`); ``every``: the name of
    its every-layer form, or None.
    """

    name: str
    builder: Callable[..., Intervention]
    description: str
    acts_on: str
    needs_massive: bool = False
    in_table3: bool = True
    every: str | None = None
    takes_sinks: bool = True
    options: dict[str, Any] = field(default_factory=dict)

    def build(self, model: Any, calibration: Any, sinks: Any = None) -> Intervention:
        """The intervention on ``model`` with this setting's options.

        Args:
            model: a TransformerLens-style model.
            calibration: a :class:`~massive_lens.interventions.Calibration` of ``model``, or
                calibration text.
            sinks: the sink positions of the tokens it will run on (None: found online); used
                only by settings that take sinks.

        Returns:
            The :class:`~massive_lens.interventions.Intervention`, not yet entered.
        """
        extra = {"sinks": sinks} if self.takes_sinks else {}
        return self.builder(model, calibration=calibration, **self.options, **extra)


def _patched_from_default_text(model: Any, *, calibration: Any = None) -> Intervention:
    """``patch_sink_from`` with the first 12 words of the offline default text as the other
    text (the calibration is not used: the patch is the other text's own residual stream)."""
    return patch_sink_from(model, " ".join(default_text().split()[:12]))


Row = InterventionSetting
ROWS: tuple[InterventionSetting, ...] = (
    Row(name="original", builder=observe, description="no intervention", acts_on=NOTHING),
    Row(name="zero", builder=ablate_massive, description="massive activations set to zero where they appear",
        acts_on=RESID, needs_massive=True, every="zero_every", takes_sinks=False, options=dict(mode="zero")),
    Row(name="mean", builder=ablate_massive, description="massive activations set to their calibration mean",
        acts_on=RESID, needs_massive=True, every="mean_every", takes_sinks=False, options=dict(mode="mean")),
    Row(name="resample", builder=ablate_massive,
        description="massive activations set to a calibration value of the same dim, layer and token kind",
        acts_on=RESID, needs_massive=True, every="resample_every", options=dict(mode="resample")),
    Row(name="noise", builder=ablate_massive,
        description="massive activations set to Gaussian noise with their calibration mean and variance",
        acts_on=RESID, needs_massive=True, every="noise_every", takes_sinks=False, options=dict(mode="noise")),
    Row(name="template", builder=ablate_massive,
        description="massive activations zeroed; every later norm's output there set to the calibrated "
        "post-norm vector", acts_on=RESID, needs_massive=True, takes_sinks=False, options=dict(mode="template")),
    Row(name="control", builder=ablate_massive, description="as many median-magnitude activations set to zero",
        acts_on=RESID, needs_massive=True, takes_sinks=False, options=dict(mode="zero", control=True)),
    Row(name="sink_term_mean", builder=fix_sink_term,
        description="each head's sink term replaced by its calibration mean", acts_on=ATTN,
        options=dict(mode="mean")),
    Row(name="sink_term_zero", builder=fix_sink_term, description="each head's sink term set to zero",
        acts_on=ATTN, options=dict(mode="zero")),
    Row(name="sink_attention_removed", builder=remove_sink_attention,
        description="attention to sink positions dropped, renormalized", acts_on=ATTN),
    Row(name="bias_surgery", builder=bias_surgery,
        description="explicit per-head k/v bias slot; sinks masked; massive activations zeroed", acts_on=ATTN,
        needs_massive=True, every="bias_surgery_every"),
    Row(name="zero_every", builder=ablate_massive,
        description="massive activations set to zero at every layer where they are massive", acts_on=RESID,
        needs_massive=True, in_table3=False, takes_sinks=False, options=dict(mode="zero", where="every")),
    Row(name="mean_every", builder=ablate_massive,
        description="massive activations set to their calibration mean at every layer where they are massive",
        acts_on=RESID, needs_massive=True, in_table3=False, takes_sinks=False,
        options=dict(mode="mean", where="every")),
    Row(name="resample_every", builder=ablate_massive,
        description="massive activations set to a calibration value of the same dim, layer and token kind at "
        "every layer where they are massive", acts_on=RESID, needs_massive=True, in_table3=False,
        options=dict(mode="resample", where="every")),
    Row(name="noise_every", builder=ablate_massive,
        description="massive activations set to Gaussian noise with their calibration mean and variance at every "
        "layer where they are massive", acts_on=RESID, needs_massive=True, in_table3=False, takes_sinks=False,
        options=dict(mode="noise", where="every")),
    Row(name="bias_surgery_every", builder=bias_surgery,
        description="explicit per-head k/v bias slot; sinks masked; massive activations zeroed at every layer "
        "where they are massive", acts_on=ATTN, needs_massive=True, in_table3=False, options=dict(where="every")),
    Row(name="sink_patched", builder=_patched_from_default_text,
        description="residual stream at the sink positions patched from another text", acts_on=RESID,
        needs_massive=False, in_table3=False, takes_sinks=False),
    Row(name="zero_dormant_heads", builder=zero_dormant_heads,
        description="outputs of the 4% most dormant heads (found on the default text) set to zero", acts_on=ATTN,
        needs_massive=False, in_table3=False, takes_sinks=False, options=dict(share=0.04)),
    Row(name="sink_attention_scaled", builder=scale_sink_attention,
        description="every head's attention to the first token halved, rows renormalised (ZeroTuning, γ = 0.5)",
        acts_on=ATTN, needs_massive=False, in_table3=False, takes_sinks=False, options=dict(gamma=0.5)),
)
REGISTRY: dict[str, InterventionSetting] = {}
EVERY: dict[str, str] = {}  # first-layer form -> every form


def register(row: InterventionSetting, *, replace: bool = False) -> InterventionSetting:
    """Add a setting (what :data:`ROWS` does for the built-in ones): it can then be named in
    ``run_interventions(settings=[...])`` and the report. A name already taken by a different
    setting is a :class:`~massive_lens.MassiveLensError` unless ``replace=True``; registering
    an equal row again (a notebook cell run twice) changes nothing.

    Args:
        row: the setting.
        replace: replace a different setting of the same name.

    Returns:
        ``row``, now in :data:`REGISTRY` (and its ``every`` form in :data:`EVERY`).

    Raises:
        MassiveLensError: if a different setting already has the name and ``replace`` is False.

    >>> from massive_lens.interventions import remove_sink_attention
    >>> row = register(InterventionSetting(name="sink_attention_dropped", builder=remove_sink_attention,
    ...                description="attention to sink positions dropped, not renormalized", acts_on=ATTN,
    ...                in_table3=False, options=dict(renormalize=False)))
    >>> REGISTRY["sink_attention_dropped"].options
    {'renormalize': False}
    """
    taken = REGISTRY.get(row.name)
    if taken is not None and taken != row and not replace:
        raise MassiveLensError(f"register: an intervention setting named {row.name!r} is already registered "
                               f"({taken.description!r}); give the new setting another name, or pass "
                               "replace=True to replace it")
    REGISTRY[row.name] = row
    EVERY.pop(row.name, None)
    if row.every:
        EVERY[row.name] = row.every
    Intervention.descriptions[row.name] = row.description  # what iv.description reads
    return row


for _row in ROWS:
    register(_row)
SETTINGS: tuple[str, ...] = tuple(row.name for row in ROWS if row.in_table3)
