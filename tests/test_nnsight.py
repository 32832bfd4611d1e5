"""The nnsight backend (:mod:`massive_lens.core.nnsight_view`): the same calls give the bridge's
numbers on tiny models of every family and on both real models, the traps nnsight users report
(ndif-team/nnbench docs/findings.md: left-padded batches shift positions, a layer returning
``(hidden, residual)`` must be summed, the first token under padding) are handled, and what
nnsight cannot serve is a clear error."""

from __future__ import annotations

import gc
import warnings

import nnsight
import pandas as pd
import pytest
import torch
from helpers import untouched

from massive_lens import (
    find_massive,
    layer_profile,
    load_model,
    perplexity,
    run_interventions,
    scan_corpus,
    tiny_model,
)
from massive_lens.attention import find_sinks, sink_attention, sink_census
from massive_lens.core.corpora import sequences
from massive_lens.core.criterion import SinkRule
from massive_lens.core.lse import lse_run, lse_support
from massive_lens.core.model_view import ModelView
from massive_lens.core.nnsight_model import trace_options
from massive_lens.core.nnsight_view import NnsightView
from massive_lens.core.tokens import byte_tokenizer
from massive_lens.errors import MassiveLensError
from massive_lens.models.tiny import tiny_config

FAMILIES = ("llama", "gpt2", "gemma3", "qwen2")
TEXTS = ["The cat sat on the mat. Then it slept for a while.", "Hi there"]
KEYS = ["seq", "layer", "pos", "dim", "token", "token_kind", "scope"]
BOS = 256  # byte_tokenizer's <|bos|>
# a mean next-token loss in float32 computed by two paths (their sums in another order) agrees to a
# few float32 ulps; compared as losses (log-perplexities): a perplexity exp(133) magnifies them
LOSS_REL = 16 * torch.finfo(torch.float32).eps


def hf_twin(family: str, plant: float | None = None):
    """The Hugging Face model ``tiny_model(family)`` wraps (same seed, same weights); with
    ``plant``, BOS's embedding carries that value in dim 3, a massive activation at position 0."""
    cls, config = tiny_config(family, byte_tokenizer(), {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = cls(config)
    if plant is not None:
        with torch.no_grad():
            hf.get_input_embeddings().weight[BOS, 3] = plant
    return hf.eval()


def twins(family: str, plant: float | None = None):
    """A bridge and an nnsight model over identical weights."""
    bridge = load_model(hf_twin(family, plant), tokenizer=byte_tokenizer(), name=f"tiny-{family}") \
        if plant is not None else tiny_model(family)
    lm = load_model(hf_twin(family, plant), tokenizer=byte_tokenizer(), backend="nnsight", name=f"tiny-{family}")
    return bridge, lm


def view_tokens(model, text: str) -> torch.Tensor:
    return ModelView(model).tokenize(text, prepend_bos=True).tokens


def same_profile(a: pd.DataFrame, b: pd.DataFrame, ratio_rtol: float = 1e-3) -> None:
    """Means to 1e-5 relative; a std (a difference of near-equal values) to 1e-5 of its mean; the
    ratio columns to ``ratio_rtol`` (a tiny random model's median is small: float32 rounding of the
    two implementations, 1e-7 absolute there, is 1e-4 of a ratio)."""
    assert list(a.columns) == list(b.columns) and a["layer"].equals(b["layer"])
    for col in a.columns[1:]:
        mean = a[col.replace("_std", "_mean")].abs().to_numpy()
        got, want = torch.tensor(b[col].to_numpy()), torch.tensor(a[col].to_numpy())
        rtol = ratio_rtol if col.startswith("ratio") else 1e-5
        bound = rtol * torch.tensor(mean) + 1e-6
        assert bool(((got - want).abs() <= bound).all()), (col, want, got)


def same_entries(a, b, rtol=1e-5):
    fa, fb = a.to_frame().reset_index(drop=True), b.to_frame().reset_index(drop=True)
    pd.testing.assert_frame_equal(fa[KEYS], fb[KEYS])
    torch.testing.assert_close(torch.tensor(fb["value"].values), torch.tensor(fa["value"].values), rtol=rtol,
                               atol=1e-6)
    torch.testing.assert_close(torch.tensor(b.magnitudes[["top1", "median"]].values),
                               torch.tensor(a.magnitudes[["top1", "median"]].values), rtol=rtol, atol=1e-7)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hook", ["resid_pre", "resid_mid", "resid_post"])
def test_find_massive_same_as_bridge(family, hook):
    bridge, lm = twins(family, plant=400.0)
    assert type(ModelView(lm)) is NnsightView
    a = find_massive(bridge, TEXTS, hook=hook, prepend_bos=True)
    b = find_massive(lm, TEXTS, hook=hook, prepend_bos=True)
    assert len(a.to_frame()) > 0  # the planted entry: the comparison is not of two empty tables
    same_entries(a, b)
    assert b.model_name == "tiny-" + family


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_profile_scan_and_edited_perplexity_same_as_bridge(family):
    bridge, lm = twins(family, plant=400.0)
    pa, pb = layer_profile(bridge, TEXTS, prepend_bos=True), layer_profile(lm, TEXTS, prepend_bos=True)
    same_profile(pa.to_frame(), pb.to_frame())
    text = "Some words to read, and a few more of them. " * 20
    sa = scan_corpus(bridge, text, seq_len=16, max_tokens=64, prepend_bos=True, progress=False)
    sb = scan_corpus(lm, text, seq_len=16, max_tokens=64, prepend_bos=True, progress=False)
    pd.testing.assert_frame_equal(sa.to_frame(), sb.to_frame(), rtol=1e-5)

    def zero_bos(x, hook):  # the residual edit of Table 3's "zero": the planted entry at the first token
        x = x.clone()
        x[:, 0, 3] = 0.0
        return x

    hooks = [("blocks.0.hook_resid_pre", zero_bos)]
    tokens = ModelView(lm).tokenize([text[:40], text[40:80]], prepend_bos=True).tokens
    base = [perplexity(m, tokens, progress=False).loss for m in (bridge, lm)]
    edited = [perplexity(m, tokens, hooks=hooks, progress=False).loss for m in (bridge, lm)]
    assert base[1] == pytest.approx(base[0], rel=LOSS_REL) and edited[1] == pytest.approx(edited[0], rel=LOSS_REL)
    assert abs(edited[0] - base[0]) > 1e-3  # the edit moved the loss: the equality is of two real effects


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_left_padding_trap():
    """nnsight's tokenizer pads on the left, which shifts a short text's positions (GPT-2's
    learned position embeddings then differ); the view pads on the right: the short text in a
    batch reads as it does alone, its first token at position 0."""
    _, lm = twins("gpt2", plant=400.0)
    assert lm.tokenizer.padding_side == "left"  # the trap is live in nnsight itself
    together = find_massive(lm, TEXTS, prepend_bos=True)
    alone = find_massive(lm, TEXTS[1], prepend_bos=True)
    mine = together.magnitudes[together.magnitudes.seq == 1].reset_index(drop=True)
    torch.testing.assert_close(torch.tensor(mine[["top1", "median"]].values),
                               torch.tensor(alone.magnitudes[["top1", "median"]].values), rtol=1e-5, atol=1e-7)
    assert lm.tokenizer.padding_side == "left"  # the user's tokenizer is left as it was
    # nnsight's own batch puts the short text's first token elsewhere: what the view avoids
    ids = lm.tokenizer(["<|bos|>" + t for t in TEXTS], return_tensors="pt", padding=True).input_ids
    assert int(ids[1, 0]) != BOS


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_first_token_at_position_zero_under_padding():
    _, lm = twins("llama", plant=400.0)
    frame = find_massive(lm, ["a much longer text than the other one", "x", "mid length"], prepend_bos=True).to_frame()
    firsts = frame[(frame.dim == 3)]
    assert sorted(firsts.seq.unique()) == [0, 1, 2]
    assert set(firsts.pos) == {0} and set(firsts.token_kind) == {"bos"}


class _Split(torch.nn.Module):
    """A decoder layer as vLLM's fused-residual layers shape it: ``(hidden, residual)`` in and
    out, the residual stream being their sum."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0] + hidden_states[1]
        out = self.layer(hidden_states, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        part = 0.25 * out
        return out - part, part


class _SumNorm(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x[0] + x[1] if isinstance(x, tuple) else x)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_split_residual_tuple_is_summed():
    plain = load_model(hf_twin("llama", plant=400.0), tokenizer=byte_tokenizer(), backend="nnsight")
    hf = hf_twin("llama", plant=400.0)
    hf.model.layers = torch.nn.ModuleList(_Split(layer) for layer in hf.model.layers)
    hf.model.norm = _SumNorm(hf.model.norm)
    split = load_model(hf, tokenizer=byte_tokenizer(), backend="nnsight")
    with split.trace(view_tokens(split, "Hi")):  # the trap: the first part alone is not the stream
        first = split.model.layers[1].output[0][0, 0, 3].save()
    a, b = find_massive(plain, TEXTS, prepend_bos=True), find_massive(split, TEXTS, prepend_bos=True)
    top = float(b.to_frame().query("layer == 1 and pos == 0 and dim == 3 and seq == 0").value.iloc[0])
    assert abs(float(first)) < 0.9 * abs(top)
    same_entries(a, b)
    for layer in (0, 2):  # an edit of a split stream is written back whole
        hooks = [(f"blocks.{layer}.hook_resid_post", lambda x, hook: x * 0.5)]
        tokens = view_tokens(plain, "Hello, world. And more.")
        got = [perplexity(m, tokens, hooks=hooks, progress=False).loss for m in (plain, split)]
        assert got[1] == pytest.approx(got[0], rel=LOSS_REL)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_model_left_as_found_and_lock():
    _, lm = twins("llama", plant=400.0)
    hf = ModelView(lm).hf
    hf.train()
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    find_massive(lm, TEXTS, hook="resid_mid")
    perplexity(lm, view_tokens(lm, "Hello there"), hooks=[("blocks.1.hook_resid_post", lambda x, hook: x * 0)],
               progress=False)
    assert all(m.training for m in hf.modules())
    assert all(torch.equal(before[k], v) for k, v in hf.state_dict().items())
    view = ModelView(lm)
    with pytest.raises(ZeroDivisionError):  # a failing hook: still nothing left behind
        view.forward(view.tokenize("Hi"), [("blocks.1.hook_resid_post", lambda x, hook: 1 / 0)])
    assert all(m.training for m in hf.modules())
    assert ModelView(lm).model is ModelView(lm).model  # one adapter, so one model lock


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bad_input_errors():
    hf = hf_twin("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = nnsight.NNsight(hf)  # no tokenizer
    with pytest.raises(MassiveLensError, match="no tokenizer.*load_model"):
        find_massive(bare, "Some text")
    assert len(find_massive(bare, torch.tensor([[BOS, 7, 8]])).magnitudes) == 4  # token ids need none
    _, lm = twins("llama")
    from massive_lens import trace_origin

    with pytest.raises(MassiveLensError, match="nnsight model.*find_massive.*sink_census.*backend='bridge'"):
        trace_origin(lm, "Hello there")
    with pytest.raises(MassiveLensError, match="backend='bridge' would be ignored"):
        load_model(lm, backend="bridge")
    with pytest.raises(MassiveLensError, match="unknown backend.*'nnsight'"):
        load_model(hf, backend="nnsite")
    assert load_model(lm) is lm
    assert trace_options(lm) == {}  # remote=True would be passed on as it is; none set here


# --------------------------------------------------------------------------- sink analyses on the LSE path

SINK_RULE = SinkRule(threshold=0.1, min_queries=2)  # a tiny random model's heads spread their attention


def same_census(a, b) -> None:
    """Every census row (the MLP neuron that wrote most included: nnsight's ``mlp.hook_post`` and
    ``W_out``) and both summaries equal to 1e-5 relative."""
    fa, fb = a.to_frame(), b.to_frame()
    assert len(fa) > 0 and a.attention == b.attention == "lse"
    assert bool((fa["neuron"] >= 0).any())  # the neuron column is compared on real values, not on -1s
    pd.testing.assert_frame_equal(fa, fb, rtol=1e-5, atol=1e-6)
    pd.testing.assert_frame_equal(a.by_kind, b.by_kind)
    pd.testing.assert_frame_equal(a.by_layer, b.by_layer)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_sink_attention_and_census_same_as_bridge(family):
    """sink_attention (sinks found in the pass, and given) and sink_census on a padded two-text
    batch: the bridge's numbers on nnsight, both on the LSE path; the model left as found."""
    bridge, lm = twins(family, plant=400.0)
    view = ModelView(lm)
    view.cfg.default_prepend_bos = ModelView(bridge).cfg.default_prepend_bos  # the same tokens (Qwen2: no BOS)
    config = view.hf.config
    implementation = config._attn_implementation
    with untouched(view.hf):
        assert lse_support(view) is None
        for sinks in (None, [0, 3]):
            a, b = sink_attention(bridge, TEXTS, sinks=sinks, attention="lse"), sink_attention(lm, TEXTS, sinks=sinks)
            assert a.attention == b.attention == "lse" and float(a.to_frame()["sink_mass"].abs().max()) > 0
            pd.testing.assert_frame_equal(a.to_frame(), b.to_frame(), rtol=1e-5, atol=1e-7)
            assert torch.equal(a.sinks.mask, b.sinks.mask)
        same_census(sink_census(bridge, TEXTS, rule=SINK_RULE, attention="lse"), sink_census(lm, TEXTS, rule=SINK_RULE))
    assert config._attn_implementation == implementation
    assert all(getattr(m, "config", config)._attn_implementation == implementation for m in view.hf.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sink_analyses_refuse_the_eager_path():
    _, lm = twins("llama")
    for call in (sink_attention, sink_census, find_sinks):
        with pytest.raises(MassiveLensError, match="nnsight model.*attention='eager' does not run.*'auto' or 'lse'"):
            call(lm, TEXTS, attention="eager")
    assert find_sinks(lm, TEXTS).attention == "lse"  # 'auto' takes the LSE path


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lse_run_on_nnsight_left_as_found_when_the_callback_fails():
    _, lm = twins("llama")
    view = ModelView(lm)
    implementation = view.hf.config._attn_implementation
    with untouched(view.hf), pytest.raises(ZeroDivisionError):
        with lse_run(view, lambda att: 1 / 0):
            view.forward(view.tokenize(TEXTS), [])
    assert view.hf.config._attn_implementation == implementation
    assert find_sinks(lm, TEXTS).attention == "lse"  # runs again afterwards


# --------------------------------------------------------------------------- both real models

REAL = ("default", "qwen2.5-coder-1.5b")
REAL_TEXTS = ["The history of the city begins in the Roman era, when a fort stood by the river.",
              "Photosynthesis converts light into chemical energy."]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_real_models_same_numbers(name):
    """Every entry of find_massive (both texts in one padded batch), the layer profile, an edited
    perplexity, sink_attention, the sink census (LSE path) and run_interventions' original, zero and
    mean rows: the bridge's numbers on nnsight, to 1e-5 relative (the bootstrap intervals of two
    sequences to 1e-4). The models are loaded one after the other (Qwen takes about 7 GB in float32;
    its run_interventions took 36 s on the bridge, 18 s on nnsight, on 2 CPU cores)."""
    text = " ".join(REAL_TEXTS * 3)
    hooks = [("blocks.2.hook_resid_post", lambda x, hook: x * 0.9)]
    results, bos, tokens = [], None, None
    for backend in ("bridge", "nnsight"):
        model = load_model(None if name == "default" else name, backend=backend)
        if bos is None:  # TransformerLens's default for the architecture (False for Qwen2); nnsight's is True
            bos, tokens = bool(model.cfg.default_prepend_bos), sequences(ModelView(model), text, 24, 2)
        ModelView(model).cfg.default_prepend_bos = bos  # the sink analyses tokenize with the model's default
        results.append((find_massive(model, REAL_TEXTS, prepend_bos=bos),
                        layer_profile(model, REAL_TEXTS, prepend_bos=bos).to_frame(),
                        perplexity(model, tokens, hooks=hooks, progress=False).loss, ModelView(model).name,
                        sink_attention(model, REAL_TEXTS, attention="lse"),
                        sink_census(model, REAL_TEXTS, attention="lse"),
                        run_interventions(model, None, calibration=text, seq_len=24, n_seqs=2,  # offline default text
                                          calibration_seqs=2, settings=["original", "zero", "mean"],
                                          progress=False)))
        del model
        gc.collect()
    (fa, pa, xa, na, sa, ca, ta), (fb, pb, xb, nb, sb, cb, tb) = results
    same_table(ta, tb, interval_rtol=1e-4, stats=False)
    assert ta.to_frame()["target_dims"].iloc[1] != ""  # the real massive dims were edited
    assert len(fa.to_frame()) > 0 and na == nb
    assert sa.attention == sb.attention == "lse" and torch.equal(sa.sinks.mask, sb.sinks.mask)
    pd.testing.assert_frame_equal(sa.to_frame(), sb.to_frame(), rtol=1e-5, atol=1e-7)
    same_census(ca, cb)  # every row (the first token at least: a primary sink)
    same_entries(fa, fb)
    same_profile(pa, pb, ratio_rtol=1e-5)  # real models: the ratios too, to 1e-5
    assert xb == pytest.approx(xa, rel=LOSS_REL)  # the edited losses


# --------------------------------------------------------------------------- Table 3's residual-stream settings

RESID_SETTINGS = ["original", "zero", "mean", "control", "zero_every", "mean_every"]
RATIO_COLUMNS = ["perplexity", "ratio", "ratio_low", "ratio_high"]
TARGET_COLUMNS = ["setting", "where", "acts_on", "targets_per_seq", "target_dims", "target_kinds", "edited_dims",
                  "sinks_per_seq", "sink_kinds", "peak_layer", "back_layer", "rebuilt", "added", "n_seqs"]


def untied_twins(family: str):
    """:func:`twins` with the planted BOS value in the input embedding only (the tied output head
    keeps the untouched row): in a tied model the plant makes BOS's logit hundreds of nats and every
    perplexity a float32 rounding of that."""
    hfs = []
    for _ in range(2):
        hf = hf_twin(family)
        head = hf.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        hf.config.tie_word_embeddings = False
        with torch.no_grad():
            hf.get_input_embeddings().weight[BOS, 3] = 400.0
        hfs.append(hf)
    bridge = load_model(hfs[0], tokenizer=byte_tokenizer(), name=f"tiny-{family}")
    return bridge, load_model(hfs[1], tokenizer=byte_tokenizer(), backend="nnsight", name=f"tiny-{family}")


def bos_rows(text: str, n: int, width: int = 15) -> torch.Tensor:
    """``n`` rows of BOS and ``width`` bytes of ``text`` (every family gets the planted BOS, Qwen2 too,
    whose TransformerLens default prepends none)."""
    data = text.encode()
    return torch.tensor([[BOS, *data[i * width:(i + 1) * width]] for i in range(n)])


def same_table(a, b, interval_rtol: float = 1e-5, stats: bool = True) -> None:
    """Two intervention tables of the same weights: every setting's perplexity and ratio to 1e-5
    relative (the bootstrap interval to ``interval_rtol``), the targets, sinks and checks equal;
    with ``stats``, the calibrations' per-head sink statistics to 1e-4."""
    fa, fb = a.to_frame(), b.to_frame()
    pd.testing.assert_frame_equal(fa[TARGET_COLUMNS], fb[TARGET_COLUMNS])
    pd.testing.assert_frame_equal(fa[RATIO_COLUMNS[:2]], fb[RATIO_COLUMNS[:2]], rtol=1e-5, atol=0)
    pd.testing.assert_frame_equal(fa[RATIO_COLUMNS[2:]], fb[RATIO_COLUMNS[2:]], rtol=interval_rtol, atol=0)
    pd.testing.assert_frame_equal(fa[["accuracy", "target_kept", "target_back", "sink_mass", "sink_mass_original"]],
                                  fb[["accuracy", "target_kept", "target_back", "sink_mass", "sink_mass_original"]],
                                  rtol=1e-4, atol=1e-6)
    assert torch.equal(a.sinks.mask, b.sinks.mask)
    ca, cb = a.calibration, b.calibration
    assert ca.attn_layers == cb.attn_layers and ca.first_layer == cb.first_layer
    assert torch.equal(ca.sinks.mask, cb.sinks.mask)
    keys = ("sink_z", "sink_k", "sink_v", "sink_mass") if stats else ()  # on nnsight from the kernel's LSE
    for key in keys:
        torch.testing.assert_close(getattr(cb, key), getattr(ca, key), rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_run_interventions_same_as_bridge(family):
    """Table 3's residual-stream settings on nnsight: the bridge's table over the same weights (the
    calibration's sinks and sink statistics from the LSE path, the edits in the trace); the model
    left as found."""
    bridge, lm = untied_twins(family)
    text = "The cat sat on the mat. A dog ran off to the park and back. " * 4
    evaluate, calibration = bos_rows(text, 4), bos_rows(text[::-1].replace(".", "!"), 4)
    hf = ModelView(lm).hf
    kw = dict(calibration=calibration, settings=RESID_SETTINGS, progress=False)
    a = run_interventions(bridge, evaluate, **kw)
    with untouched(hf):
        b = run_interventions(lm, evaluate, **kw)
    assert list(b.to_frame()["setting"]) == RESID_SETTINGS
    zero = b.to_frame().set_index("setting").loc["zero"]
    assert zero["target_dims"] == "3" and zero["targets_per_seq"] == 1.0  # the planted entry, at BOS
    same_table(a, b)
    again = run_interventions(lm, evaluate, settings=["original", "zero"], calibration=b.calibration, progress=False)
    pd.testing.assert_frame_equal(again.to_frame()[RATIO_COLUMNS], b.to_frame()[RATIO_COLUMNS].iloc[:2])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_attention_settings_refused_on_nnsight():
    _, lm = twins("llama", plant=400.0)
    text = "The cat sat on the mat. A dog ran off to the park and back. " * 4
    for setting in ("sink_attention_removed", "sink_term_mean", "bias_surgery"):
        with pytest.raises(MassiveLensError, match=f"nnsight model.*{setting}.*run_interventions.*backend='bridge'"):
            run_interventions(lm, bos_rows(text, 2), calibration=bos_rows(text[::-1], 2),
                              settings=["original", setting], progress=False)
    from massive_lens.interventions import ablate_massive, calibrate, fix_sink_term

    calib = calibrate(lm, bos_rows(text[::-1], 2), progress=False)
    with pytest.raises(MassiveLensError, match="nnsight model.*fix_sink_term.*backend='bridge'"):
        fix_sink_term(lm, calibration=calib)
    iv = ablate_massive(lm, calibration=calib)
    with pytest.raises(MassiveLensError, match="nnsight model.*zero .first layer. used as a context manager"):
        with iv:
            pass
    assert perplexity(lm, bos_rows(text, 2), hooks=iv, progress=False).perplexity > 0  # as hooks= it runs
    assert iv.record.edited == {3: 2}  # the planted entry of each sequence, edited in the trace


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_precision_check_refused_on_nnsight():
    from massive_lens.handover import precision_check

    _, lm = twins("llama")
    with untouched(ModelView(lm).hf), pytest.raises(
            MassiveLensError, match="nnsight model.*precision_check.*run_interventions.*backend='bridge'"):
        precision_check(lm, "Some text to read. " * 20, seq_len=16, n_seqs=2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantize_refused_on_nnsight_by_name():
    """quantize's quantizer statistics (max |x|, kurtosis, top-1/median, the per-token errors) come
    from hooks on the layers that read the residual stream, which nnsight's trace does not serve: it
    reported the unmeasured defaults (0.0) as measurements. Refused by name, the model left as found."""
    from massive_lens.quant import quantize, quantize_grid

    _, lm = twins("llama")
    for call in (lambda: quantize(lm, "Some text to read. " * 20, seq_len=16, n_seqs=2),
                 lambda: quantize_grid(lm, "Some text to read. " * 20, settings=["W8A8"], seq_len=16, n_seqs=2)):
        with untouched(ModelView(lm).hf), pytest.raises(
                MassiveLensError, match="nnsight model.*quantize.*backend='bridge'"):
            call()
