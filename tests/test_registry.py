"""The intervention registry: every row is complete, builds and runs on a tiny model, and the
check fails on an incomplete row (adding a setting is one row)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import plant_massive, untouched

from massive_lens import tiny_model
from massive_lens.interventions import EVERY, REGISTRY, SETTINGS, Intervention, calibrate
from massive_lens.interventions.registry import ATTN, NOTHING, RESID, InterventionSetting

CALIB = "The river runs to the sea. Birds sing at dawn, and the town wakes. " * 6


def row_problems(row: InterventionSetting, registry: dict[str, InterventionSetting]) -> list[str]:
    """What is missing or inconsistent in a registry row (empty: complete)."""
    problems = []
    if not row.name or registry.get(row.name) is not row:
        problems.append("its name is empty or not its registry key")
    if not callable(row.builder):
        problems.append("no builder")
    if len(row.description.split()) < 2:
        problems.append("no description")
    if row.acts_on not in (RESID, ATTN, NOTHING):
        problems.append(f"acts_on {row.acts_on!r} is not one of {RESID!r}, {ATTN!r}, {NOTHING!r}")
    if row.every is not None:
        every = registry.get(row.every)
        if every is None or every.in_table3 or every.needs_massive != row.needs_massive or every.every:
            problems.append(f"its every form {row.every!r} is not a registered every-only row like it")
    return problems


@pytest.fixture(scope="module")
def planted():
    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=5, dim=7, value=5000.0, trigger=256, trigger_dim=3)
    return model, calibrate(model, CALIB, seq_len=32, n_seqs=4, progress=False)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_row_is_complete_and_builds_an_intervention_that_runs(planted, name):
    model, calib = planted
    row = REGISTRY[name]
    assert not row_problems(row, REGISTRY), row_problems(row, REGISTRY)
    tokens = model.to_tokens("A bird sang, then flew.")
    with untouched(model):
        iv = row.build(model, calib)
        assert isinstance(iv, Intervention) and iv.description == row.description
        with torch.no_grad(), iv:
            logits = model(tokens)
    assert torch.isfinite(logits).all()
    assert len(iv) > 0 or row.acts_on == NOTHING


def test_the_derived_tables_come_from_the_rows():
    assert SETTINGS[0] == "original" and set(SETTINGS) == {r for r, row in REGISTRY.items() if row.in_table3}
    assert EVERY == {"zero": "zero_every", "mean": "mean_every", "resample": "resample_every", "noise": "noise_every",
                     "bias_surgery": "bias_surgery_every"}


def test_an_incomplete_row_is_caught():
    base = REGISTRY["zero"]
    broken = {
        "description": dataclasses.replace(base, description=""),
        "acts_on": dataclasses.replace(base, acts_on="the weights"),
        "every": dataclasses.replace(base, every="zero_somewhere"),
        "every-kind": dataclasses.replace(base, every="sink_term_zero"),
    }
    for what, row in broken.items():
        assert row_problems(row, {**REGISTRY, "zero": row}), what
