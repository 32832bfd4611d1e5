"""The lock rule over the whole package (issue 37): every call that changes a model's weights,
dtype or modules for longer than one pass holds ``model_lock(model)`` for the whole change.

The rule is read from the source (``lock_rule.py``): each statement that edits a model is found,
and each one must be under the lock, in its own function or in every caller's. The few edits
of a model the package built itself (a training run's, retrofit's fresh copy) are listed below
with the reason; a planted break shows the rule catching an edit without the lock.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lock_rule import editing_functions, package_sources, read_sources, violations

import massive_lens

ROOT = Path(massive_lens.__file__).parent

OWN_MODELS = {  # edits of a model no user holds: built in the same call, or a copy made for it
    "massive_lens.origin.experts:Experts.columns": "writes into probe tensors it made, not into the model",
    "massive_lens.train.checkpoint:resume_from": "loads a checkpoint into the model train_model has just built",
    "massive_lens.train.trainer:TrainRun._from_stored": "loads saved weights into a model it has just built",
    "massive_lens.train.trainer:load_run": "loads saved weights into a model it has just built",
    "massive_lens.train.hf_attention:plain_copy": "loads the weights into the plain copy it has just built",
    "massive_lens.train.hf_attention:init_slots": "retrofit's fresh copy (plain_copy), before anyone holds it",
    "massive_lens.train.retrofit_parts:seed_slots": "retrofit's fresh copy (plain_copy), before anyone holds it",
    "massive_lens.train.retrofit_parts:zero_super_weights": "retrofit's fresh copy (plain_copy), before anyone "
                                                           "holds it",
    "massive_lens.models.gguf:_place": "places the GGUF file's tensors into the model dequantized_model has just "
                                      "built with empty weights, before anyone holds it",
    "massive_lens.train.hf_attention:load_into_bridge": "a lasting load into a bridge its caller asked to change, "
                                                        "not a temporary edit",
}
# edits the rule must see (so that a reader that finds nothing cannot pass)
KNOWN_EDITS = {"massive_lens.handover.mixed:cast", "massive_lens.quant.fake:attached",
               "massive_lens.quant.simulate:Simulator._hooks.<locals>.pre", "massive_lens.origin.verify:zeroed_weights"}


@pytest.fixture(scope="module")
def sources():
    return package_sources(ROOT)


def test_every_model_edit_holds_the_model_lock(sources):
    found = violations(read_sources(sources), OWN_MODELS)
    assert not found, "\n".join(found)


def test_the_rule_sees_the_known_edits_and_every_exception_still_edits(sources):
    editing = editing_functions(read_sources(sources))
    assert KNOWN_EDITS <= editing
    assert set(OWN_MODELS) <= editing, sorted(set(OWN_MODELS) - editing)  # a stale exception is removed


def test_a_cast_without_the_lock_breaks_the_rule(sources):
    """The state before the fix of issue 37: ``cast`` without the lock, reached from precision_check."""
    mixed = "massive_lens.handover.mixed"
    assert "with model_lock(model):" in sources[mixed]
    broken = {**sources, mixed: sources[mixed].replace("with model_lock(model):", "if True:")}
    found = violations(read_sources(broken), OWN_MODELS)
    assert found and all(f"{mixed}:cast" in v for v in found)
    assert any("precision_check" in v for v in found)


def test_a_weight_swap_that_no_longer_acquires_breaks_the_rule(sources):
    fake = "massive_lens.quant.fake"
    assert "with model_lock(model):" in sources[fake]
    broken = {**sources, fake: sources[fake].replace("with model_lock(model):", "if True:")}
    found = violations(read_sources(broken), OWN_MODELS)
    assert found and all(f"{fake}:" in v for v in found)


PLANTED = '''
import contextlib
import torch
from massive_lens.core.model_lock import model_lock


def halve(model):  # a public function that edits without the lock: the break
    for p in model.parameters():
        p.data = p.data.to(torch.float16)


@contextlib.contextmanager
def _zeroed(model):  # a helper without the lock of its own ...
    with torch.no_grad():
        model.W.zero_()
    yield


def zeroed_safely(model):  # ... is fine where every caller holds it
    with model_lock(model), _zeroed(model):
        pass


def load(model, state):
    with model_lock(model):
        model.load_state_dict(state)
'''


@pytest.mark.parametrize("extra, expected", [
    ("", ["massive_lens.planted:halve"]),
    ("\n\ndef zeroed_now(model):\n    with _zeroed(model):\n        pass\n",  # a second, unlocked caller
     ["massive_lens.planted:halve", "massive_lens.planted:_zeroed <- massive_lens.planted:zeroed_now"]),
    ("\n\ndef reload(model, state):\n    model.load_state_dict(state)\n",
     ["massive_lens.planted:halve", "massive_lens.planted:reload"]),
])
def test_a_planted_edit_without_the_lock_is_found(sources, extra, expected):
    found = violations(read_sources({**sources, "massive_lens.planted": PLANTED + extra}), OWN_MODELS)
    assert len(found) == len(expected) and all(any(name in m for m in found) for name in expected), found
