"""Edits attached to the model are read on every attention path (issue 48).

The LSE path (:mod:`massive_lens.core.lse`) runs each attention on the fused kernel, where the
bridge's score, pattern and rotary hooks never fire and the heads' output is read before
``hook_z``. So with an edit attached there (a user's permanent hook, a ``model.hooks(...)`` block,
one of the package's interventions entered with ``with``), ``attention="auto"`` must read the
eager pattern and give exactly ``attention="eager"``'s table, ``"lse"`` must refuse by name, and
once the edit is gone ``"auto"`` goes back to the LSE path. Each edit is planted strong enough to
move every analysis's table (new sinks by attention), and every hook point the rule leaves to the
LSE path is checked to be honoured there: an edit at it moves both paths' logits alike. The
length crossover (:data:`~massive_lens.core.attention_pass.LSE_FROM`: ``"auto"`` reads the eager
pattern on short texts anyway) is set to 0 here, so ``"auto"`` decides by the edit at every length.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import untouched

from massive_lens import MassiveLensError, load_model, tiny_model
from massive_lens.attention import decompose_attention, dormant_heads, find_sinks, sink_attention, sink_census
from massive_lens.core.attention_pass import choose_path
from massive_lens.core.lse import EAGER, LSE, attached_attention_edits, lse_run, lse_support
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import byte_tokenizer
from massive_lens.interventions import Intervention, force_self_attention, scale_sink_attention, zero_dormant_heads
from massive_lens.metrics import perplexity
from massive_lens.models.tiny import tiny_config

TEXT = ["The cat sat on the mat, and then the dog ran. Birds flew over the old house.",
        "A new line starts here; the river runs past the mill and into the sea."]
SINK = 5  # the position the planted pattern and score edits make a sink
FAMILIES = ("llama", "gpt2")
# the kernel's float32 attention against the eager softmax's (test_lse.py: 1e-5); same-path tables are identical
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def _long_texts(monkeypatch):
    """Every text counts as long: ``"auto"`` takes the LSE path unless an edit is attached."""
    monkeypatch.setattr("massive_lens.core.attention_pass.LSE_FROM", 0)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


# ------------------------------------------------------------------------------------------- the edits
def _to_sink(pattern: torch.Tensor, hook: Any, pos: int = SINK) -> torch.Tensor:
    """Every query after ``pos`` puts all its attention on ``pos`` (every head)."""
    out = pattern.clone()
    out[..., pos + 1:, :] = 0.0
    out[..., pos + 1:, pos] = 1.0
    return out


def _score_bonus(scores: torch.Tensor, hook: Any) -> torch.Tensor:
    """A large logit bonus on key ``SINK`` (masked entries stay masked)."""
    out = scores.clone()
    out[..., SINK] = out[..., SINK] + 30.0
    return out


def _every(model: Any, hook: str) -> list[str]:
    view = ModelView(model)
    return [view.hook_name(layer, hook) for layer in range(view.n_layers)]


@contextlib.contextmanager
def _permanent(model: Any, hook: str, fn: Callable) -> Iterator[None]:
    for name in _every(model, hook):
        model.add_hook(name, fn, is_permanent=True)
    try:
        yield
    finally:
        model.reset_hooks(including_permanent=True)


def _plant(kind: str, model: Any) -> contextlib.AbstractContextManager:
    """Enter one kind of attention edit on ``model`` (left with ``with``, removed on exit)."""
    if kind == "permanent pattern hook":
        return _permanent(model, "attn.hook_pattern", _to_sink)
    if kind == "permanent score hook":
        return _permanent(model, "attn.hook_attn_scores", _score_bonus)
    if kind == "model.hooks block":
        return model.hooks(fwd_hooks=[(name, _to_sink) for name in _every(model, "attn.hook_pattern")])
    if kind == "scale_sink_attention":
        return scale_sink_attention(model, 50.0)  # the first token becomes a sink by the attention it draws
    if kind == "force_self_attention":
        return force_self_attention(model, 3)
    if kind == "zero_dormant_heads":  # an edit of hook_z, which the LSE path reads before the hook
        view = ModelView(model)
        return zero_dormant_heads(model, heads=[(layer, 0) for layer in range(view.n_layers - 1)])
    raise AssertionError(kind)


KINDS = ("permanent pattern hook", "permanent score hook", "model.hooks block", "scale_sink_attention",
         "force_self_attention", "zero_dormant_heads")


# -------------------------------------------------------------------------------------- the analyses
def _sinks(model: Any, attention: str) -> tuple[Any, pd.DataFrame]:
    found = find_sinks(model, TEXT, attention=attention)
    rows = pd.DataFrame({"sink": found.mask.flatten().numpy(),
                         "by_attention": torch.as_tensor(found.by_attention).flatten().numpy()})
    return found.attention, rows


def _table(fn: Callable, **options: Any) -> Callable[[Any, str], tuple[str, pd.DataFrame]]:
    def run(model: Any, attention: str) -> tuple[str, pd.DataFrame]:
        result = fn(model, TEXT, attention=attention, **options)
        frame = result.to_frame()
        if fn is decompose_attention:  # the terms themselves, not only their statistics
            frame = frame.assign(sink_norm=float(result.sink.norm()), content_norm=float(result.content.norm()))
        return result.attention, frame

    return run


ANALYSES = {"sink_attention": _table(sink_attention), "dormant_heads": _table(dormant_heads),
            "decompose_attention": _table(decompose_attention), "sink_census": _table(sink_census),
            "find_sinks": _sinks}
# find_sinks and sink_census answer with sink positions: a query forced onto itself, or heads' zeroed
# outputs, move attention in a random tiny model but make no new sink, so there only the path and the
# agreement are checked (the other edits make sinks)
UNMOVED = {("find_sinks", "zero_dormant_heads"), ("find_sinks", "force_self_attention"),
           ("sink_census", "zero_dormant_heads"), ("sink_census", "force_self_attention")}


def _outcome(analysis: str, model: Any, attention: str) -> tuple[str, pd.DataFrame | str]:
    """The path and table, or the error text where the analysis refuses (the same on both paths)."""
    try:
        return ANALYSES[analysis](model, attention)
    except MassiveLensError as exc:
        return "error", str(exc)


def _same(a: pd.DataFrame | str, b: pd.DataFrame | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    return a.shape == b.shape and all(
        np.allclose(a[c].to_numpy(float), b[c].to_numpy(float), rtol=RTOL, atol=ATOL, equal_nan=True)
        if pd.api.types.is_numeric_dtype(a[c]) else a[c].equals(b[c])
        for c in a.columns)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_auto_reads_the_edit_as_eager_does_and_lse_refuses(model, kind, analysis):
    with untouched(model):
        path, before = _outcome(analysis, model, "auto")
        assert path == LSE
        with _plant(kind, model):
            assert attached_attention_edits(ModelView(model))
            auto_path, auto = _outcome(analysis, model, "auto")
            eager_path, eager = _outcome(analysis, model, "eager")
            lse_path, refusal = _outcome(analysis, model, "lse")
        after_path, after = _outcome(analysis, model, "auto")
    assert (auto_path, eager_path) in ((EAGER, EAGER), ("error", "error"))
    assert _same(auto, eager)
    if (analysis, kind) not in UNMOVED:
        assert not _same(auto, before), "the edit did not move the table: the test would not see it ignored"
    assert lse_path == "error" and re.search(r"hooks attached at blocks\.\d+\.attn\.hook_.*attention='eager'", refusal)
    assert after_path == LSE and _same(after, before)


def test_every_hook_point_the_rule_leaves_to_the_lse_path_is_honoured_there(model):
    """An edit at each hook point that is not in the rule's list moves the logits alike on both
    paths (and the points in the list do not all fire on the LSE path)."""
    view = ModelView(model)
    assert lse_support(view) is None
    batch = view.tokenize(TEXT)
    plain = view.forward(batch, [])
    points = {id(hp): (name, hp) for name, hp in sorted(model.hook_dict.items(), reverse=True)}
    moved = 0
    for name, hp in points.values():
        handle = hp.register_forward_hook(lambda _m, _i, x: x * 1.1 + 0.05 if torch.is_floating_point(x) else x)
        try:
            listed = attached_attention_edits(view)
            if listed:
                continue
            eager = view.forward(batch, [], check_finite=False)
            with lse_run(view):
                lse = view.forward(batch, [], check_finite=False)
        finally:
            handle.remove()
        assert torch.allclose(eager, lse, atol=1e-4), name
        moved += not torch.allclose(eager, plain, atol=1e-4)
    assert moved > view.n_layers  # the edits were real: most points move the output
    assert attached_attention_edits(view) == []


@pytest.mark.parametrize("hook", ["attn.hook_pattern", "attn.hook_attn_scores", "attn.hook_z"])
def test_the_error_names_the_hook_and_the_list_names_each_hooked_point(model, hook):
    view = ModelView(model)
    name = view.hook_name(1, hook)
    with model.hooks(fwd_hooks=[(name, lambda x, hook: x), (view.hook_name(1, "resid_post"), lambda x, hook: x)]):
        assert attached_attention_edits(view) == [name]  # the residual stream's hook is honoured on both paths
        with pytest.raises(MassiveLensError, match=rf"hooks attached at {name.replace('.', '[.]')}"):
            sink_attention(model, TEXT, attention="lse")
    assert attached_attention_edits(view) == []  # the block's exit removed them: nothing left counts


def test_a_torch_hook_on_a_hook_point_and_a_kept_hooks_block_count_until_removed(model):
    """A hook registered on the hook point itself counts; so does one a ``model.hooks(...,
    reset_hooks_end=False)`` block leaves attached (it still edits the eager forward), until removed."""
    view = ModelView(model)
    hp = model.hook_dict[view.hook_name(2, "attn.hook_pattern")]
    handle = hp.register_forward_hook(lambda _m, _i, x: _to_sink(x, None))
    try:
        assert sink_attention(model, TEXT).attention == EAGER
    finally:
        handle.remove()
    with model.hooks(fwd_hooks=[(view.hook_name(2, "attn.hook_pattern"), _to_sink)], reset_hooks_end=False):
        pass
    try:
        assert attached_attention_edits(view) == [view.hook_name(2, "attn.hook_pattern")]
    finally:
        model.reset_hooks()
    assert attached_attention_edits(view) == [] and sink_attention(model, TEXT).attention == LSE


def test_a_residual_edit_stays_on_the_lse_path_and_is_read_there(model):
    """An entered edit of the residual stream runs on both paths, so ``"auto"`` keeps the kernel and
    gives the eager table under it."""
    view = ModelView(model)
    edit = [(view.hook_name(1, "resid_post"), lambda x, hook: x * 3.0)]
    before = sink_attention(model, TEXT).to_frame()
    with model.hooks(fwd_hooks=edit):
        lse = sink_attention(model, TEXT)
        eager = sink_attention(model, TEXT, attention="eager")
    assert lse.attention == LSE and _same(lse.to_frame(), eager.to_frame())
    assert not _same(lse.to_frame(), before)


@pytest.mark.slow
def test_the_default_model_reads_an_entered_sink_scaling_on_auto(default_model):
    model = default_model
    text = TEXT[0]
    plain = sink_attention(model, text)
    with scale_sink_attention(model, 0.25):
        auto = sink_attention(model, text)
        eager = sink_attention(model, text, attention="eager")
        with pytest.raises(MassiveLensError, match="attention='eager'"):
            sink_attention(model, text, attention="lse")
    assert (plain.attention, auto.attention) == (LSE, EAGER)
    assert _same(auto.to_frame(), eager.to_frame()) and not _same(auto.to_frame(), plain.to_frame())
    assert sink_attention(model, text).attention == LSE


# ---------------------------------------------------------------------------------------- tiny γ
def _limit(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
    """γ -> 0 computed here: no attention on the first token, each row renormalised over the others
    (the first token's own row, all on itself, kept)."""
    p = pattern.double()
    rest = 1 - p[..., 0]
    out = p.clone()
    out[..., 0] = 0.0
    out = torch.where((rest > 0)[..., None], out / rest.clamp(min=1e-300)[..., None], p)
    return out.to(pattern.dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_gamma_gives_a_finite_perplexity_at_the_limit(family):
    model = tiny_model(family)
    text = " ".join(TEXT) * 4
    options = dict(seq_len=32, n_seqs=2, progress=False)
    tiny = perplexity(model, text, hooks=scale_sink_attention(model, 1e-8), **options)
    limit = perplexity(model, text, hooks=[(name, _limit) for name in _every(model, "attn.hook_pattern")], **options)
    assert torch.isfinite(tiny.per_seq).all()
    # losses of float32 logits, a γ of 1e-8 from the limit: equal to float32 rounding of a loss
    assert torch.allclose(tiny.per_seq, limit.per_seq, rtol=1e-5)
    assert math.isfinite(tiny.perplexity)


@pytest.mark.parametrize("gamma", [1e-60, 1e300])
def test_a_gamma_outside_float32_is_refused(gamma):
    with pytest.raises(MassiveLensError, match="float32"):
        scale_sink_attention(tiny_model("llama"), gamma)


# ---------------------------------------------------------------------------------------- nnsight
def test_nnsight_refuses_attention_edits_by_name():
    """nnsight has no eager path: an attention edit cannot be built for it, and an entered
    intervention (hooks outside a trace) is refused rather than ignored."""
    pytest.importorskip("nnsight")
    cls, config = tiny_config("llama", byte_tokenizer(), {})
    lm = load_model(cls(config).eval(), tokenizer=byte_tokenizer(), backend="nnsight", name="tiny-llama")
    with pytest.raises(MassiveLensError, match="nnsight"):
        scale_sink_attention(lm, 0.25)
    with pytest.raises(MassiveLensError, match="nnsight"):
        force_self_attention(lm, 3)
    user = Intervention(lm, "user_edit", [("blocks.1.hook_resid_post", lambda x, hook: x * 2)])
    with pytest.raises(MassiveLensError, match="nnsight.*with"), user:
        pass
    assert attached_attention_edits(ModelView(lm)) == []
    assert sink_attention(lm, TEXT).attention == LSE


def test_the_callers_own_hooks_count_by_name_and_by_a_filter_of_names(model):
    """choose_path(hooks=): an edit the caller runs in the same forward counts as attached, named
    or matched by a filter (TransformerLens takes both), so 'auto' reads it on the eager path."""
    view = ModelView(model)
    pattern = view.hook_name(1, "attn.hook_pattern")
    batch = view.tokenize(TEXT)
    edit = lambda x, hook: x  # noqa: E731
    assert attached_attention_edits(view, [(view.hook_name(1, "resid_post"), edit)]) == []
    assert attached_attention_edits(view, [(pattern, edit)]) == [pattern]
    assert attached_attention_edits(view, [(lambda name: name == pattern, edit)]) == [pattern]
    with pytest.raises(MassiveLensError, match="hook_pattern"):
        choose_path(view, LSE, batch, hooks=[(lambda name: name.endswith("hook_pattern"), edit)])


def test_an_edit_under_any_name_the_bridge_takes_counts_as_that_hook_point(model):
    """A bridge lists one hook point under several names, its own and TransformerLens's (``blocks.1.attn.hook_z``
    is ``blocks.1.attn.o.hook_in``, ``blocks.1.hook_q_input`` is ``blocks.1.attn.hook_q_input``); its forward
    attaches a hook given under any of them to that point. So ``choose_path(hooks=)`` counts the edit under each
    name (by the point, not the name): 'auto' reads it on the eager path, 'lse' refuses it, naming the point."""
    view = ModelView(model)
    assert lse_support(view) is None
    batch = view.tokenize(TEXT)
    edit = lambda x, hook: x  # noqa: E731
    names: dict[int, list[str]] = {}
    for name, hp in model.hook_dict.items():
        names.setdefault(id(hp), []).append(name)
    listed = attached_attention_edits(view, [(lambda name: True, edit)])  # every point the LSE path skips
    aliased = [(point, other) for point in listed if len(names[id(model.hook_dict[point])]) > 1
               for other in names[id(model.hook_dict[point])]]  # the point's every name, its own and the aliases
    assert any(".hook_z" in other for _, other in aliased)  # the case this test is for
    checked = 0
    for point, other in aliased:
        try:
            with model.hooks(fwd_hooks=[(other, edit)]):  # the bridge's forward puts it on that point
                assert attached_attention_edits(view) == [point]
        except ValueError:  # a point the bridge keeps switched off (use_attn_in, use_split_qkv_input): no edit runs
            continue
        checked += 1
        assert attached_attention_edits(view, [(other, edit)]) == [point], other
        assert choose_path(view, "auto", batch, hooks=[(other, edit)]) == EAGER
        with pytest.raises(MassiveLensError, match=re.escape(point)):
            choose_path(view, LSE, batch, hooks=[(other, edit)])
    assert checked
