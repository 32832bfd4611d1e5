"""core.weight_cache.derived keeps what is derived from a weight only while the weight is unchanged: every
route of an edit (in place through .data, in place under no_grad, new memory) gives the new answer, and the
analyses that keep W_out's statistics (sink_census's row norms, trace_origin's super weights) answer after an
edit what they answer with nothing kept."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from planting import plant_key_writers, plant_story
from torch.utils.weak import WeakIdKeyDictionary

import massive_lens.core.weight_cache as module
from massive_lens import tiny_model, trace_origin
from massive_lens.attention import sink_census
from massive_lens.core.model_view import ModelView
from massive_lens.core.weight_cache import derived
from massive_lens.origin.neurons import _hf_names, hf_param, w_out

ROUTES = {
    "through .data": lambda p: p.data[0].mul_(1.5),
    "under no_grad": lambda p: torch.no_grad().__enter__() or p.mul_(1.5),
    "new memory": lambda p: setattr(p, "data", p.data * 1.5),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_an_edit_by_any_route_is_derived_again(route):
    owner = torch.nn.Linear(6, 5)
    norms = lambda w: w.detach().norm(dim=1)  # noqa: E731
    first = derived(owner.weight, owner, "norms", norms)
    assert derived(owner.weight, owner, "norms", norms) is first
    with torch.no_grad():
        ROUTES[route](owner.weight)
    again = derived(owner.weight, owner, "norms", norms)
    assert again is not first and torch.equal(again, owner.weight.detach().norm(dim=1))
    assert derived(owner.weight, object(), "norms", norms) is not again  # an owner that cannot keep it


@pytest.mark.parametrize("analysis", ["sink_census", "trace_origin"])
def test_an_edited_w_out_gives_the_answer_computed_with_nothing_kept(analysis, monkeypatch):
    model = tiny_model("llama")  # a sink with its MLPs' neurons; a massive activation with its births' neurons
    model = plant_key_writers(model, (300.0, 3000.0)) if analysis == "sink_census" else plant_story(model)
    view = ModelView(model)
    text = "The cat sat on the mat, and then it slept."
    run = {"sink_census": lambda: sink_census(model, text).frame,
           "trace_origin": lambda: trace_origin(model, text).super_weights}[analysis]
    before = run()  # kept now
    assert len(before)
    weights = [view.block(layer).mlp.W_out for layer in range(view.n_layers)]
    saved = [w.data.clone() for w in weights]
    try:
        for w in weights:
            w.data.mul_(torch.linspace(0.2, 3.0, w.shape[0])[:, None])  # through .data: no version counted
        edited = run()
        monkeypatch.setattr(module, "_KEPT", WeakIdKeyDictionary())  # nothing kept
        fresh = run()
    finally:
        for w, s in zip(weights, saved, strict=True):
            w.data.copy_(s)
    pd.testing.assert_frame_equal(edited, fresh, check_exact=True)
    assert not edited.equals(before)  # the edit shows


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_names_are_named_parameters_first_names(family):
    model = tiny_model(family)
    want: dict = {}
    for name, param in model.original_model.named_parameters():
        want.setdefault((param.data_ptr(), param.numel()), (name.replace("._original_component", ""),
                                                            tuple(param.shape)))
    assert _hf_names(model) == want and list(_hf_names(model)) == list(want)


def test_hf_names_kept_follow_a_replaced_parameter():
    """The kept names are checked where used: a parameter replaced after they were read (new storage) is found
    under its name again, not given the TL name, and the name of a parameter that moved is not given to another."""
    model = tiny_model("llama")
    view = ModelView(model)
    before = hf_param(model, 1, w_out(view, 1))  # the names kept now
    assert before[0].endswith("layers.1.mlp.down_proj.weight")
    weight = w_out(view, 1)
    mlp = next(module for module in model.original_model.modules()
               if isinstance(getattr(module, "weight", None), torch.Tensor)
               and module.weight.data_ptr() == weight.data_ptr())
    old = mlp.weight
    try:
        mlp.weight = torch.nn.Parameter(old.detach().clone())  # new storage: a key the kept names do not have
        assert hf_param(model, 1, w_out(view, 1)) == before
        assert hf_param(model, 1, old) == ("blocks.1.mlp.W_out", False)  # its old storage: no longer a parameter
    finally:
        mlp.weight = old
