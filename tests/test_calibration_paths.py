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
