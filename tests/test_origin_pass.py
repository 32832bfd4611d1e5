"""trace_origin reads the attention through the one attention pass: on the path ``choose_path`` takes
(the fused kernel from ``LSE_FROM`` tokens, lowered here to fit the tiny models' context), with the same
tables as the eager pattern's to rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from massive_lens import tiny_model, trace_origin
from massive_lens.core import attention_pass
from massive_lens.errors import MassiveLensError
from massive_lens.origin import capture as capture_module
from massive_lens.origin import one_pass as one_pass_module
from massive_lens.origin import targets as targets_module
from massive_lens.origin import trace as trace_module

FRAMES = ("targets", "ledger", "events", "heads", "neurons", "why")


def _long(model, n):
    return torch.randint(10, model.cfg.d_vocab, (1, n), generator=torch.Generator().manual_seed(0))


LONG = 80  # tokens: over the lowered LSE_FROM


def _paths(monkeypatch):
    """Lower LSE_FROM; record the path of every attention reading of capture and of the detection pass."""
    monkeypatch.setattr(attention_pass, "LSE_FROM", 48)
    seen = []
    for module in (capture_module, targets_module):
        real = module.attention_reading

        def spy(*args, real=real, **kwargs):
            seen.append(kwargs["path"])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "attention_reading", spy)
    return seen


def _close(a, b):
    for name in FRAMES:
        x, y = getattr(a, name), getattr(b, name)
        assert list(x.columns) == list(y.columns) and len(x) == len(y), name
        if x.empty:
            continue
        num = x.select_dtypes("number").columns
        assert (x.drop(columns=num).astype(str).values == y.drop(columns=num).astype(str).values).all(), name
        np.testing.assert_allclose(x[num].to_numpy(float), y[num].to_numpy(float), rtol=1e-4, atol=1e-4 * (
            1 + np.nanmax(np.abs(x[num].to_numpy(float)))), err_msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_long_text_runs_on_the_kernel_with_the_eager_tables(family, monkeypatch):
    model = tiny_model(family)
    tokens = _long(model, LONG)
    seen = _paths(monkeypatch)
    kernel = trace_origin(model, tokens, pos=LONG - 9)
    assert seen == ["lse"]
    monkeypatch.setattr(capture_module, "choose_path", lambda view, attention, batch: "eager")
    eager = trace_origin(model, tokens, pos=LONG - 9)
    assert seen[-1] == "eager"
    _close(kernel, eager)
    heads = kernel.heads[kernel.heads["head"] >= 0]
    assert len(heads) and heads[["first_token_attention", "max_attention"]].notna().all().all()
    assert (heads.max_attention >= heads.first_token_attention - 1e-6).all()


def _planted():
    """Tiny llama and a long text with a massive value in dim 3 at position LONG - 20 (its token's embedding)."""
    model = tiny_model("llama")
    tokens = _long(model, LONG)
    tokens[0, LONG - 20] = 7
    with torch.no_grad():
        model.original_model.get_input_embeddings().weight[7, 3] = 500.0
    return model, tokens


@pytest.mark.parametrize("late", ["none", "copies", "prefix", "whole", "detection"])
def test_a_long_text_is_traced_in_one_pass_on_the_kernel(late, monkeypatch):
    """Over CAPTURE_BUDGET the trace takes one pass (no detection pass) keeping each layer's terms at the
    candidates; a traced position that was not a candidate from the first layer is read again, from the
    text up to it (or the whole text where that does not match the full pass): the tables are the same.
    With a mixture of experts a detection pass comes first, on the kernel too; rows past the buffers are copies."""
    model, tokens = _planted()
    seen = _paths(monkeypatch)
    whole = trace_origin(model, tokens)
    monkeypatch.setattr(targets_module, "CAPTURE_BUDGET", 0)
    passes = []
    real, one = capture_module.capture, one_pass_module.capture_one_pass
    monkeypatch.setattr(targets_module, "capture", lambda *a, **k: passes.append(a[1].tokens.shape[1]) or real(*a, **k))
    monkeypatch.setattr(targets_module, "capture_one_pass", lambda *a, **k: passes.append(a[1].tokens.shape[1]) or one(
        *a, **k))
    if late in ("prefix", "whole"):  # no candidate at the first layer
        calls, candidates = [], capture_module.candidates
        monkeypatch.setattr(capture_module, "candidates", lambda mag, scale, loose: calls.append(0) or (
            candidates(mag, scale, loose) & (len(calls) > 1)))
    if late == "whole":
        monkeypatch.setattr(targets_module, "PREFIX_TOL", -1.0)
    if late == "copies":
        monkeypatch.setattr(one_pass_module, "KEPT_ROWS", 0)
    if late == "detection":
        monkeypatch.setattr(targets_module, "find_experts", lambda model, mlp: object())
    one = trace_origin(model, tokens)
    assert seen == ["lse"] * (3 if late == "detection" else 2) or (late in ("prefix", "whole")
                                                                    and seen[:2] == ["lse"] * 2)
    assert passes == {"none": [LONG], "copies": [LONG], "prefix": [LONG, LONG - 19], "whole": [LONG, LONG - 19, LONG],
                      "detection": []}[late]
    assert one.targets[["pos", "dim"]].values.tolist() == whole.targets[["pos", "dim"]].values.tolist() \
        == [[LONG - 20, 3]]
    _close(one, whole)


def test_from_one_pass_from_tokens_every_entry_takes_the_one_pass(monkeypatch):
    """From ONE_PASS_FROM tokens (lowered here) the trace of every entry is the candidates' one pass, within
    the budget too, with the every-position trace's tables; a given entry still slices its position."""
    model, tokens = _planted()
    whole = trace_origin(model, tokens)
    given = trace_origin(model, tokens, pos=LONG - 20)
    monkeypatch.setattr(targets_module, "ONE_PASS_FROM", LONG)
    kinds = []
    real, one_pass = capture_module.capture, one_pass_module.capture_one_pass
    monkeypatch.setattr(targets_module, "capture_one_pass", lambda *a, **k: kinds.append("one") or one_pass(*a, **k))
    monkeypatch.setattr(trace_module, "capture", lambda *a, **k: kinds.append("sliced") or real(*a, **k))
    one = trace_origin(model, tokens)
    assert kinds == ["one"]
    _close(one, whole)
    _close(trace_origin(model, tokens, pos=LONG - 20), given)
    assert kinds == ["one", "sliced"]


def test_the_one_pass_with_nothing_to_trace_falls_back_to_every_position(monkeypatch):
    """Where the one pass finds nothing massive (at ``dim``) within the budget, the trace is the every-position
    one: a given ``dim`` traces its largest value, no ``dim`` raises the short text's error naming the peak."""
    model, tokens = _planted()
    free = next(d for d in range(model.cfg.d_model) if d != 3)
    below = trace_origin(model, tokens, dim=free)
    with pytest.raises(MassiveLensError) as short:
        trace_origin(model, tokens[:, :LONG - 30])
    monkeypatch.setattr(targets_module, "ONE_PASS_FROM", 1)
    _close(trace_origin(model, tokens, dim=free), below)
    with pytest.raises(MassiveLensError) as one:
        trace_origin(model, tokens[:, :LONG - 30])
    assert str(one.value) == str(short.value)
    monkeypatch.setattr(targets_module, "CAPTURE_BUDGET", 0)  # over the budget: the one pass's own error
    with pytest.raises(MassiveLensError, match="nothing massive to trace"):
        trace_origin(model, tokens[:, :LONG - 30])
