"""The analyses on both real offline models: SmolLM2-135M-Instruct (the default; Llama-style,
BOS token) and Qwen2.5-Coder-1.5B-Instruct (Qwen2: grouped-query attention, q/k/v biases, no
BOS token). Each is loaded once (the default for the session, Qwen for this module: about
7 GB in float32). The tests assert relations, or compare with a plain transformers
computation: no dim, layer or value of either model is written here.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import WIKITEXT_TEST, WIKITEXT_VALID, needs_wikitext

from massive_lens import (
    calibrate,
    decompose_attention,
    find_massive,
    load_model,
    perplexity,
    scan_corpus,
    trace_origin,
)
from massive_lens.core.fmt import num
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import ablate_massive
from massive_lens.models.offline import find_offline
from massive_lens.report.inputs import Inputs
from massive_lens.report.render import Section
from massive_lens.report.sections import massive_section
from massive_lens.report.write import settings_for

pytestmark = [pytest.mark.real, pytest.mark.slow]  # `-m "not slow"` skips them in a quick run; CI runs them

REAL_MODELS = ("default", "qwen2.5-coder-1.5b")
TEXT = "The history of the city begins in the Roman era, when a fort stood by the river."
OTHER = "Photosynthesis converts light into chemical energy stored in sugar molecules."


@pytest.fixture(scope="module", params=REAL_MODELS)
def real_model(request):
    """Each real model, loaded once: the default is the session's copy; Qwen lives as long as
    this module's tests on it (pytest runs them together and then releases it)."""
    if request.param == "default":
        return request.getfixturevalue("default_model")
    return load_model(request.param)


@pytest.fixture(scope="module")
def found(real_model):
    return find_massive(real_model, TEXT)


@pytest.fixture(scope="module")
def trace(real_model):
    return trace_origin(real_model, TEXT)


def test_named_by_name_not_path(real_model):
    name = ModelView(real_model).name
    assert os.sep not in name and not os.path.exists(name)
    assert find_offline(name) is not None  # the readable name loads the same offline model


@needs_wikitext
def test_massive_at_the_first_token(real_model, found):
    rows = found.by_dim()
    assert not rows.empty, "every real model here carries massive activations"
    top = rows.loc[rows.value.abs().idxmax()]
    view = ModelView(real_model)
    first_kind = "bos" if view.tokenize(TEXT).has_bos else "first"
    assert top.pos == 0 and top.token_kind == first_kind
    assert top.ratio > found.criterion.ratio_threshold
    # ... and over a corpus, the same dim is massive at the first token of every sequence
    scan = scan_corpus(real_model, WIKITEXT_TEST, seq_len=32, max_tokens=128, progress=False).to_frame()
    row = scan[(scan.dim == top.dim) & (scan.token_kind == first_kind)]
    assert not row.empty and float(row.frequency.iloc[0]) == 1.0


def test_found_values_match_plain_transformers(real_model, found):
    """find_massive's values equal an output_hidden_states run of the wrapped HF model."""
    tokens = ModelView(real_model).tokenize(TEXT).tokens
    with torch.no_grad():
        hidden = real_model.original_model(tokens, output_hidden_states=True).hidden_states
    last = real_model.cfg.n_layers - 1  # HF's last hidden state is after the final norm
    rows = found.to_frame()
    rows = rows[rows.layer < last]
    assert not rows.empty
    for row in rows.itertuples():
        assert row.value == pytest.approx(float(hidden[row.layer + 1][0, row.pos, row.dim]), rel=1e-3)


@needs_wikitext
def test_the_reports_first_screen_names_the_headline(real_model, found):
    """Issue 26's first screen on each real model: the report's massive-activation section names
    the headline activation (the largest token-specific value), its layer and its value; the
    headline figure shows that layer; outlier dimensions are listed apart, below. The headline
    is checked against the wrapped HF model's hidden states, not against find_massive itself."""
    inputs = Inputs(real_model, TEXT, WIKITEXT_TEST, settings_for(True, seq_len=32, scan_seqs=2))
    section = Section("Massive activations")
    massive_section(inputs, section)
    top = found.headline
    token = found.by_dim().query("scope == 'token'")
    assert top is not None and top.scope == "token" and abs(top.value) == token.value.abs().max()
    tokens = ModelView(real_model).tokenize(TEXT).tokens
    with torch.no_grad():
        hidden = real_model.original_model(tokens, output_hidden_states=True).hidden_states
    last = real_model.cfg.n_layers - 1  # HF's last hidden state is after the final norm
    column = torch.stack([hidden[layer + 1][0, top.pos, top.dim] for layer in range(last)]).abs()
    assert float(column.max()) <= abs(top.value) * (1 + 1e-3)
    if top.peak_layer < last:
        assert int(column.argmax()) == top.peak_layer
        assert float(column[top.peak_layer]) == pytest.approx(abs(top.value), rel=1e-3)
    first = next(text for kind, text, _ in section.blocks if kind == "pre")
    assert f"the largest is {num(top.value)} (dim {top.dim} at" in first and f"at layer {top.peak_layer}" in first
    figure = next(caption for kind, _, caption in section.blocks if kind == "figure")
    assert figure.startswith(f"activation landscape at layer {top.peak_layer} (the layer of the headline "
                             f"activation: dim {top.dim} at")
    tables = [caption for kind, _, caption in section.blocks if kind == "table"]
    assert tables[0].startswith("token-specific massive (position, dim) pairs")
    if not found.outlier_dims().empty:
        assert tables[1].startswith("outlier dimensions, listed apart")
        lines = first.splitlines()
        apart = next(i for i, line in enumerate(lines) if line.startswith("outlier dimensions ("))
        token_lines = [i for i, line in enumerate(lines) if "x median)" in line]
        assert token_lines and max(token_lines) < apart  # grouped below every token-specific line
        assert all("an outlier dimension" in line or "more outlier" in line for line in lines[apart + 1:])


def test_ledger_reconstructs_the_residual(trace):
    ledger = trace.ledger
    assert not ledger.empty and trace.targets.massive.all()
    for _, rows in ledger.groupby(["pos", "dim"]):
        total = rows.contribution.astype("float64").cumsum()
        assert float((total - rows.resid).abs().max()) < 1e-4 * float(rows.resid.abs().max())


def test_every_peak_is_accounted_for(trace):
    """The attribution behind the summary: its rows sum to each traced peak, and the named runs
    of writes (not ``the rest``) explain at least 90% of it."""
    for t in trace.targets.itertuples():
        rows = trace.attribution[(trace.attribution.pos == t.pos) & (trace.attribution.dim == t.dim)
                                 & (trace.attribution.target == "peak")]
        assert float(rows.contribution.sum()) == pytest.approx(t.peak, rel=1e-4)
        named = float(rows[rows.component != "rest"].contribution.sum())
        assert named / t.peak >= 0.9, (t, rows)


def test_heads_sum_to_the_attention_terms(trace):
    """Per-head attribution on a real model: every attention term of the ledger is split, and
    the heads (with b_O) sum to it."""
    attn = trace.ledger[trace.ledger.component == "attn"].set_index(["pos", "dim", "layer"]).contribution.sort_index()
    sums = trace.heads.groupby(["pos", "dim", "layer"]).contribution.sum()
    assert sums.index.equals(attn.index)
    scale = trace.ledger.resid.abs().max()
    assert float((sums - attn).abs().max()) <= 1e-5 * scale


def test_ledger_residual_matches_plain_transformers(real_model, trace):
    """The ledger's measured residual after each layer equals the HF model's hidden state
    (``output_hidden_states``, no TransformerLens hooks)."""
    tokens = ModelView(real_model).tokenize(TEXT).tokens
    with torch.no_grad():
        hidden = real_model.original_model(tokens, output_hidden_states=True).hidden_states
    last = real_model.cfg.n_layers - 1
    for (pos, dim), rows in trace.ledger.groupby(["pos", "dim"]):
        scale = float(rows.resid.abs().max())
        ends = rows[rows.layer < last].groupby("layer").tail(1)  # the residual after each layer
        assert len(ends) == last
        for r in ends.itertuples():
            assert abs(r.resid - float(hidden[r.layer + 1][0, pos, dim])) < 1e-4 * scale


def test_decomposition_reconstructs_with_the_first_token_as_sink(real_model):
    result = decompose_attention(real_model, [TEXT, OTHER])
    assert result.reconstruction_error < 1e-4
    assert result.sink_mask[:, 0].all()


@needs_wikitext
def test_zero_ablation_destroys_and_mean_ablation_keeps(real_model):
    """WikiText-2 test, calibrated on valid (other text): zeroing the massive activations
    multiplies perplexity; setting them to their calibration means barely moves it."""
    calib = calibrate(real_model, WIKITEXT_VALID, seq_len=64, n_seqs=4, batch_size=4, progress=False)
    assert calib.dims

    def ppl(hooks=()):
        return perplexity(real_model, WIKITEXT_TEST, seq_len=64, n_seqs=4, batch_size=4, hooks=hooks,
                          progress=False).perplexity

    base = ppl()
    zero = ppl(ablate_massive(real_model, "zero", calibration=calib))
    mean = ppl(ablate_massive(real_model, "mean", calibration=calib))
    assert zero > 2 * base
    assert abs(mean / base - 1) < 0.05
    assert zero / base - 1 > 20 * abs(mean / base - 1)


@pytest.mark.filterwarnings("ignore:.*runs in torch.bfloat16")  # the precision warning, expected here
def test_bfloat16_finds_the_same_top_entry(default_model):
    """The offline models load in bfloat16 too (from the same float32 cache)."""
    half = load_model("default", dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    exact = find_massive(default_model, TEXT).by_dim().iloc[0]
    approx = find_massive(half, TEXT).by_dim().iloc[0]
    assert (approx.pos, approx.dim) == (exact.pos, exact.dim)
    assert approx.value == pytest.approx(exact.value, rel=0.05)


def test_the_lse_path_gives_the_eager_tables(real_model):
    """Issue 41: on the real models the analyses read from q, k and the kernel's log-sum-exp give
    the eager pattern's tables: every number to 1e-5 (relative where above 1), and the terms of
    the decomposition to 1e-5 of the attention output's scale (its per-head constancy statistics
    are not compared: a sink-saturated head's content term is rounding, which either path
    rounds its own way)."""
    from massive_lens.attention import dormant_heads, find_sinks, sink_attention, sink_census

    texts = [TEXT, OTHER]
    assert torch.equal(find_sinks(real_model, texts, attention="eager").mask,
                       find_sinks(real_model, texts, attention="lse").mask)
    for run in (lambda a: sink_attention(real_model, texts, attention=a),
                lambda a: sink_census(real_model, texts, attention=a),
                lambda a: dormant_heads(real_model, texts, attention=a)):
        eager, lse = run("eager"), run("lse")
        assert (eager.attention, lse.attention) == ("eager", "lse")
        fa, fb = eager.to_frame(), lse.to_frame()
        assert list(fa.columns) == list(fb.columns) and len(fa) == len(fb) > 0
        num = fa.select_dtypes("number").columns
        a, b = torch.tensor(fa[num].to_numpy(float)), torch.tensor(fb[num].to_numpy(float))
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True), float((a - b).abs().nan_to_num().max())
        assert fa.drop(columns=num).equals(fb.drop(columns=num))
    eager, lse = (decompose_attention(real_model, texts, attention=a) for a in ("eager", "lse"))
    assert torch.equal(eager.sink_mask, lse.sink_mask)
    scale = float((eager.sink + eager.content).abs().amax())
    for x, y in ((eager.sink, lse.sink), (eager.content, lse.content)):
        assert float((x - y).abs().max()) < 1e-5 * scale
