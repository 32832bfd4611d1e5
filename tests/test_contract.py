"""Every public result type keeps the contract: a frozen dataclass holding no model, with
``to_frame()`` (a DataFrame), ``summary()`` (text), ``plot(ax=None)`` (an Axes, drawn on the
one given) and the shared ``_repr_html_``. New result types must be added here: the test
finds them by walking the subclasses of ``Result``."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from html import escape

import matplotlib.axes
import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from planting import plant_sink

import massive_lens
from massive_lens import (
    calibrate,
    decompose_attention,
    find_massive,
    layer_profile,
    measure_outliers,
    perplexity,
    run_interventions,
    scan_corpus,
    sink_attention,
    tiny_model,
    trace_origin,
)
from massive_lens.core.results import Result
from massive_lens.train import compare_variants, retrofit, train_model
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM

TEXT = "The cat sat. The dog ran!\nA bird sang, loudly. " * 8
TINY_TRAIN = dict(steps=2, data="One. Two, three.\n" * 100, model=dict(n_layers=1, d_model=16, n_ctx=16))


def _all_result_types() -> set[type]:
    for info in pkgutil.walk_packages(massive_lens.__path__, "massive_lens."):
        importlib.import_module(info.name)
    found, todo = set(), [Result]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("massive_lens.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _examples() -> dict[str, object]:
    model = tiny_model("llama")
    return {
        "MassiveActivations": find_massive(model, "Hello there."),
        "LayerProfile": layer_profile(model, ["One text.", "Two texts."]),
        "CorpusScan": scan_corpus(model, TEXT, seq_len=16, max_tokens=64, progress=False),
        "OriginTrace": trace_origin(model, "Hi.", dim=3, pos=0),
        "SinkAttention": sink_attention(model, "Hello world."),
        "AttentionDecomposition": decompose_attention(model, "Hello world.", sinks=[0]),
        "Perplexity": perplexity(model, TEXT, seq_len=16, n_seqs=2, progress=False),
        "Calibration": calibrate(model, TEXT, seq_len=16, n_seqs=2, progress=False),
        "InterventionTable": run_interventions(model, TEXT, calibration=TEXT[::-1], seq_len=16, n_seqs=2,
                                               settings=["sink_term_mean"], progress=False),
        "OutlierReport": measure_outliers(MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2)), TEXT,
                                          seq_len=16, n_seqs=2),
        "TrainRun": train_model("smoke", progress=False, **TINY_TRAIN),
        "Comparison": compare_variants(["softmax"], preset="smoke", seeds=[0], progress=False, measure_seqs=1,
                                       **TINY_TRAIN),
        "Retrofit": retrofit(_planted(), ["softmax-kept"], steps=1, batch_size=1, seq_len=16, data=TEXT,
                             eval_data=TEXT, eval_every=1, eval_seqs=1, measure=False, progress=False),
    }


def _planted():
    model = tiny_model("llama")
    plant_sink(model)
    return model


@pytest.fixture(scope="module")
def examples():
    return _examples()


def test_every_result_type_has_an_example(examples):
    names = {t.__name__ for t in _all_result_types()}
    assert names == set(examples) == set(RESULT_TYPES), f"examples missing for {names - set(examples)}"


RESULT_TYPES = ["MassiveActivations", "LayerProfile", "CorpusScan", "OriginTrace", "SinkAttention",
                "AttentionDecomposition", "Perplexity", "Calibration", "InterventionTable", "OutlierReport",
                "TrainRun", "Comparison", "Retrofit"]


@pytest.mark.parametrize("name", RESULT_TYPES)
def test_result_contract(examples, name):
    result = examples[name]
    assert type(result).__name__ == name and isinstance(result, Result)
    assert dataclasses.is_dataclass(result) and type(result).__dataclass_params__.frozen
    held = [f.name for f in dataclasses.fields(result) if isinstance(getattr(result, f.name), torch.nn.Module)]
    assert held == (["model"] if name == "TrainRun" else []), f"{name} holds a model in {held}"  # a run returns it
    frame = result.to_frame()
    assert isinstance(frame, pd.DataFrame) and len(frame.columns) > 0
    text = result.summary()
    assert isinstance(text, str) and len(text) > 20
    ax = result.plot()
    assert isinstance(ax, matplotlib.axes.Axes) and (ax.lines or ax.patches or ax.collections)
    _, given = plt.subplots()
    assert result.plot(ax=given) is given
    html = result._repr_html_()
    assert html.startswith("<pre>" + escape(text.split("\n")[0]))  # the summary comes first
    assert ("<table" in html) == (len(frame) > 0)
