"""sink_circuit on the fused kernel (issue 50): with the rotary cos/sin read from the kernel's module
inputs the capture takes the LSE path from LSE_FROM tokens, and the split, the heads' table and the causal
check it gives equal the eager path's within float32 rounding on every tiny family (gpt2: no rotary)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import untouched
from test_sink_circuit import LOW, _with_biases

import massive_lens.core.attention_pass as attention_pass
from massive_lens import tiny_model
from massive_lens.attention import sink_circuit
from massive_lens.attention.circuit_split import CircuitCapture
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView

TOL = 1e-5  # relative to the table's largest entry: float32 sums over the same terms in another order


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns) and len(a) == len(b) > 0
    for col in a.columns:
        x, y = a[col], b[col]
        if col == "est_seconds":  # a time
            continue
        if pd.api.types.is_float_dtype(x):
            scale = max(float(x.abs().max()) if x.notna().any() else 0.0, 1.0)
            torch.testing.assert_close(torch.tensor(y.to_numpy()), torch.tensor(x.to_numpy()), rtol=0,
                                       atol=TOL * scale, equal_nan=True, msg=col)
        else:
            assert x.tolist() == y.tolist(), col


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt2"])
def test_split_and_causal_check_equal_on_both_paths(family, monkeypatch):
    model = _with_biases(tiny_model(family))
    tokens = torch.randint(1, model.cfg.d_vocab, (6, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(n_heads=3, rule=LOW, corpus=tokens[2:], n_seqs=4, seq_len=40, progress=False)
    view = ModelView(model)
    assert CircuitCapture(view, view.full_batch(tokens[:2]), [0], Criterion()).path == "eager"
    eager = sink_circuit(model, tokens[:2], **kw)
    monkeypatch.setattr(attention_pass, "LSE_FROM", 2)  # "auto" takes the kernel from 2 tokens
    assert CircuitCapture(view, view.full_batch(tokens[:2]), [0], Criterion()).path == "lse"
    with untouched(model):
        lse = sink_circuit(model, tokens[:2], **kw)
    _same(eager.frame, lse.frame)
    _same(eager.heads, lse.heads)
    _same(eager.causal, lse.causal)
    assert len(eager.causal) and eager.verdicts()["verdict"].tolist() == lse.verdicts()["verdict"].tolist()
