"""massive_lens.handover: exclusion masks, norm thresholds, massive dims (JSON) and the
half-precision check, on planted tiny models with known answers, and on the default model
(``slow``). Their bad-input rows are in ``test_bad_inputs.py``'s table; ``sae_check`` is in
``test_sae.py`` (it needs sae-lens)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import pandas as pd
import pytest
import torch
from helpers import untouched
from planting import (
    BRIEF_DIM,
    CHANNEL_DIM,
    COMMA,
    SINK_DIM,
    TEXT,
    WORD,
    plant_brief,
    plant_channel_spike,
    plant_sink,
    plant_story,
)

import massive_lens
from massive_lens import MassiveLensError, find_massive, load_model, sink_census, tiny_model
from massive_lens.attention.sinks import find_sinks
from massive_lens.handover import (
    ExclusionMask,
    exclusion_mask,
    massive_dims,
    norm_thresholds,
    precision_check,
    read_dims,
)
from massive_lens.handover import precision as precision_module
from massive_lens.handover.headroom import spacing
from massive_lens.handover.mixed import cast


@pytest.fixture(scope="module")
def brief():
    """BOS: a persistent massive value in SINK_DIM; every WORD token: BRIEF_DIM massive in layer 0 only."""
    return plant_brief(tiny_model("llama"))


@pytest.fixture(scope="module")
def story():
    """BOS: a token-specific massive activation; OUTLIER_DIM: an outlier dimension at every other token."""
    return plant_story(tiny_model("llama"))


def _state(model):
    inner = model.original_model
    return (next(model.parameters()).dtype, model.cfg.dtype, model.training,
            [m.training for m in inner.modules()], [p.data_ptr() for p in model.parameters()])


# --------------------------------------------------------------------------- exclusion_mask


def test_mask_marks_the_massive_positions_find_massive_finds(brief):
    texts = ["The bee sees three geese.", "Hi there"]
    with untouched(brief):
        ex = exclusion_mask(brief, texts)
    entries = find_massive(brief, texts).to_frame()
    expected = set(map(tuple, entries.loc[entries.scope == "token", ["seq", "pos"]].values.tolist()))
    assert set(map(tuple, ex.mask.nonzero().tolist())) == expected
    frame = ex.to_frame()
    bos = frame[frame.pos == 0]
    assert len(bos) == 2 and set(bos.dim) == {SINK_DIM} and (bos.n_layers == brief.cfg.n_layers).all()
    words = frame[frame.pos > 0]
    assert len(words) and set(words.dim) == {BRIEF_DIM} and (words.n_layers == 1).all()
    assert (ex.tokens[ex.mask][ex.tokens[ex.mask] != brief.tokenizer.bos_token_id] == WORD).all()
    assert ex.token_ids() == sorted([brief.tokenizer.bos_token_id, WORD])
    assert torch.equal(ex.keep, ex.valid & ~ex.mask) and not bool((ex.mask & ~ex.valid).any())


def test_padded_rows_give_what_each_text_gives_alone(brief):
    texts = ["The bee sees three geese, the deer feed.", "Hi e"]
    both = exclusion_mask(brief, texts)
    assert not bool(both.valid.all())  # padded
    for row, text in enumerate(texts):
        alone = exclusion_mask(brief, text)
        n = int(both.valid[row].sum())
        assert torch.equal(both.mask[row, :n], alone.mask[0]) and not bool(both.mask[row, n:].any())


def test_outlier_dims_mark_no_position_unless_asked(story):
    text = "Hello there, world. Bye now, friend."
    token = exclusion_mask(story, text)
    assert token.mask[0].nonzero().flatten().tolist() == [0]
    every = exclusion_mask(story, text, outliers="include")
    assert bool(every.mask[every.valid].all())
    assert set(every.to_frame()["reason"]) == {"massive", "massive (outlier dim)"}


@pytest.fixture(scope="module")
def channel():
    """BOS: a token-specific massive activation; CHANNEL_DIM: a channel at 60 at every token but BOS
    that passes the massive rule at the commas of layer 0 only (issue 48)."""
    return plant_channel_spike(tiny_model("llama"))


def test_a_channel_spike_at_ordinary_tokens_marks_no_position(channel):
    """Issue 48: a one-layer spike at a few commas of a channel large at every token is the outlier
    dimension's, not a massive activation of the commas: no comma is left out or handed over."""
    texts = ["Hi, home.", "Go out, now.", "A cat, a dog, a bird."]
    with untouched(channel):
        ex = exclusion_mask(channel, texts)
    spikes = find_massive(channel, texts).to_frame().query("dim == @CHANNEL_DIM")
    assert len(spikes) == 4 and set(spikes.layer) == {0}  # the plant: every comma, at layer 0 only
    assert (ex.tokens[spikes.seq.tolist(), spikes.pos.tolist()] == COMMA).all()
    assert set(spikes.scope) == {"outlier_dim"}
    bos = channel.tokenizer.bos_token_id
    assert ex.mask.nonzero()[:, 1].tolist() == [0, 0, 0] and ex.token_ids() == [bos]
    assert ex.outlier_dims == (CHANNEL_DIM,) and f"outlier dim {CHANNEL_DIM} excluded" in ex.summary()
    every = exclusion_mask(channel, texts, outliers="include")  # asked for: the commas are marked, and say why
    commas = every.to_frame().query("pos > 0")
    assert len(commas) == 4 and set(commas.reason) == {"massive (outlier dim)"} and set(commas.dim) == {CHANNEL_DIM}


def test_the_channel_is_decided_over_all_the_texts(channel):
    """Each text has too few tokens to show a channel; together they do (issue 48: over the batch)."""
    texts = ["a,", "b,", "c,"]
    ex = exclusion_mask(channel, texts)
    assert ex.mask.nonzero()[:, 1].tolist() == [0, 0, 0] and COMMA not in ex.token_ids()
    alone = exclusion_mask(channel, texts[0])  # one text alone is too little evidence: its comma stands out
    assert COMMA in alone.token_ids() and alone.outlier_dims == ()


def test_sink_levels_come_from_the_census():
    model = tiny_model("llama")
    plant_sink(model)
    text = "The cat sat. The dog ran, and the bird flew far away. " * 3
    census = sink_census(model, text).to_frame()
    for levels in (("primary",), ("primary", "secondary", "transient")):
        ex = exclusion_mask(model, text, levels=levels)
        sinks = ex.to_frame()
        sinks = sinks[sinks.level != ""]
        expected = census[census.level.isin(levels)]
        assert sorted(sinks.pos) == sorted(expected.pos)
        assert list(sinks.level) == list(expected.sort_values("pos").level)


def test_token_ids_drop_an_id_that_is_kept_somewhere():
    tokens = torch.tensor([[1, 7, 9, 7], [1, 9, 9, 3]])
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    ex = ExclusionMask(mask=mask, valid=torch.ones_like(mask), tokens=tokens, frame=pd.DataFrame(), model_name="m",
                       levels=("primary",), outliers="exclude", criterion=massive_lens.Criterion())
    assert ex.token_ids() == [1] and ex.token_ids(every=False) == [1, 7]


def test_top_level_export():
    assert massive_lens.exclusion_mask is exclusion_mask and "exclusion_mask" in massive_lens.__all__


# --------------------------------------------------------------------------- norm_thresholds


def test_norm_threshold_separates_a_planted_sink(brief):
    with untouched(brief):
        th = norm_thresholds(brief, TEXT, seq_len=32, n_seqs=2)
    f = th.to_frame()
    assert len(f) == brief.cfg.n_layers and f.separates.all() and (f.caught == 1.0).all()
    assert ((f.kept_max < f.threshold) & (f.threshold < f.massive_min)).all()
    # layer 0 drops BOS and every WORD token (BRIEF_DIM is massive there only); later layers only BOS
    assert f.n_massive.iloc[0] > f.n_massive.iloc[1] and (f.n_massive.iloc[1:] == 2).all()
    assert th.multiple(0) == f.threshold.iloc[0]
    with pytest.raises(MassiveLensError, match="layer"):
        th.multiple(99)
    with pytest.raises(MassiveLensError, match="hook"):
        norm_thresholds(brief, TEXT, seq_len=32, n_seqs=2, hook="mlp_out")


# --------------------------------------------------------------------------- massive_dims


def test_massive_dims_follow_the_persistence_rule(brief, tmp_path):
    with untouched(brief):
        half = massive_dims(brief, TEXT, seq_len=32, n_seqs=2, persistence=0.5)
    assert half.dims == (SINK_DIM,)
    share = 1 / brief.cfg.n_layers  # BRIEF_DIM is massive in one layer
    assert massive_dims(brief, TEXT, seq_len=32, n_seqs=2, persistence=share).dims == tuple(sorted({SINK_DIM,
                                                                                                    BRIEF_DIM}))
    direction = torch.ones(3, brief.cfg.d_model)
    cleaned = half.keep_out(direction)
    assert (cleaned[:, SINK_DIM] == 0).all() and cleaned.sum() == direction.sum() - 3
    assert direction.sum() == direction.numel()  # the input is left as it was
    with pytest.raises(MassiveLensError, match="d_model"):
        half.keep_out(torch.ones(brief.cfg.d_model + 1))


def test_massive_dims_json_reads_with_the_standard_library_alone(brief, tmp_path):
    found = massive_dims(brief, TEXT, seq_len=32, n_seqs=2, persistence=0.5)
    path = found.to_json(tmp_path / "missing" / "dims.json")  # the folder is created, as save does (issue 37)
    code = ("import json, sys; d = json.load(open(sys.argv[1])); "
            "print(json.dumps([d['schema'], d['version'], d['dims'], [x['dim'] for x in d['details']], d['rule']]))")
    run = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    schema, version, dims, details, rule = json.loads(run.stdout)
    assert (schema, version, dims) == ("massive_lens.massive_dims", 1, [SINK_DIM])
    assert set(details) == {SINK_DIM, BRIEF_DIM} and rule["persistence"] == 0.5
    back = read_dims(path)
    pd.testing.assert_frame_equal(back.to_frame(), found.to_frame())
    assert back.dims == found.dims and back.summary() == found.summary()


# --------------------------------------------------------------------------- precision_check


def test_spacing_is_the_gap_to_the_next_number():
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.tensor([3.0, 1000.0, 25000.0], dtype=dtype)
        gap = torch.nextafter(x.float().to(dtype), torch.tensor(float("inf"), dtype=dtype)).float() - x.float()
        assert torch.equal(spacing(x.float(), dtype), gap)


def test_a_value_past_float16_is_predicted_and_confirmed():
    model = tiny_model("llama")
    plant_sink(model, 1e5)  # past float16's 65,504, well inside bfloat16's range
    before = _state(model)
    with untouched(model):
        check = precision_check(model, TEXT, seq_len=32, n_seqs=2)
    assert _state(model) == before
    problems = check.to_frame()
    over = problems[(problems.dtype == "float16") & (problems.problem == "overflow")]
    assert len(over) and set(over.pos) == {0} and set(over.dim) == {SINK_DIM} and (over.value.abs() > 65504).all()
    half, brain = (check.verdicts.set_index("dtype").loc[d] for d in ("float16", "bfloat16"))
    assert half.verdict == "unsafe" and half.nonfinite_at and "float32" in half.fix and "clamp" in half.fix
    assert math.isfinite(half.clamp_ppl_ratio)
    # a residual past float16 reaches every block and the final norm: no block set in float32 fixes it
    assert half.kept_float32 == "" and "run in float32 (keeping" in half.fix
    assert brain.verdict == "safe" and brain.overflow == 0 and not brain.nonfinite_at
    assert check.verdict("bfloat16") == "safe" and "UNSAFE" in check.summary()


def test_a_square_past_float16_is_predicted_and_the_run_tells():
    model = tiny_model("llama")
    plant_sink(model, 3000.0)  # fits float16; its square at the next norm does not
    check = precision_check(model, TEXT, seq_len=32, n_seqs=2, dtypes=("float16",))
    problems = check.to_frame()
    assert not (problems.problem == "overflow").any()
    squares = problems[problems.problem == "square_overflow"]
    assert len(squares) and set(squares.pos) == {0} and set(squares.dim) == {SINK_DIM}
    row = check.verdicts.iloc[0]
    assert row.verdict == "safe" and not row.nonfinite_at and "wider type" in row.fix  # HF's RMSNorm squares in float32


def test_an_attention_product_past_float16_is_predicted_and_confirmed():
    model = tiny_model("llama")
    with torch.no_grad():  # q and k stay far inside float16; their product (before 1/sqrt(d_head)) does not
        model.blocks[0].attn.W_Q.mul_(1500.0)
        model.blocks[0].attn.W_K.mul_(1500.0)
    check = precision_check(model, TEXT, seq_len=16, n_seqs=2, dtypes=("float16",))
    over = check.to_frame().query("problem == 'overflow'")
    assert set(zip(over.site, over.layer, strict=True)) == {("attn.hook_attn_scores", 0)}
    assert (over.value > 65504).all()
    assert check.peaks.query("site in ('attn.hook_q', 'attn.hook_k')").max_abs.max() < 65504
    row = check.verdicts.iloc[0]
    assert row.verdict == "unsafe" and row.nonfinite_at == "blocks.0.attn.hook_attn_scores" and "layer 0" in row.fix
    # the fix, measured: block 0 in float32 and the rest in float16 runs, within the tolerance of float32
    assert row.kept_float32 == "layer 0" and row.kept_ppl_ratio <= 1.01 and "measured" in row.fix


def test_precision_check_restores_the_model_when_it_fails(monkeypatch):
    model = tiny_model("llama")
    model.train()
    before = _state(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def boom(scorer, tokens, hooks):
        if next(model.parameters()).dtype != torch.float32:
            raise RuntimeError("boom")
        return real(scorer, tokens, hooks)

    real = precision_module._run
    monkeypatch.setattr(precision_module, "_run", boom)
    with pytest.raises(RuntimeError, match="boom"):
        precision_check(model, TEXT, seq_len=32, n_seqs=2)
    assert _state(model) == before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


def test_cast_puts_back_the_same_tensors():
    model = tiny_model("gpt2")
    before = _state(model)
    with untouched(model), cast(model, torch.float16):
        assert next(model.parameters()).dtype == torch.float16
        assert all(b.dtype == torch.float16 for b in model.buffers() if b.is_floating_point())
    assert _state(model) == before


@pytest.mark.heavy  # the other thread is held back for its 2 s timeout at each cast: 6 s
def test_another_thread_waits_while_precision_check_casts(monkeypatch):
    """``precision_check`` holds the model's lock for each cast (the confirming run and the
    mixed-precision search): another thread's ``find_massive`` started while the weights are in
    float16 gets the float32 answer. Before the fix it ran on the float16 weights (another
    answer, or an overflow error)."""
    model = tiny_model("llama")
    with torch.no_grad():  # an unsafe float16 model whose fix keeps layer 0: both kinds of cast run
        model.blocks[0].attn.W_Q.mul_(1500.0)
        model.blocks[0].attn.W_K.mul_(1500.0)
    short = TEXT[:100]
    expected = find_massive(model, short).to_frame()
    answers, errors, others = [], [], []

    def analyse():
        try:
            answers.append(find_massive(model, short).to_frame())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def run_beside_another_thread(scorer, tokens, hooks):
        if any(p.dtype != torch.float32 for p in model.parameters()):  # inside a cast
            other = threading.Thread(target=analyse)
            other.start()
            other.join(timeout=2.0)  # it ran here, on the cast weights, unless the lock holds it back
            others.append(other)
        return real(scorer, tokens, hooks)

    real = precision_module._run
    monkeypatch.setattr(precision_module, "_run", run_beside_another_thread)
    check = precision_check(model, TEXT, seq_len=16, n_seqs=2, dtypes=("float16",))
    for other in others:
        other.join()
    # the confirming run, the search, and the bfloat16 run of the smallest fix (rescaling is not tried:
    # the overflow is in the attention scores, the residual stream fits)
    assert check.verdicts.iloc[0].kept_float32 == "layer 0" and len(others) == 3
    assert not errors, errors[:1]
    assert len(answers) == 3 and all(frame.equals(expected) for frame in answers)


# --------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module", params=[pytest.param("default", marks=pytest.mark.slow),
                                        pytest.param("qwen2.5-coder-1.5b", marks=[pytest.mark.slow, pytest.mark.real])])
def real_model(request):
    """Each real model: the session's default, or Qwen2.5-Coder-1.5B loaded for this module."""
    return request.getfixturevalue("default_model") if request.param == "default" else load_model(request.param)


def test_real_model_mask_agrees_with_find_massive_and_the_sink_rule(real_model):
    texts = ["The quick brown fox jumps over the lazy dog. It was a sunny day, and everyone was happy.",
             "Hello, world.\nBye."]
    ex = exclusion_mask(real_model, texts, levels=("primary", "secondary"))
    frame = ex.to_frame()
    for row, text in enumerate(texts):
        entries = find_massive(real_model, text).to_frame()
        massive = set(entries.loc[entries.scope == "token", "pos"])
        assert massive and set(frame[(frame.seq == row) & frame.massive].pos) == massive
        census = sink_census(real_model, text).to_frame()
        for level in ("primary", "secondary"):
            assert set(frame[(frame.seq == row) & (frame.level == level)].pos) == set(census[census.level == level].pos)
        # the sink rule: every position it counts is left out, as a primary sink where the census lists it
        # (a position counted only by its persistent massive activation, with too few later queries to be
        # judged by attention, has no census row: it is left out as massive)
        rule = set(find_sinks(real_model, text).mask[0].nonzero().flatten().tolist())
        primary = set(frame[(frame.seq == row) & (frame.level == "primary")].pos)
        assert rule <= set(frame[frame.seq == row].pos) and rule & set(census.pos) <= primary
    assert bool(ex.mask[:, 0].all())  # the first token is left out in every text
    ids = ex.token_ids()  # ids left out at every occurrence
    assert all(bool(ex.mask[ex.valid & (ex.tokens == t)].all()) for t in ids)
    assert set(ids) <= set(ex.tokens[ex.mask].tolist())


@pytest.mark.slow
def test_default_model_precision(default_model):
    before = _state(default_model)
    check = precision_check(default_model, n_seqs=2, seq_len=64)
    assert _state(default_model) == before
    peaks = check.peaks
    biggest = peaks.max_abs.max()
    v = check.verdicts.set_index("dtype")
    # the largest value fits float16, its square does not; the run in each dtype decides
    assert 65504 > biggest > 1000 and peaks.max_square.max() > 65504
    assert v.loc["float16", "overflow"] == 0 and v.loc["float16", "square_overflow"] > 0
    for dtype in ("float16", "bfloat16"):
        assert v.loc[dtype, "verdict"] in ("safe", "unsafe") and math.isfinite(v.loc[dtype, "ppl_ratio"])
