"""trace_origin reads the attention through the one attention pass: on the path ``choose_path`` takes
(the fused kernel from ``LSE_FROM`` tokens, lowered here to fit the tiny models' context), with the same
tables as the eager pattern's to rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from massive_lens import tiny_model, trace_origin
from massive_lens.core import attention_pass
from massive_lens.origin import capture as capture_module
from massive_lens.origin import targets as targets_module

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


def test_the_detection_pass_runs_on_the_kernel_and_finds_the_same_targets(monkeypatch):
    model = tiny_model("llama")
    tokens = _long(model, LONG)
    tokens[0, LONG - 20] = 7  # a token whose embedding carries a massive value in dim 3
    with torch.no_grad():
        model.original_model.get_input_embeddings().weight[7, 3] = 500.0
    seen = _paths(monkeypatch)
    whole = trace_origin(model, tokens, dim=3)
    monkeypatch.setattr(targets_module, "CAPTURE_BUDGET", 0)  # the detection pass first, then the capture
    detected = trace_origin(model, tokens, dim=3)
    assert seen == ["lse", "lse", "lse"]  # the whole capture; the detection and the capture
    assert detected.targets[["pos", "dim"]].values.tolist() == whole.targets[["pos", "dim"]].values.tolist() \
        == [[LONG - 20, 3]]
    _close(detected, whole)
