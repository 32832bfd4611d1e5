"""The off-switch protocol (issue 51): side by side on tiny models of each kind, on a planted
massive activation, on trained task runs, and from the command line."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from helpers import untouched

from massive_lens import load_model, tiny_model
from massive_lens.attention.null_mass import null_mass
from massive_lens.cli import main
from massive_lens.core.model_view import ModelView
from massive_lens.handover.offswitch import FLOAT16_MAX, offswitch
from massive_lens.handover.precision import precision_check
from massive_lens.models import byte_tokenizer
from massive_lens.models.tiny import tiny_config
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM
from massive_lens.train.offswitch_runs import offswitch_task_runs, where_table
from massive_lens.train.taskrun import train_task
from massive_lens.train.tasksettings import TaskSettings

TEXT = "Hello there, how are you? Fine, thanks. Bye now."
PLANT = (1, 0, 3)  # layer, position, dim


def _sinks(model, value: float):
    with torch.no_grad():
        for module in model.original_model.modules():
            if hasattr(module, "sinks"):
                module.sinks.fill_(value)
    return model


def test_gpt_oss_side_by_side():
    """The null-mass column is null_mass's per-layer mean; a high sink logit sends idle attention to the slot."""
    model = _sinks(tiny_model("gpt_oss"), 6.0)
    with untouched(model):
        result = offswitch(model, TEXT, precision=False)
    frame = result.to_frame()
    heads = null_mass(model, TEXT).to_frame().groupby("layer")["null_mass"].mean()
    assert (frame["null_mass"].to_numpy() - heads.to_numpy()).max() < 1e-6
    assert result.idle == "sink slot" and frame["gate_shut"].isna().all() and frame["full_attention"].all()
    assert result.spikes_before_attention is None  # every layer is full attention
    low = offswitch(_sinks(tiny_model("gpt_oss"), -20.0), TEXT, precision=False).to_frame()
    assert (low["null_mass"] < frame["null_mass"]).all() and (low["first_mass"] > frame["first_mass"]).all()


def _planted(value: float):
    layer, pos, dim = PLANT

    def add(x, hook):
        x = x.clone()
        x[:, pos, dim] += value
        return x

    return f"blocks.{layer}.hook_resid_post", add


@pytest.mark.parametrize("value,kind", [(5000.0, "token-specific massive activation"),
                                        (0.0, "no massive activation (broad growth)")])
def test_residual_peak(value, kind):
    model = tiny_model("llama")
    with model.hooks(fwd_hooks=[_planted(value)]):
        result = offswitch(model, TEXT, precision=False)
    assert result.residual == kind and result.float16 == "fits" and not result.first_overflow
    if value:
        row = result.to_frame().iloc[PLANT[0]]
        assert (row.peak_pos, row.peak_dim, row.massive_tokens, row.massive_dims) == (PLANT[1], PLANT[2], 1, 1)
        assert row.top1_share > 0.99 and result.peak_layer >= PLANT[0]


def test_float16_names_the_first_overflowing_site():
    """Predicted (peaks past 65,504) and measured (precision_check, confirmed by a float16 run):
    both name the planted layer first."""
    model = tiny_model("llama")
    with model.hooks(fwd_hooks=[_planted(2 * FLOAT16_MAX)]):
        predicted = offswitch(model, TEXT, precision=False)
        check = precision_check(model, TEXT, dtypes=("float16",), seq_len=12, n_seqs=1)
    assert predicted.float16 == "overflows"
    assert predicted.first_overflow.startswith(f"blocks.{PLANT[0]}.hook_resid_post")
    first = check.first_overflow("float16")
    assert check.verdict("float16") == "unsafe" and f"layer {PLANT[0]}" in first and "first overflowing site" in \
        check.summary()
    assert precision_check(tiny_model("llama"), TEXT, dtypes=("float16",), seq_len=12, n_seqs=1,
                           confirm=False).first_overflow("float16") == ""


def _gated(bias: float) -> MassiveLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2, attention="gated"), byte_tokenizer())
    with torch.no_grad():
        for block in model.blocks:
            block.attn.variant.b_G.fill_(bias)
    return model.eval()


def test_gate_and_hybrid():
    shut = offswitch(_gated(-10.0), TEXT, precision=False)
    assert shut.idle == "output gate" and (shut.to_frame()["gate_shut"] == 1.0).all()
    assert offswitch(_gated(10.0), TEXT, precision=False).to_frame()["gate_shut"].max() == 0.0
    hybrid = offswitch(tiny_model("qwen3_next"), TEXT)
    frame = hybrid.to_frame()
    assert frame["full_attention"].tolist() == [False, False, False, True]  # linear, linear, linear, full
    assert frame["first_mass"].isna().tolist() == [True, True, True, False]
    assert hybrid.spikes_before_attention == (hybrid.peak_layer == 2) and hybrid.float16 == "safe"


def test_task_runs_reproduce_and_cache(tmp_path):
    """A run retrained from its settings reproduces its recorded first-token mass; the cache gives the same row."""
    settings = TaskSettings.of("trigger_conditional", variant="learned_sink", steps=3, eval_every=3, eval_seqs=4,
                               batch_size=4, d_model=16, n_heads=2, task_options=dict(seq_len=8))
    train_task(settings, tmp_path / "runs" / settings.name / "seed0")
    first = offswitch_task_runs(tmp_path / "runs", variants=["learned_sink"], cache=tmp_path / "cache")
    again = offswitch_task_runs(tmp_path / "runs", variants=["learned_sink"], cache=tmp_path / "cache")
    assert len(first) == 1 and first.reproduced.iloc[0] < 1e-5 and first.equals(again)
    assert first.kind.iloc[0] == "learned_sink" and 0 < first.null_max.iloc[0] < 1 and math.isnan(
        first.gate_shut_max.iloc[0])
    assert "| learned_sink-pre | 1 |" in where_table(first)


def test_command(tmp_path, capsys):
    out = tmp_path / "offswitch.md"
    assert main(["offswitch", "--model", "tiny:gpt_oss", "--no-precision", "--out", str(out)]) == 0
    assert "idle attention goes to" in capsys.readouterr().out and "| layer | full_attention |" in out.read_text()
    assert main(["offswitch"]) == 2 and "name a model" in capsys.readouterr().err


def test_report_part_only_where_the_model_has_an_off_switch():
    from massive_lens.report.offswitch_section import off_switch_part
    from massive_lens.report.render import Section

    for family, expected in (("gpt_oss", "null mass"), ("qwen3_next", "output gates"), ("llama", None)):
        s = Section("Attention")
        off_switch_part(tiny_model(family), [TEXT], s)
        captions = [caption for kind, _, caption in s.blocks if kind == "table"]
        assert (captions == []) if expected is None else (len(captions) == 1 and expected in captions[0]), family


def test_reads_the_attention_from_the_pass_at_any_length(monkeypatch):
    """The protocol, the task runs' first-token mass and the outlier statistics read their layers from
    the one attention pass (no pattern hook of their own: issue 50); past LSE_FROM tokens the pass takes
    the kernel's path, and the first-token and null mass match the eager pattern's (null_mass, eager)."""
    import importlib
    import pathlib
    import re

    from massive_lens.core.attention_pass import LSE_FROM

    module = importlib.import_module("massive_lens.handover.offswitch")  # the package's name is the function

    src = pathlib.Path(module.__file__).parents[1]
    for name in ("handover/offswitch.py", "train/offswitch_runs.py", "quant/outlier_stats.py"):
        hits = re.findall(r"hook_pattern|hook_attn_scores|hook_slot_pattern", (src / name).read_text())
        assert not hits, (name, hits)
    paths = []
    real = module.choose_path
    monkeypatch.setattr(module, "choose_path", lambda *a, **k: paths.append(real(*a, **k)) or paths[-1])
    model = _sinks(tiny_model("gpt_oss", max_position_embeddings=2 * LSE_FROM), 1.0)
    tokens = torch.randint(1, model.cfg.d_vocab, (1, LSE_FROM + 8), generator=torch.Generator().manual_seed(0))
    with untouched(model):
        frame = offswitch(model, tokens, precision=False).to_frame()
    eager = null_mass(model, tokens, attention="eager").to_frame().groupby("layer")
    assert paths == ["lse"]
    for col, heads in (("first_mass", eager["first_mass"].mean()), ("null_mass", eager["null_mass"].mean()),
                       ("first_head_max", eager["first_mass"].max()), ("null_head_max", eager["null_mass"].max())):
        assert (frame[col].to_numpy() - heads.to_numpy()).max() < 1e-5, col


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_nnsight_twin_gives_the_eager_models_table(family):
    """offswitch on an nnsight model over the same weights as a bridge (a massive BOS activation planted in both):
    the same table, kind, idle attention and residual verdict; the nnsight model left as found. (Stopped in
    gates.gate_sites before, which read TransformerLens-style weights the nnsight view does not serve.)"""
    cls, config = tiny_config(family, byte_tokenizer(), {})
    torch.manual_seed(0)
    hfs = [cls(config).eval()]
    hfs.append(cls(config).eval())
    hfs[1].load_state_dict(hfs[0].state_dict())
    for hf in hfs:
        with torch.no_grad():
            hf.get_input_embeddings().weight[byte_tokenizer().bos_token_id, 3] = 400.0
    bridge = load_model(hfs[0], tokenizer=byte_tokenizer(), name=f"tiny-{family}")
    lm = load_model(hfs[1], tokenizer=byte_tokenizer(), backend="nnsight", name=f"tiny-{family}")
    tokens = ModelView(bridge).tokenize(TEXT, prepend_bos=True).tokens  # the same tokens (Qwen2: no BOS by default)
    with untouched(hfs[1]):
        a, b = offswitch(bridge, tokens, precision=False), offswitch(lm, tokens, precision=False)
    assert bool((b.to_frame()["first_mass"] > 0).all())  # every layer's first-token mass read on nnsight, no NaN
    pd.testing.assert_frame_equal(a.to_frame(), b.to_frame(), rtol=1e-5, atol=1e-6)
    assert (a.kind, a.idle, a.residual, a.float16) == (b.kind, b.idle, b.residual, b.float16)
