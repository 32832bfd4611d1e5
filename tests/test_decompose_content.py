"""decompose_attention takes the content term as the attention output less the sink term and b_O,
through W_O only on the check rows (finding the sinks on a long text: through W_O at every row): on
every row it must equal the heads' outputs from the non-sink keys through W_O, computed here from the
model's own pattern, values and W_O."""

from __future__ import annotations

import pytest
import torch

from massive_lens.attention import decompose_attention
from massive_lens.attention.output_weights import CHECK_ROWS, check_rows
from massive_lens.core.model_view import ModelView

TEXT = "The cat sat on the mat. It slept, and then, much later, it woke: the mat was warm. "


@pytest.mark.parametrize("split", ["layers together", "one layer at a time"])
@pytest.mark.parametrize("hold", ["whole", "check rows"])
@pytest.mark.parametrize("sinks", [None, [0, 5]])
def test_content_is_the_other_keys_through_W_O_at_every_row(tiny, sinks, hold, split, monkeypatch):
    """The output is held whole on a short text, its check rows only on a long one (set here by the
    budget); the layers are split together on a short text, one at a time on a long one: the content
    term is the same."""
    import massive_lens.attention.decompose as module

    if hold == "check rows":
        monkeypatch.setattr(module, "HOLD_OUTPUT_BYTES", 0)
    if split == "one layer at a time":
        monkeypatch.setattr(module, "SPLIT_BYTES", 1)
    view = ModelView(tiny)
    batch = view.tokenize(TEXT)
    n = batch.tokens.shape[1]
    assert n > CHECK_ROWS and len(check_rows(n, "cpu")) < n  # rows the check does not take through W_O
    result = decompose_attention(tiny, TEXT, sinks=sinks, attention="eager")
    names = {"attn.hook_pattern", "attn.hook_v"}
    _, cache = tiny.run_with_cache(batch.tokens, names_filter=lambda name: any(name.endswith(x) for x in names))
    keys = result.sink_mask.float()  # [batch key]
    for i, layer in enumerate(result.layers):
        pattern = cache[view.hook_name(layer, "attn.hook_pattern")]  # [batch head query key]
        v = cache[view.hook_name(layer, "attn.hook_v")]
        v = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)  # [batch key head d_head]
        other = pattern * (1 - keys)[:, None, None, :]
        z_content = torch.einsum("bhqk,bkhd->bqhd", other, v)
        W_O = view.block(layer).attn.W_O.detach()
        expected = torch.einsum("bqhd,hdm->bqm", z_content, W_O)
        scale = float(expected.abs().max())
        assert float((result.content[i] - expected).abs().max()) <= 1e-5 * scale, layer


def test_layers_split_together_or_one_at_a_time_give_the_same_tables(tiny, monkeypatch):
    """The split's batching of layers changes no number beyond float32 rounding: terms, errors, statistics."""
    import massive_lens.attention.decompose as module

    together = decompose_attention(tiny, [TEXT, "Short one."])
    monkeypatch.setattr(module, "SPLIT_BYTES", 1)
    alone = decompose_attention(tiny, [TEXT, "Short one."])
    assert together.layers == alone.layers and len(together.layers) > 1
    for name in ("sink", "content", "bias"):
        torch.testing.assert_close(getattr(together, name), getattr(alone, name), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(together.errors.values), torch.tensor(alone.errors.values),
                               rtol=0.5, atol=1e-6)  # each a rounding error itself
    numbers = ["norm", "rel_std_pos", "cos_pos", "rel_std_text", "cos_text"]
    assert together.frame[["layer", "head", "term"]].equals(alone.frame[["layer", "head", "term"]])
    torch.testing.assert_close(torch.tensor(together.frame[numbers].values), torch.tensor(alone.frame[numbers].values),
                               rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("head_dim", [8, 32])  # heads x d_head below and above d_model
@pytest.mark.parametrize("hold", ["whole", "check rows"])
@pytest.mark.parametrize("sinks", [None, [0, 5]])
def test_heads_that_do_not_fill_d_model_split_alike(head_dim, sinks, hold, monkeypatch):
    """z is held inside each layer's term where heads x d_head fits d_model, apart where it does not: the
    content term is the other keys through W_O at every row either way (the check above, on such a model)."""
    from massive_lens import tiny_model

    model = tiny_model("llama", head_dim=head_dim)
    assert model.cfg.n_heads * model.cfg.d_head != model.cfg.d_model
    test_content_is_the_other_keys_through_W_O_at_every_row(model, sinks, hold, "layers together", monkeypatch)
