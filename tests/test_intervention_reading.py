"""The interventions' record of the attention still on the sinks is one reducer
(``edits.record_sink_attention``) over the attention pass's reading of the forward its hooks run in
(``core.attention_pass.attention_reading``), whichever path read it: the eager pattern, or the fused
kernel's log-sum-exp on a view that serves no pattern (nnsight)."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

from massive_lens import load_model, tiny_model
from massive_lens.core.attention_pass import attention_reading
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import byte_tokenizer
from massive_lens.interventions import calibrate, observe
from massive_lens.interventions.edits import record_sink_attention, reset
from massive_lens.interventions.state import HookState
from massive_lens.metrics import perplexity
from massive_lens.models.tiny import tiny_config

TEXT = "The cat sat on the mat. A dog ran off to the park and back. "


def pattern_mass(view: ModelView, batch, layer: int, sinks: torch.Tensor) -> float:
    """Mean attention of non-sink queries to the sinks over heads, from the eager pattern itself."""
    pattern = view.activation(batch, view.hook_name(layer, "attn.hook_pattern")).double()
    queries = (~sinks).double()
    total = torch.einsum("bhqk,bk,bq->", pattern, sinks.double(), queries)
    return float(total / (queries.sum() * pattern.shape[1]))


def find_later(resid, hook, *, state: HookState, at: int) -> None:
    """Stands in for the online sink rule: after layer 0, position ``at`` is a sink too."""
    state.sinks = torch.zeros(resid.shape[:2], dtype=torch.bool)
    state.sinks[:, at] = True


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("path", ["eager", "lse"])
def test_record_on_either_path_is_the_patterns(family, path):
    """Sinks that differ per sequence, and a sink found during the forward (after layer 0): each
    layer's record is the eager pattern's attention on the sinks known when that layer ran."""
    model = tiny_model(family)
    view = ModelView(model)
    batch = view.tokenize([TEXT, TEXT[5:] + "More."])
    pos = batch.tokens.shape[1]
    given = torch.zeros(2, pos, dtype=torch.bool)
    given[0, 0], given[1, 0], given[1, 7] = True, True, True
    state = HookState()  # the first token, then what find_later adds
    state_given = HookState(sinks=given)
    for st, extra in ((state, [(view.hook_name(0, "resid_post"), partial(find_later, state=state, at=4))]),
                      (state_given, [])):
        reader = attention_reading(view, partial(record_sink_attention, state=st, first=0), path=path,
                                   columns=st.sink_columns, layers=range(view.n_layers))
        with reader:
            view.forward(batch, [(view.hook_name(0, "resid_pre"), partial(reset, state=st)), *extra, *reader.hooks])
        assert sorted(st.record.mass) == list(range(view.n_layers))
    first = torch.zeros(2, pos, dtype=torch.bool)
    first[:, 0] = True
    later = first.clone()
    later[:, 4] = True
    for layer in range(view.n_layers):
        for st, sinks in ((state, first if layer == 0 else later), (state_given, given)):
            total, n = st.record.mass[layer]
            assert total / n == pytest.approx(pattern_mass(view, batch, layer, sinks), rel=1e-5, abs=1e-7)
    assert torch.equal(state.record.sinks[0], first) and torch.equal(state_given.record.sinks[0], given)


def nnsight_twin(family: str):
    """An nnsight model over ``tiny_model(family)``'s weights (same config and seed)."""
    cls, config = tiny_config(family, byte_tokenizer(), {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = cls(config).eval()
    return load_model(hf, tokenizer=byte_tokenizer(), backend="nnsight", name=f"tiny-{family}")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nnsight_record_is_the_bridges():
    """On nnsight the same reducer reads the kernel, run around the forward by ``Intervention.reading``:
    the record of the attention on the sinks is the bridge's (eager pattern) over the same weights."""
    bridge = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = nnsight_twin("llama")
    tokens = ModelView(bridge).tokenize([TEXT * 2, TEXT[::-1] * 2]).tokens[:, :24]
    calib = calibrate(bridge, ModelView(bridge).tokenize([TEXT[3:] * 2]).tokens[:, :24], progress=False)
    records = []
    for model in (bridge, lm):
        iv = observe(model, calibration=calib, sinks=[0, 3])
        with iv.reading():
            perplexity(model, tokens, seq_len=24, hooks=iv, progress=False)
        records.append(iv.record)
    eager, lse = records
    assert sorted(lse.mass) == sorted(eager.mass) == list(calib.attn_layers) and calib.attn_layers
    for layer, (total, n) in eager.mass.items():
        assert lse.mass[layer][1] == n
        assert lse.mass[layer][0] == pytest.approx(total, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(eager.sinks, lse.sinks, strict=True))
