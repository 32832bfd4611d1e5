"""calibrate reads its sink statistics from the one attention pass: on the eager and the LSE path they
are the means of what a plain hooked forward shows at the calibration's own sinks."""

import pytest
import torch

from massive_lens import MassiveLensError, tiny_model
from massive_lens.attention.sinks import sink_term
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import calibrate

TEXT = "Calibration text, with a comma. And a second sentence! " * 6


def _reference(model, tokens, sinks, layer):
    """Per head: the mean sink term and attention to the sinks over non-sink queries, the mean key
    (after rotary) and value over sink keys, from the eager hooks."""
    view = ModelView(model)
    key = "attn.hook_rot_k" if view.has_hook(layer, "attn.hook_rot_k") else "attn.hook_k"
    seen = {}
    hooks = [(view.hook_name(layer, h), lambda x, hook, h=h: seen.__setitem__(h, x.detach().double()))
             for h in ("attn.hook_pattern", "attn.hook_v", key)]
    view.forward(view.full_batch(tokens), hooks, stop_after=view.hook_name(layer, "resid_post"))
    pattern, v, k = seen["attn.hook_pattern"], seen["attn.hook_v"], seen[key]
    queries, s = (~sinks).double(), sinks.double()
    return {"sink_mass": torch.einsum("bhqk,bk,bq->h", pattern, s, queries) / queries.sum(),
            "sink_z": torch.einsum("bqhd,bq->hd", sink_term(pattern, v, sinks), queries) / queries.sum(),
            "sink_k": torch.einsum("bkhd,bk->hd", k, s) / s.sum(),
            "sink_v": torch.einsum("bkhd,bk->hd", v, s) / s.sum()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["eager", "lse"])
def test_sink_statistics_are_the_hooks_means_on_either_path(family, attention):
    model = tiny_model(family)
    tokens = sequences(ModelView(model), TEXT, 16, 3)
    calib = calibrate(model, tokens, batch_size=2, attention=attention, progress=False)
    assert calib.attn_layers
    for layer in calib.attn_layers:
        ref = _reference(model, tokens, calib.sinks.mask, layer)
        for name, want in ref.items():
            torch.testing.assert_close(getattr(calib, name)[layer].double(), want, atol=1e-6, rtol=1e-5)


def test_a_path_that_cannot_run_is_refused():
    with pytest.raises(MassiveLensError, match="attention must be one of"):
        calibrate(tiny_model("llama"), TEXT, seq_len=16, n_seqs=2, attention="fast", progress=False)


@pytest.mark.real
@pytest.mark.slow
def test_the_default_model_calibrates_alike_on_both_paths(default_model):
    """SmolLM2 at 4 x 64 tokens: the same sinks and massive dims, the sink statistics to float rounding
    (measured 5e-7 at most at 8 x 128), the residual-derived pool to the kernel's rounding of the stream."""
    text = "The history of the city begins in the Roman era, when a fort stood by the river. " * 20
    eager, lse = (calibrate(default_model, text, seq_len=64, n_seqs=4, attention=a, progress=False)
                  for a in ("eager", "lse"))
    assert torch.equal(eager.sinks.mask, lse.sinks.mask) and eager.attn_layers == lse.attn_layers
    assert {k: v.tolist() for k, v in eager.dims.items()} == {k: v.tolist() for k, v in lse.dims.items()}
    for name in ("sink_z", "sink_k", "sink_v", "sink_mass"):
        torch.testing.assert_close(getattr(lse, name), getattr(eager, name), atol=1e-5, rtol=1e-4, equal_nan=True)
    torch.testing.assert_close(lse.pool, eager.pool, atol=0, rtol=1e-5)
