"""The one attention pass: each path hands every layer the same readings, which match the eager
pattern and hooks read independently; an attached edit is read; the model is left as it was."""

import pytest
import torch
from matrix import build

from massive_lens import tiny_model
from massive_lens.attention import find_sinks
from massive_lens.core.attention_pass import LSE_FROM, attention_pass, choose_path
from massive_lens.core.criterion import SinkEvidence, key_attention
from massive_lens.core.lse import EAGER, LSE
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError

TEXTS = ["Hello there, world. The cat sat on the mat.", "Bye now!"]


def _long(view, n=LSE_FROM):
    """A batch of ``n`` positions, for choosing the path only (a tiny model's context may be shorter)."""
    return Batch(torch.ones(1, n, dtype=torch.long), torch.ones(1, n, dtype=torch.bool), False)


def _reference(view, batch, layer):
    """The pattern, values and heads' outputs of ``layer`` from a plain hooked forward."""
    names = {k: view.hook_name(layer, f"attn.hook_{k}") for k in ("pattern", "v", "z")}
    seen = {}
    hooks = [(n, lambda x, hook, k=k: seen.__setitem__(k, x.detach().clone())) for k, n in names.items()]
    view.forward(batch, hooks, stop_after=view.hook_name(layer, "resid_post"))
    return seen


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("path", [EAGER, LSE])
def test_each_path_reads_what_the_eager_hooks_see(family, path):
    view = ModelView(tiny_model(family))
    batch = view.tokenize(TEXTS)
    cols = torch.tensor([0, 2, 5])
    got = {}
    attention_pass(view, batch, lambda at: got.__setitem__(at.layer, at), path=path, columns=cols, band=True,
                   want=("z", "z_read", "v"))
    assert sorted(got) == list(range(view.n_layers))
    for layer, at in got.items():
        ref = _reference(view, batch, layer)
        pattern, real = ref["pattern"].float(), batch.mask
        assert at.shape == tuple(pattern.shape)
        rows = real[:, None, :, None]  # padded queries attend differently on the two paths; they are never read
        torch.testing.assert_close((at.cols.float() * rows), pattern[..., cols] * rows, atol=1e-5, rtol=1e-4)
        mass, count = key_attention(pattern, real)
        torch.testing.assert_close(at.band[0], mass, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(at.band[1], count)
        torch.testing.assert_close(at.v.float(), ref["v"].float(), atol=1e-5, rtol=1e-4)
        q = real[:, :, None, None]
        torch.testing.assert_close(at.z.float() * q, ref["z"].float() * q, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(at.z_read.float() * q, ref["z"].float() * q, atol=1e-5, rtol=1e-4)


def test_the_evidence_is_the_same_on_both_paths():
    view = ModelView(tiny_model("llama"))
    batch = view.tokenize(TEXTS)
    shares = []
    for path in (EAGER, LSE):
        evidence = SinkEvidence(batch.mask, view.n_layers)
        attention_pass(view, batch, None, path=path, evidence=evidence)
        assert evidence.n_heads > 0
        shares.append(evidence.head_share)
    torch.testing.assert_close(shares[0], shares[1], atol=1e-6, rtol=0)


def test_an_attached_edit_is_read():
    model = tiny_model("llama")
    view = ModelView(model)
    batch = view.tokenize(TEXTS[:1])
    name = view.hook_name(1, "attn.hook_pattern")

    def flat(pattern, hook):  # every query attends to the first token only
        out = torch.zeros_like(pattern)
        out[..., 0] = 1.0
        return out

    cols = {}
    with model.hooks(fwd_hooks=[(name, flat)]):
        path = choose_path(view, "auto", _long(view))  # above the crossover: the edit decides
        attention_pass(view, batch, lambda at: cols.__setitem__(at.layer, at.cols), path=path, columns=[0])
        with pytest.raises(MassiveLensError, match="hooks attached"):
            choose_path(view, LSE, batch)
    assert path == EAGER
    assert bool((cols[1] == 1).all()) and not bool((cols[0] == 1).all())


@pytest.mark.parametrize("path", [EAGER, LSE])
def test_the_model_is_left_as_it_was_when_a_reducer_fails(path):
    model = tiny_model("llama")
    view = ModelView(model)
    batch = view.tokenize(TEXTS[:1])
    with torch.no_grad():
        before = model(batch.tokens)

    def fail(at):
        raise RuntimeError("reducer failed")

    with pytest.raises(RuntimeError, match="reducer failed"):
        attention_pass(view, batch, fail, path=path, columns=[0])
    assert not any(hp._forward_hooks for hp in model.hook_dict.values())
    assert choose_path(view, "auto", _long(view)) == LSE  # nothing left attached that the LSE path would skip
    with torch.no_grad():
        torch.testing.assert_close(model(batch.tokens), before)


def test_bad_requests_are_refused():
    view = ModelView(tiny_model("llama"))
    batch = view.tokenize(TEXTS[:1])
    with pytest.raises(MassiveLensError, match="want"):
        attention_pass(view, batch, None, path=EAGER, want=("pattern",))
    with pytest.raises(MassiveLensError, match="out_hooks"):
        attention_pass(view, batch, None, path=EAGER, want=("out",))
    with pytest.raises(MassiveLensError, match="path"):
        attention_pass(view, batch, None, path="fast")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_auto_takes_the_eager_path_below_the_crossover_and_the_lse_path_from_it(family, monkeypatch):
    model = tiny_model(family)
    view = ModelView(model)
    assert [choose_path(view, "auto", _long(view, n)) for n in (LSE_FROM - 1, LSE_FROM)] == [EAGER, LSE]
    # either path is there when asked for by name, at any length
    assert choose_path(view, LSE, _long(view, 8)) == LSE and choose_path(view, EAGER, _long(view)) == EAGER
    with pytest.raises(MassiveLensError, match="attention must be one of"):
        choose_path(view, "fast", _long(view, 8))
    # the analyses ask the pass (a crossover within the tiny model's context): the same sinks on either side
    text = "Hello there, world. The cat sat on the mat."
    n = view.tokenize(text).tokens.shape[1]
    found = {}
    for crossover in (n + 1, n):
        monkeypatch.setattr("massive_lens.core.attention_pass.LSE_FROM", crossover)
        found[crossover] = find_sinks(model, text)
    assert (found[n + 1].attention, found[n].attention) == (EAGER, LSE)
    assert torch.equal(found[n + 1].mask, found[n].mask)


def test_the_eager_path_reads_a_latent_attention_bridge_as_the_lse_path_does():
    """DeepSeek-V2's bridge hands ``hook_v`` as [batch head key d_head] and ``hook_z`` not split per
    query head; the eager path reads both as the LSE path does (it failed on the values before)."""
    model = build("DeepseekV2ForCausalLM").model
    view = ModelView(model)
    batch = view.tokenize(TEXTS)
    got = {EAGER: {}, LSE: {}}
    for path, seen in got.items():
        attention_pass(view, batch, lambda at, seen=seen: seen.__setitem__(at.layer, at), path=path, columns=[0],
                       want=("z", "z_read", "v"))
    assert sorted(got[EAGER]) == sorted(got[LSE]) and got[EAGER]
    q = batch.mask[:, :, None, None]  # padded queries attend differently on the two paths; they are never read
    for layer, at in got[EAGER].items():
        lse = got[LSE][layer]
        torch.testing.assert_close(at.v.float(), lse.v.float(), atol=1e-5, rtol=1e-4)
        for name in ("z", "z_read"):
            eager, kernel = getattr(at, name).float() * q, getattr(lse, name).float() * q
            torch.testing.assert_close(eager, kernel, atol=1e-5, rtol=1e-4)
