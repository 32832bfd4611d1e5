"""Every public result type keeps the contract: a frozen dataclass holding no model, with
``to_frame()`` (a DataFrame), ``summary()`` (text), ``plot(ax=None)`` (an Axes, drawn on the
one given) and the shared ``_repr_html_``. New result types must be added here: the test
finds them by walking the subclasses of ``Result``."""

from __future__ import annotations

import dataclasses
from html import escape

import matplotlib.axes
import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from examples import RESULT_TYPES, all_result_types

from massive_lens.core.results import Result


def test_every_result_type_has_an_example(result_examples):
    names = {t.__name__ for t in all_result_types()}
    assert names == set(result_examples) == set(RESULT_TYPES), f"examples missing for {names - set(result_examples)}"


@pytest.mark.parametrize("name", RESULT_TYPES)
def test_result_contract(result_examples, name):
    result = result_examples[name]
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
