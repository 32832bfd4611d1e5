"""A default value is never shown as a measurement (issue 48).

``quant.quantize`` on a model whose residual readers it could not find reported ``max_abs``,
``kurtosis`` and ``top1_median`` as 0.0: the accumulators' starting values, never measured. The
rule: a field of a result that stands for something measured has no numeric default, or its
default is NaN / None ("not measured", and the summary says so); a numeric default is allowed
only for a setting of the analysis (a threshold, a window) or a sentinel no measurement can take
(-1 for a layer or a count, 0 for a width), each named below with why.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import warnings

import pytest
import torch

import massive_lens
from massive_lens import tiny_model
from massive_lens.core.results import Result

# (class, field) -> why its numeric default is not a measurement
ALLOWED = {
    ("SinkCensus", "min_layers"): "a setting: the layers a primary sink must span",
    ("SinkCircuit", "threshold"): "a setting: the sink rule's attention threshold",
    ("TrainingStability", "window"): "a setting of the spike rule",
    ("TrainingStability", "loss_factor"): "a setting of the spike rule",
    ("TrainingStability", "grad_factor"): "a setting of the spike rule",
    ("TrainingStability", "around"): "a setting of the spike rule",
    ("StreamingWindow", "predicted_k"): "-1: not run (no k is negative; the summary prints it only when >= 0)",
    ("Calibration", "sink_layer"): "-1: no later sink layer (no layer is negative; online_rule checks >= 0)",
    ("Calibration", "d_model"): "0: unknown (no model has width 0; the consumers' check skips it)",
}


def result_classes() -> list[type]:
    for info in pkgutil.walk_packages(massive_lens.__path__, "massive_lens."):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional dependency missing: its results cannot be built either
                continue
    found, todo = set(), [Result]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted((c for c in found if dataclasses.is_dataclass(c) and c.__module__.startswith("massive_lens")),
                  key=lambda c: (c.__module__, c.__name__))


def numeric_defaults(cls: type) -> list[str]:
    """The fields of ``cls`` whose default is a number that is not NaN and not allowed above."""
    wrong = []
    for f in dataclasses.fields(cls):
        value = f.default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        if (cls.__name__, f.name) not in ALLOWED:
            wrong.append(f"{cls.__name__}.{f.name} = {value!r}")
    return wrong


def test_no_result_field_defaults_to_a_number_that_reads_as_a_measurement():
    classes = result_classes()
    assert len(classes) > 20  # the walk found the package's results
    wrong = [w for cls in classes for w in numeric_defaults(cls)]
    assert not wrong, f"numeric defaults that read as measurements (use NaN or None): {wrong}"
    names = {c.__name__ for c in classes}
    assert {cls for cls, _ in ALLOWED} <= names  # no stale entry


def test_the_rule_catches_a_planted_default():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Planted:  # not a Result: nothing registered for loading
        max_abs: float = 0.0
        kurtosis: float = float("nan")
        note: str = ""

    assert numeric_defaults(Planted) == ["Planted.max_abs = 0.0"]


def test_quantize_without_reader_sites_reports_not_measured():
    """GPT-2's blocks give no layers the quantizer can tell as residual readers ("plain" sites):
    the statistics it sees there were 0.0; now NaN, and the summary says not measured. A model with
    readers (Llama) measures them: finite, positive."""
    from massive_lens.quant import quantize

    text = "One. Two. Three. " * 40
    plain = quantize(tiny_model("gpt2"), text, seq_len=32, n_seqs=2)
    row = plain.to_frame().iloc[0]
    for col in ("max_abs", "kurtosis", "top1_median", "err_sink", "err_massive", "err_other"):
        assert math.isnan(row[col]), col
    assert math.isfinite(row["loss"]) and "not measured" in plain.summary()
    assert "max |x| 0" not in plain.summary()
    seen = quantize(tiny_model("llama"), text, seq_len=32, n_seqs=2).to_frame().iloc[0]
    assert all(seen[c] > 0 for c in ("max_abs", "kurtosis", "top1_median"))


def test_calibration_without_the_online_check_says_not_measured():
    """A Calibration whose online-rule check was not run (built without it) printed "misses 0 and
    adds 0"; the counts default to None and the summary says not measured."""
    from massive_lens.interventions.calibration import calibrate

    calib = calibrate(tiny_model("llama"), "One. Two. Three. " * 40, seq_len=32, n_seqs=2)
    assert calib.online_missed is not None and "misses" in calib.summary()
    bare = dataclasses.replace(calib, online_missed=None, online_extra=None)
    assert "not measured" in bare.summary() and "misses 0" not in bare.summary()
    assert torch.equal(bare.sink_mass, calib.sink_mass)


@pytest.mark.parametrize("field", ["online_missed", "online_extra"])
def test_calibration_counts_have_no_measured_looking_default(field):
    from massive_lens.interventions.calibration_result import Calibration

    default = {f.name: f.default for f in dataclasses.fields(Calibration)}[field]
    assert default is None
