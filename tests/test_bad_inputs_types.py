"""Wrong types and nonsense values (issue 48): each is a ``MassiveLensError`` saying what was wrong,
never a raw ``TypeError``/``AttributeError`` and never a quiet answer.

The rules live in one place each, so that they hold for every entry point:
:mod:`massive_lens.core.checks` (an integer is never a bool or a float, a number is any real
number, numpy ones of every width included, never NaN), ``as_criterion`` / ``as_rule`` (a
``Criterion`` / ``SinkRule`` or None), ``ModelView.tokenize`` (text), ``iter_texts`` (a corpus),
``as_hooks`` (hooks), the result store (a folder that cannot be written; a table swapped for
another). The bigger table of refused inputs is ``test_bad_inputs.py``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import beartype
import jaxtyping
import numpy as np
import pytest
import torch
from conftest import STAND_INS
from helpers import untouched, untyped_errors

from massive_lens import MassiveLensError, find_massive, load, perplexity, scan_corpus, tiny_model, trace_origin
from massive_lens.attention import find_sinks, norm_roles, sink_attention, sink_census, sink_circuit
from massive_lens.core.checks import as_int, as_number, as_pair, as_seconds
from massive_lens.core.criterion import SinkRule
from massive_lens.effects import streaming_window
from massive_lens.interventions import scale_sink_attention
from massive_lens.quant import quantize
from massive_lens.viz import activation_landscape, attention_maps
from massive_lens.viz.views import attention_view, magnitude_view

TEXT = "Hello there, world. " * 4
RULE = SinkRule(threshold=0.05)  # the tiny model's heads give the first token a little attention


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


# --------------------------------------------------------------------------- the shared rules


@pytest.mark.parametrize("value", [True, np.bool_(True), 0.7, 2.0, "1", None, 2.5])
def test_an_integer_is_never_a_bool_a_float_or_a_string(value):
    with pytest.raises(MassiveLensError, match="must be an integer"):
        as_int(value, "layer")


def test_an_integer_may_be_a_numpy_integer_and_is_range_checked():
    assert as_int(np.int32(3), "n") == 3 and type(as_int(np.int64(3), "n")) is int
    with pytest.raises(MassiveLensError, match=r"n_heads must be an integer >= 1, got 0"):
        as_int(0, "n_heads", low=1)


@pytest.mark.parametrize("value", [np.float16(0.5), np.float32(0.5), np.float64(0.5), 0.5, 1, np.int8(1)])
def test_a_number_is_any_real_number_of_any_width(value):
    assert as_number(value, "gamma", above=0) == float(value)


@pytest.mark.parametrize("value, match", [(float("nan"), "finite"), (math.inf, "finite"), (True, "a number"),
                                          ("0.5", "a number"), (None, "a number"), (0.0, "> 0")])
def test_a_number_is_never_nan_a_bool_or_a_string(value, match):
    with pytest.raises(MassiveLensError, match=match):
        as_number(value, "gamma", above=0)


def test_seconds_and_pairs():
    assert as_seconds(None) is None and as_seconds(np.float32(2)) == 2.0
    for bad in (float("nan"), 0, -1, "10"):
        with pytest.raises(MassiveLensError, match="max_seconds"):
            as_seconds(bad)
    assert as_pair((np.int64(1), 0), "heads") == (1, 0)
    for bad in ((True, 0), (0.7, 0), (0,), (0, 0, 0), "ab", 5):
        with pytest.raises(MassiveLensError, match="heads"):
            as_pair(bad, "heads")


# --------------------------------------------------------------------------- the entry points

# each call as source text, run with the tests' type checks turned off (``helpers.untyped_errors``): the
# annotations refuse most of these values first under them; a caller has no such checks
CASES = {
    # sink_circuit: counts, heads, time bound, seed, rule, criterion, text, corpus
    "sink_circuit(m, TEXT, n_heads=2.5, rule=RULE)": "n_heads must be an integer",
    "sink_circuit(m, TEXT, n_heads=0, rule=RULE)": "n_heads must be an integer >= 1",
    "sink_circuit(m, TEXT, n_heads=-1, rule=RULE)": "n_heads must be an integer >= 1",
    "sink_circuit(m, TEXT, heads=[], rule=RULE)": "heads must be a non-empty list",
    "sink_circuit(m, TEXT, heads=[(True, 0)], rule=RULE)": "got True",
    "sink_circuit(m, TEXT, heads=[(1, True)], rule=RULE)": "got True",
    "sink_circuit(m, TEXT, heads=[(0.7, 0)], rule=RULE)": "got 0.7",
    "sink_circuit(m, TEXT, rule=RULE, n_heads=1, corpus=TEXT, n_seqs=1, seq_len=16, max_seconds=float('nan'))":
        "max_seconds must be a finite number",
    "sink_circuit(m, TEXT, rule='x')": "rule must be a massive_lens SinkRule",
    "sink_circuit(m, TEXT, rule=RULE, criterion=3)": "criterion must be",
    "sink_circuit(m, None, rule=RULE)": "text must be a string",
    "sink_circuit(m, TEXT, rule=RULE, n_heads=1, corpus=123, n_seqs=1, seq_len=16)": "the corpus must be",
    "norm_roles(m, TEXT, criterion=3)": "criterion must be",
    "norm_roles(m, None)": "text must be a string",
    # the sink rule and the criterion everywhere
    "find_sinks(m, TEXT, rule='x')": "rule must be",
    "find_sinks(m, TEXT, criterion=3)": "criterion must be",
    "sink_census(m, TEXT, rule='x')": "rule must be",
    "quantize(m, TEXT * 10, seq_len=16, n_seqs=1, criterion='sun')": "criterion must be",
    "sink_attention(m, TEXT, threshold='x')": "threshold must be a number",
    # text, corpus, hooks
    "find_massive(m, None)": "text must be a string",
    "find_massive(m, 3)": "text must be a string",
    "scan_corpus(m, 123, progress=False)": "the corpus must be",
    "perplexity(m, 123, progress=False)": "the corpus must be",
    "perplexity(m, TEXT, seq_len=16, hooks=3, progress=False)": "hooks must be a list of",
    # γ of scale_sink_attention: its keys
    "scale_sink_attention(m, {'a': 0.5})": "keys must be (layer, head) pairs",
    "scale_sink_attention(m, {(0,): 0.5})": "keys must be (layer, head) pairs",
    "scale_sink_attention(m, {(0, 0, 0): 0.5})": "keys must be (layer, head) pairs",
    "scale_sink_attention(m, {5: 0.5})": "keys must be (layer, head) pairs",
    "scale_sink_attention(m, {(True, 0): 0.5})": "got True",
    "scale_sink_attention(m, {(0.7, 0): 0.5})": "got 0.7",
    "scale_sink_attention(m, {(0, 1.5): 0.5})": "got 1.5",
    # streaming_window's sinks: counts, not a count
    "streaming_window(m, TEXT * 40, window=8, sinks=3, seq_len=64, n_seqs=1, census=False)": "sinks=(3,)",
    # one layer, head or dim of the figures and the tracer: True is no 1, 0.7 no 0
    "activation_landscape(m, TEXT, layer=True)": "layer must be an integer, got True",
    "activation_landscape(m, TEXT, layer=0.7)": "layer must be an integer, got 0.7",
    "attention_maps(m, TEXT, True)": "layer must be an integer, got True",
    "attention_maps(m, TEXT, 1, heads=[True])": "heads must be an integer, got True",
    "attention_maps(m, TEXT, 1, max_heads=2.5)": "max_heads must be an integer",
    "attention_view(m, TEXT, 1, heads=[0.7])": "heads must be an integer, got 0.7",
    "magnitude_view(m, TEXT, 1, dim=True)": "must be an integer, got True",
    "trace_origin(m, TEXT, dim=True)": "dim=True is out of range",
}

@pytest.fixture(scope="module")
def untyped() -> dict[str, list]:
    """What each call raises without the type checks, on a tiny qwen2 of its own: {code: [type, message, model as
    found]}."""
    m = tiny_model("qwen2")
    hooks = sum(len(h._forward_hooks) for h in m.modules())
    state = {k: v.clone() for k, v in m.state_dict().items()}
    names = (activation_landscape, attention_maps, attention_view, find_massive, find_sinks, magnitude_view,
             norm_roles, perplexity, quantize, scale_sink_attention, scan_corpus, sink_attention, sink_census,
             sink_circuit, streaming_window, trace_origin)
    return untyped_errors(list(CASES), {**{f.__name__: f for f in names}, "m": m, "TEXT": TEXT, "RULE": RULE},
                          after=lambda: sum(len(h._forward_hooks) for h in m.modules()) == hooks and all(
                              v.equal(state[k]) for k, v in m.state_dict().items()))


@pytest.mark.parametrize("code", list(CASES))
def test_refused_with_a_clear_error(untyped, code):
    kind, message, as_found = untyped[code]
    assert kind == "MassiveLensError" and CASES[code] in message, (kind, message)
    assert as_found, "the model was left changed"


def _typed_inner(kind: str, default: float | int = 1.0):
    """A function made anew at each call, as the package's hook closures are, type-checked as the tests' import hook
    does (``conftest._share_stand_ins`` shares its checks between functions of one signature)."""
    if kind == "int":
        @jaxtyping.jaxtyped(typechecker=beartype.beartype)
        def inner(x: int, scale: float = default) -> int:
            return x if x >= 0 else "negative"
    else:
        @jaxtyping.jaxtyped(typechecker=beartype.beartype)
        def inner(x: str, scale: float = default) -> int:
            return len(x)
    return inner


def test_the_type_checks_hold_for_a_function_made_again_and_again():
    """Each function made from one definition is checked, its arguments and its return, with the check made once;
    another annotation or another default (1 is no 1.0) under the same name gets its own."""
    def made() -> int:  # the stand-ins made so far for _typed_inner's function
        return sum(key[1] == "_typed_inner.<locals>.inner" for key in STAND_INS)

    first, again = _typed_inner("int"), _typed_inner("int")
    assert made() == 2  # the parameters' stand-in and the return's, made once for both functions
    for fn in (first, again):
        assert fn(3) == 3
        with pytest.raises(jaxtyping.TypeCheckError):
            fn("3")
        with pytest.raises(jaxtyping.TypeCheckError):
            fn(-1)  # returns a string
    other = _typed_inner("str")
    assert other("abc") == 3 and made() == 4
    with pytest.raises(jaxtyping.TypeCheckError):
        other(3)
    _typed_inner("int", default=1)
    assert made() == 6


def test_hooks_none_means_no_hooks(model):
    tokens = model.to_tokens(TEXT)
    assert perplexity(model, tokens, hooks=None, progress=False).loss == \
        perplexity(model, tokens, progress=False).loss


def test_gamma_of_any_float_width_is_the_same_edit(model):
    """np.float32 γ was refused while np.float64 was taken: both are the same γ."""
    tokens = model.to_tokens(TEXT)
    got = [perplexity(model, tokens, hooks=scale_sink_attention(model, g), progress=False).loss
           for g in (np.float32(0.5), np.float64(0.5), 0.5)]
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_named_as_the_precision(dtype):
    """A plain half-precision model was refused with a message about the norm's form (and
    norm_roles' named sink_circuit): now each names the dtype, float32, and itself."""
    model = tiny_model("qwen2").to(dtype)
    for call, name in ((lambda: sink_circuit(model, TEXT, rule=RULE), "sink_circuit"),
                       (lambda: norm_roles(model, TEXT), "norm_roles")):
        with untouched(model), pytest.raises(MassiveLensError) as info:
            call()
        text = str(info.value)
        assert str(dtype).removeprefix("torch.") in text and "float32" in text and name in text
        assert "norm's output" not in text and (name == "sink_circuit" or "sink_circuit" not in text)


# --------------------------------------------------------------------------- saved results


def test_a_table_swapped_for_another_is_refused_at_load(model, tmp_path):
    census = sink_census(model, TEXT)
    folder = census.save(tmp_path / "census")
    manifest = json.loads((folder / "manifest.json").read_text())
    by_kind, by_layer = (folder / manifest["fields"][k]["$frame"] for k in ("by_kind", "by_layer"))
    assert load(folder).by_kind.equals(census.by_kind)
    shutil.copy(by_layer, by_kind)
    with pytest.raises(MassiveLensError, match="another table is in its place"):
        load(folder)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_saving_where_nothing_can_be_written(model, tmp_path):
    from massive_lens.handover import massive_dims

    dims = massive_dims(model, TEXT, seq_len=16, n_seqs=1)
    for call in (lambda: dims.to_json("/proc/massive_lens_test/dims.json"), lambda: dims.to_json("/proc/dims.json"),
                 lambda: dims.save("/proc/massive_lens_test"), lambda: sink_census(model, TEXT).save("/proc/x")):
        with pytest.raises(MassiveLensError, match="cannot (write|save to) /proc"):
            call()
