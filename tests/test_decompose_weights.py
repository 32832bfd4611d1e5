"""W_O's per-head Gram matrix is kept between calls (attention/output_weights.head_gram, through
core/weight_cache.derived): a weight edited in place between two calls, by any route, must give the new
answer, the one computed with nothing kept."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch.utils.weak import WeakIdKeyDictionary

import massive_lens.core.weight_cache as module
from massive_lens import tiny_model
from massive_lens.attention import decompose_attention
from massive_lens.attention.output_weights import head_gram, output_weights
from massive_lens.core.model_view import ModelView

TEXT = ["The cat sat on the mat, and then it slept.", "Bye now!"]


def _swap_heads(W_O: torch.Tensor) -> None:
    W_O.data[[0, 1]] = W_O.data[[1, 0]].clone()  # same entries, same sum: only where they sit changes


def _scale_head(W_O: torch.Tensor) -> None:
    W_O.data[0].mul_(1.5)


def _copy_under_no_grad(W_O: torch.Tensor) -> None:
    with torch.no_grad():
        W_O._base.copy_(W_O._base.flip(0))


def _new_tensor(W_O: torch.Tensor) -> None:
    W_O._base.data = W_O._base.data * 0.5  # the parameter now holds other memory


EDITS = {"swap two heads through .data": _swap_heads, "one head scaled through .data": _scale_head,
         "copy_ under no_grad": _copy_under_no_grad, "param.data replaced": _new_tensor}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_between_two_calls_gives_the_new_answer(edit, monkeypatch):
    model = tiny_model("llama")
    view = ModelView(model)
    layer = view.n_layers - 1
    param = view.block(layer).attn.W_O._base  # W_O is a view of the output projection's weight
    saved = param.data
    before = decompose_attention(model, TEXT, sinks=[0])
    original = saved.clone()
    try:
        EDITS[edit](view.block(layer).attn.W_O)
        again = decompose_attention(model, TEXT, sinks=[0])
        monkeypatch.setattr(module, "_KEPT", WeakIdKeyDictionary())  # nothing kept
        fresh = decompose_attention(model, TEXT, sinks=[0])
    finally:
        param.data = saved
        param.data.copy_(original)
    pd.testing.assert_frame_equal(again.frame, fresh.frame, check_exact=True)
    content = before.frame[(before.frame.term == "content") & (before.frame.layer == layer)].norm.to_numpy()
    edited = again.frame[(again.frame.term == "content") & (again.frame.layer == layer)].norm.to_numpy()
    assert not (content == edited).all()  # the edit shows in the statistics the Gram matrix gives


def test_the_gram_matrix_is_kept_while_the_weights_are_unchanged():
    view = ModelView(tiny_model("llama"))
    W_O, owner = output_weights(view, 0)[0], view.block(0).attn
    gram = head_gram(W_O, W_O, owner)
    assert torch.equal(gram, W_O @ W_O.transpose(-1, -2))
    assert head_gram(output_weights(view, 0)[0], W_O, owner) is gram  # W_O read again: the same weights
    wide = head_gram(W_O, W_O.double(), owner)  # another dtype: its own product, in that dtype
    assert wide.dtype == torch.float64 and torch.equal(wide, W_O.double() @ W_O.double().transpose(-1, -2))
    assert head_gram(W_O, W_O, owner) is gram
    assert head_gram(W_O, W_O, object()) is not gram  # an owner that cannot keep it: the product taken now
