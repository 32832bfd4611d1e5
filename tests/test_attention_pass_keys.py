"""The attention pass's keys (``want="k"``): both paths hand the keys the scores use (after any rotary
embedding), as a plain hooked forward reads them; ``eager_reads`` leaves a layer's keys and values out
on the eager path (a capability the caller knows) and never on the LSE path."""

import pytest
import torch

from massive_lens import tiny_model
from massive_lens.core.attention_pass import attention_pass
from massive_lens.core.lse import EAGER, LSE
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

TEXTS = ["Hello there, world. The cat sat on the mat.", "Bye now!"]


def _reference(view, batch, layer):
    """From a plain hooked forward at ``layer``: the keys hook that holds them as the scores use them, the
    queries likewise, and the scores."""
    rot = view.has_hook(layer, "attn.hook_rot_k")
    names = {"k": "attn.hook_rot_k" if rot else "attn.hook_k", "q": "attn.hook_rot_q" if rot else "attn.hook_q",
             "scores": "attn.hook_attn_scores"}
    seen = {}
    hooks = [(view.hook_name(layer, h), lambda x, hook, key=key: seen.__setitem__(key, x.detach().clone()))
             for key, h in names.items()]
    view.forward(batch, hooks, stop_after=view.hook_name(layer, "resid_post"))
    return seen


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_both_paths_hand_the_keys_the_scores_use(family):
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXTS)
    got = {EAGER: {}, LSE: {}}
    for path, seen in got.items():
        attention_pass(view, batch, lambda at, seen=seen: seen.__setitem__(at.layer, at), path=path, columns=[0],
                       want=("k",))
    assert sorted(got[EAGER]) == sorted(got[LSE]) == list(range(view.n_layers))
    real = batch.mask[:, :, None, None]  # padded keys are masked out of every score
    for layer, at in got[EAGER].items():
        ref = _reference(view, batch, layer)
        assert at.k.shape == ref["k"].shape and at.v is None
        torch.testing.assert_close(at.k * real, ref["k"] * real, atol=0, rtol=0)  # the hook itself
        k = got[LSE][layer].k.float()
        torch.testing.assert_close(k * real, ref["k"].float() * real, atol=1e-5, rtol=1e-4)
        # independently: the kernel's keys times the queries are the scores, up to the one scale
        group = ref["q"].shape[2] // k.shape[2]
        qk = torch.einsum("bqhd,bkhd->bhqk", ref["q"].float(), k.repeat_interleave(group, 2))
        n = qk.shape[-1]
        seen = batch.mask[:, None, :, None] & batch.mask[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
        seen = seen.expand_as(qk)
        torch.testing.assert_close(ref["scores"].float()[seen], qk[seen] * ref["q"].shape[-1] ** -0.5,
                                   atol=1e-5, rtol=1e-4)


def test_eager_reads_leave_a_layer_out_on_the_eager_path_only():
    view = ModelView(tiny_model("llama"))
    batch = view.tokenize(TEXTS[:1])
    got = {EAGER: {}, LSE: {}}
    for path, seen in got.items():
        attention_pass(view, batch, lambda at, seen=seen: seen.__setitem__(at.layer, at), path=path,
                       want=("k", "v", "z"), eager_reads={"k": [1], "v": [0, 1]})
    eager, lse = got[EAGER], got[LSE]
    assert eager[1].k is not None and all(eager[layer].k is None for layer in eager if layer != 1)
    assert all(eager[layer].v is None and eager[layer].z is None for layer in eager if layer > 1)
    assert eager[0].v is not None and eager[0].z is not None
    assert all(at.k is not None and at.v is not None and at.z is not None for at in lse.values())
    torch.testing.assert_close(eager[1].k.float(), lse[1].k.float(), atol=1e-5, rtol=1e-4)
    with pytest.raises(MassiveLensError, match="eager_reads"):
        attention_pass(view, batch, None, path=EAGER, eager_reads={"z": [0]})
