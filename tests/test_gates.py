"""Gate census (issue 51): the share of shut output gates per layer and head, against the gate
module's own output on a tiny Qwen3-Next (element-wise, from q_proj) and the trained ``gated``
variant (head-wise)."""

from __future__ import annotations

import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError, tiny_model
from massive_lens.attention.gates import GATE_THRESHOLD, HEAD_WISE, gate_census, gate_sites
from massive_lens.core.model_view import ModelView
from massive_lens.models import byte_tokenizer, wrap_hf_model
from massive_lens.models.tiny import tiny_config
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM

TEXTS = ["Hello there, how are you? Fine, thanks.", "Bye now."]
TOL = 1e-6  # shares of sigmoids in float32


@pytest.fixture(scope="module")
def qwen3_next():
    """A tiny Qwen3-Next bridge whose gate rows of q_proj are scaled up (so that gates spread over
    (0, 1) and some shut), and an independent Hugging Face copy."""
    tok = byte_tokenizer()
    cls, config = tiny_config("qwen3_next", tok, {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = cls(config).eval()
    d = config.head_dim
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                w = attn.q_proj.weight.view(config.num_attention_heads, 2 * d, -1)
                w[:, d:] *= 40.0  # [Q | gate] per head
    ref = cls(config).eval()
    ref.load_state_dict(hf.state_dict())
    return wrap_hf_model(hf, tok, name="tiny-qwen3_next"), ref, config


def test_qwen3_next_equals_the_gate_modules_output(qwen3_next):
    """The gate transformers applies (sigmoid of q_proj's gate half, read by a hook on the reference
    model's q_proj) gives the census's shut share, mean gate and first-token gate, per head."""
    model, ref, config = qwen3_next
    with untouched(model):
        census = gate_census(model, TEXTS)
    view = ModelView(model)
    batch = view.tokenize(TEXTS)
    seen = {}
    handles = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out))
               for i, layer in enumerate(ref.model.layers) if getattr(layer, "self_attn", None) is not None]
    try:
        with torch.no_grad():
            ref(batch.tokens, attention_mask=batch.mask.long())
    finally:
        for h in handles:
            h.remove()
    assert census.kind.startswith("element-wise") and sorted(seen) == sorted(census.to_frame().layer.unique())
    frame = census.to_frame()
    for layer, out in seen.items():
        gate = torch.sigmoid(out.view(*out.shape[:2], config.num_attention_heads, 2 * config.head_dim)
                             [..., config.head_dim:])  # [batch pos head d_head]
        real = gate[batch.mask]
        mine = frame[frame.layer == layer]
        shut = (real < GATE_THRESHOLD).float().mean((0, 2))
        assert (torch.tensor(mine.shut_share.to_numpy(), dtype=torch.float32) - shut).abs().max() < TOL
        assert (torch.tensor(mine.mean_gate.to_numpy(), dtype=torch.float32) - real.mean((0, 2))).abs().max() < TOL
        first = gate[:, 0].mean((0, 2))
        assert (torch.tensor(mine.first_gate.to_numpy(), dtype=torch.float32) - first).abs().max() < TOL
        assert 0 < shut.mean() < 1  # the scaled gates spread: the test sees shut and open ones
        widest = gate.mean(-1)[0, :, 0].argmax()  # head 0's widest-open position in the first text
        assert f"@{int(widest)}" in mine.open_tokens.iloc[0].split(" ")[0]


def _gated(seed: int = 1) -> MassiveLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2, attention="gated"), byte_tokenizer())
        with torch.no_grad():
            for block in model.blocks:
                block.attn.variant.W_G.mul_(8.0)
                block.attn.variant.b_G.fill_(-1.0)
    return model.eval()


def test_gated_variant_equals_its_gate():
    """The head-wise gate against what it does: the gated heads' output (hook_z) over the ungated
    one (the pattern times the values), per token and head."""
    model = _gated()
    with untouched(model):
        census = gate_census(model, TEXTS[0])
    assert census.kind == HEAD_WISE
    view = ModelView(model)
    batch = view.tokenize(TEXTS[0])
    frame = census.to_frame()
    for layer in range(model.cfg.n_layers):
        pattern = view.activation(batch, f"blocks.{layer}.attn.hook_pattern")  # [batch head q k]
        v = view.activation(batch, f"blocks.{layer}.attn.hook_v")  # [batch pos head d]
        z = view.activation(batch, f"blocks.{layer}.attn.hook_z")
        ungated = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        gate = (z * ungated).sum(-1) / (ungated * ungated).sum(-1)  # [batch pos head]: z = gate * ungated
        mine = frame[frame.layer == layer]
        assert (torch.tensor(mine.mean_gate.to_numpy(), dtype=torch.float32) - gate[0].mean(0)).abs().max() < 1e-5
        shut = (gate[0] < GATE_THRESHOLD).float().mean(0)
        assert torch.equal(torch.tensor(mine.shut_share.to_numpy(), dtype=torch.float32), shut)


def test_gate_sites_and_refusals():
    assert gate_sites(ModelView(tiny_model("llama"))) == ("", [])
    assert gate_sites(ModelView(_gated())) == (HEAD_WISE, [0, 1])
    with pytest.raises(MassiveLensError, match="no output gate"):
        gate_census(tiny_model("llama"), "Hello.")
    with pytest.raises(MassiveLensError, match="no output gate"):
        gate_sites(ModelView(tiny_model("llama")), required=True)
    for bad in (0.0, 1.0, float("nan")):  # the open interval (0, 1), core.checks' number rule
        with pytest.raises(MassiveLensError, match=r"threshold \(a gate value\) must be a"):
            gate_census(_gated(), "Hello.", threshold=bad)


def test_threshold_and_round_trip(tmp_path, qwen3_next):
    import massive_lens

    model = qwen3_next[0]
    low, high = gate_census(model, TEXTS, threshold=0.01), gate_census(model, TEXTS, threshold=0.5)
    assert (low.to_frame().shut_share <= high.to_frame().shut_share).all() and low.shut_share < high.shut_share
    back = massive_lens.load(high.save(tmp_path / "gates"))
    assert back.to_frame().equals(high.to_frame()) and "gates shut" in high.summary() and high.plot() is not None
