"""Calibration for the interventions: what a model's massive activations and sinks look like
on calibration text.

One pass finds the massive dims (the layer where each first appears, every layer where it
is massive, its mean value there) and the sinks of every calibration sequence, by the one
rule of :class:`~massive_lens.core.criterion.SinkRule`: a position is a sink when it draws
attention as one or carries a massive activation that persists across layers; a dim that
crosses the criterion at one early layer makes no sink. A second pass measures, per layer
and head, the mean sink term, sink key and sink value at those sinks. Both passes read attention
from the one attention pass (:func:`~massive_lens.core.attention_pass.attention_pass`) on the path
:func:`~massive_lens.core.attention_pass.choose_path` picks: the eager pattern, or q, k, v and the
fused kernel's log-sum-exp (:mod:`massive_lens.core.lse`; always on nnsight): the same numbers, to
float rounding.

During an intervention on new text the sinks must be known before the layers where they are
used, so an intervention without ``sinks=`` finds them *online* with a rule fitted here:
the first token when it is a sink in most calibration sequences, plus any later position
where a dim that marks the calibration's later sinks is massive at their first massive
layer, at no less than ``ONLINE_GATE`` of its calibration median there. The calibration
says how well that rule reproduces the full one on its own text;
:func:`~massive_lens.run_interventions` does not rely on it: it finds each evaluation
batch's sinks with the full rule first and hands them over.

>>> from massive_lens import tiny_model
>>> calib = calibrate(tiny_model("qwen2"), "Calibration text. " * 20, seq_len=16, n_seqs=2,
...                   progress=False)
>>> calib.detect_layer is None, tuple(calib.sink_v.shape), calib.sinks.describe()
(True, (4, 2, 16), '1 per sequence: first 2')
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.attention.sinks import FOUND, SinkSet, sinks_from
from massive_lens.core.attention_pass import attention_pass, choose_path
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, SinkEvidence, SinkRule, as_criterion, as_rule, massive_mask
from massive_lens.core.fmt import short
from massive_lens.core.model_view import ModelView
from massive_lens.core.outliers import OutlierTally, token_specific
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.arm_stats import TemplateTally, build_pool
from massive_lens.interventions.calibration_result import Calibration
from massive_lens.interventions.sink_stats import sink_pass as _sink_pass

ONLINE_GATE = 0.5  # online, a later sink's dim must reach half its calibration median at the sink layer


def calibrate(
    model: Any,
    corpus: Corpus | Calibration = None,
    *,
    seq_len: int = 128,
    n_seqs: int = 16,
    batch_size: int = 8,
    criterion: Criterion | None = None,
    rule: SinkRule | None = None,
    outliers: str = "exclude",
    attention: str = "auto",
    progress: bool = True,
) -> Calibration:
    """Measure the massive dims, their means, the sinks and the sink keys/values/terms on ``corpus``.

    The massive dims (the layer where each first appears, every layer where it is massive,
    its mean there) and the sinks of each sequence (``rule``: positions that draw attention
    as sinks or carry a persistent massive activation, else the first token) come from one
    pass over all sequences; the sink keys, values and terms from a second.

    Args:
        model: a TransformerLens-style model, or an nnsight model (the sink rule's attention and
            the sink statistics then come from the kernel's log-sum-exp, :mod:`massive_lens.core.lse`).
        corpus: calibration text (a file, a string, strings, ``hf:`` name, a token tensor;
            None: the offline default text), or a :class:`Calibration`, returned unchanged
            (the other arguments are then ignored). Use other text than the evaluation text.
        seq_len: tokens per sequence (BOS included; default 128), for text input.
        n_seqs: calibration sequences (default 16), for text input.
        batch_size: sequences per forward pass (default 8).
        criterion: when a value is massive (None: ``Criterion()``).
        rule: when a position is a sink (None: ``SinkRule()``).
        outliers: ``"exclude"`` (default) leaves the entries of outlier dimensions (massive at
            most tokens of a layer, see ``docs/detection.md``) out of the massive dims, so no
            intervention edits them; ``"include"`` keeps them. It sets ``criterion.outliers``.
        attention: how both passes read attention: ``"auto"`` (default;
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"eager"`` (the pattern) or ``"lse"``
            (q, k and the fused kernel's log-sum-exp; Hugging Face models).
        progress: show a progress bar.

    Returns:
        A :class:`Calibration`.

    Raises:
        MassiveLensError: if ``model`` is not a TransformerLens model, ``seq_len`` or
            ``n_seqs`` is out of range, or the corpus is too short or cannot be read.

    >>> from massive_lens import tiny_model
    >>> calib = calibrate(tiny_model("qwen2"), "Calibration text. " * 20, seq_len=16, n_seqs=2,
    ...                   progress=False)
    >>> calib.detect_layer is None, tuple(calib.sink_v.shape)
    (True, (4, 2, 16))
    """
    if isinstance(corpus, Calibration):
        return _of_this_model(model, corpus)
    view, rule = ModelView(model), as_rule(rule)
    criterion = replace(as_criterion(criterion), outliers=outliers)  # checks the choice
    tokens = sequences(view, corpus, seq_len, n_seqs)
    choose_path(view, attention, view.full_batch(tokens[:1]))  # a path that cannot run is refused before any pass
    chunks = [(start, tokens[start:start + batch_size]) for start in range(0, len(tokens), batch_size)]
    bar = tqdm(total=2 * len(chunks), desc="calibrate", disable=not progress, leave=False)
    massive = _massive_pass(view, chunks, criterion, rule, bar, attention)
    sinks, entries, first_massive = massive["sinks"], massive["entries"], massive["first_massive"]
    counts, sums, squares = massive["counts"], massive["sums"], massive["squares"]
    dims_at = {layer: counts[layer].nonzero().flatten() for layer in range(view.n_layers) if bool(counts[layer].any())}
    means_at = {layer: (sums[layer, d] / counts[layer, d]).float() for layer, d in dims_at.items()}
    vars_at = {layer: (squares[layer, d] / counts[layer, d] - (sums[layer, d] / counts[layer, d]) ** 2).clamp(min=0)
               .float() for layer, d in dims_at.items()}
    first: dict[int, int] = {}
    for layer, d in sorted(dims_at.items()):
        for dim in d.tolist():
            first.setdefault(dim, layer)
    dims = {layer: torch.tensor(sorted(d for d, f in first.items() if f == layer))
            for layer in sorted(set(first.values()))}
    means = {layer: means_at[layer][torch.isin(dims_at[layer], d)] for layer, d in dims.items()}
    at_sinks = first_massive[sinks.mask]
    sink_from = int(at_sinks.min()) if len(at_sinks) and int(at_sinks.min()) < view.n_layers else -1
    attn_layers = tuple(range(sink_from + 1, view.n_layers))
    online = _fit_online(sinks.mask, entries)
    stats = _sink_pass(view, model, chunks, sinks.mask, attn_layers, bar, attention=attention)
    bar.close()
    return Calibration(
        source=describe_source(corpus), dims=dims, means=means, attn_layers=attn_layers, criterion=criterion,
        n_seqs=len(tokens), dims_at=dims_at, means_at=means_at, sinks=sinks, rule=rule, **stats, **online,
        outlier_dims=massive["outlier_dims"], model_name=view.name, d_model=view.d_model, vars_at=vars_at,
        pool=build_pool(entries, massive["kinds"]), template=massive["template"],
        template_seen=massive["template_seen"],
    )


def _massive_pass(view: ModelView, chunks: list[tuple[int, Tensor]], criterion: Criterion, rule: SinkRule,
                  bar: Any, attention: str) -> dict[str, Any]:
    """Massive entries (layer, seq, pos, dim, value), per-layer sums and counts, and the sinks."""
    n_layers, d_model = view.n_layers, view.d_model
    sums = torch.zeros(n_layers, d_model, dtype=torch.float64)
    counts = torch.zeros(n_layers, d_model, dtype=torch.float64)
    squares = torch.zeros(n_layers, d_model, dtype=torch.float64)
    template = TemplateTally(n_layers, d_model)  # the post-norm vectors of spike-carrying tokens
    entries: list[Tensor] = []  # token-specific entries, for the online sink rule
    gathered: list[tuple[SinkEvidence, Tensor]] = []
    tally = OutlierTally()  # the whole calibration text is one run: its outlier dimensions, decided once
    for layer in range(n_layers) if view.serves_patterns else ():  # the sink rule reads every layer's pattern
        view.hook_name(layer, "attn.hook_pattern")  # (a model without one in a layer is refused, naming the hook)
    for start, chunk in chunks:
        batch = view.full_batch(chunk)
        evidence = SinkEvidence(batch.mask, n_layers, rule, criterion, outliers=tally)
        template.start(batch.mask)

        def on_resid(resid: Tensor, hook: Any, layer: int, start: int = start,
                     evidence: SinkEvidence = evidence) -> None:
            every = massive_mask(resid, replace(criterion, outliers="include"))
            evidence.add_massive(layer, every)  # counts the layer in the run's tally too
            values = resid.detach().double() * every
            sums[layer] += values.sum((0, 1)).cpu()
            counts[layer] += every.sum((0, 1)).double().cpu()
            squares[layer] += (values * values).sum((0, 1)).cpu()
            specific = token_specific(every)
            template.carry(specific)
            idx = specific.nonzero()  # the run's outlier dims are left out below
            if len(idx):
                value = resid[idx[:, 0], idx[:, 1], idx[:, 2]].double()
                entries.append(torch.stack([torch.full_like(value, layer), idx[:, 0].double() + start,
                                            idx[:, 1].double(), idx[:, 2].double(), value], 1).cpu())

        hooks = [(view.hook_name(layer, "resid_post"), partial(on_resid, layer=layer)) for layer in range(n_layers)]
        hooks += template.hooks(view)
        # the sink rule's key attention from the pass; the residual stream's massive entries from on_resid
        attention_pass(view, batch, None, path=choose_path(view, attention, batch), evidence=evidence,
                       evidence_resid=False, hooks=hooks, stop_after=hooks[-1][0])
        gathered.append((evidence, view.token_kinds(batch)))
        bar.update()
    scope = torch.stack([tally.at(layer) for layer in range(n_layers)])  # [layer d_model] outlier-dimension entries
    if criterion.outliers == "exclude":
        sums[scope], counts[scope], squares[scope] = 0.0, 0.0, 0.0
    entries = [e[~scope[e[:, 0].long(), e[:, 3].long()]] for e in entries]
    found = [sinks_from(evidence, kinds) for evidence, kinds in gathered]
    first = [evidence.first_massive for evidence, _ in gathered]
    by_rule = torch.cat([torch.as_tensor(f.by_attention) | torch.as_tensor(f.by_massive) for f in found])
    fallback = int((~by_rule.any(-1)).sum())
    source = FOUND + (f"; the first token in {fallback} sequence(s) with none" if fallback else "")
    sinks = SinkSet(torch.cat([f.mask for f in found]), torch.cat([f.kinds for f in found]), source,
                    torch.cat([f.by_attention for f in found]), torch.cat([f.by_massive for f in found]))
    return dict(sums=sums, counts=counts, squares=squares, sinks=sinks, first_massive=torch.cat(first),
                kinds=torch.cat([kinds for _, kinds in gathered]), template=template.template(),
                template_seen=template.seen(),
                entries=torch.cat(entries) if entries else torch.zeros(0, 5, dtype=torch.float64),
                outlier_dims=scope.any(0).nonzero().flatten())


def _fit_online(mask: Bool[Tensor, "seq pos"], entries: Tensor) -> dict[str, Any]:
    """The online sink rule (see the module docstring) and how it compares on the calibration text."""
    sink_first = bool(mask[:, 0].float().mean() >= 0.5)
    later = mask.clone()
    later[:, 0] = False
    seq, pos = entries[:, 1].long(), entries[:, 2].long()
    at_later = entries[later[seq, pos]] if len(entries) else entries
    sink_layer, sink_dims, sink_gate = -1, torch.zeros(0, dtype=torch.long), torch.zeros(0)
    online = torch.zeros_like(mask)
    online[:, 0] = sink_first
    if len(at_later):
        sink_layer = int(at_later[:, 0].min())
        at_layer = at_later[at_later[:, 0] == sink_layer]
        sink_dims = at_layer[:, 3].long().unique()
        sink_gate = torch.stack([ONLINE_GATE * at_layer[at_layer[:, 3] == d, 4].abs().median()
                                 for d in sink_dims.tolist()]).float()
        cand = entries[(entries[:, 0] == sink_layer) & torch.isin(entries[:, 3].long(), sink_dims)]
        gate = sink_gate[torch.searchsorted(sink_dims, cand[:, 3].long())]
        cand = cand[(cand[:, 4].abs() >= gate) & (cand[:, 2] > 0)]
        online[cand[:, 1].long(), cand[:, 2].long()] = True
    online[~online.any(-1), 0] = True  # as the hooks do: a sequence with none falls back to its first token
    return dict(sink_first=sink_first, sink_dims=sink_dims, sink_gate=sink_gate, sink_layer=sink_layer,
                online_missed=int((mask & ~online).sum()), online_extra=int((online & ~mask).sum()))


def describe_source(corpus: Any) -> str:
    """A short label for a corpus: the file name, ``default text``, or ``a token tensor``."""
    if corpus is None:
        return "default text"
    if isinstance(corpus, Tensor):
        return "a token tensor"
    return short(corpus) if isinstance(corpus, (str, os.PathLike)) else f"{type(corpus).__name__} corpus"


def _of_this_model(model: Any, calib: Calibration) -> Calibration:
    """``calib`` itself, refused when it was measured on a model of other sizes (layers, heads,
    head width, key/value heads): its means would be applied to the wrong entries."""
    view = ModelView(model)
    if (calib.model_name and calib.model_name != view.name) or (calib.d_model and calib.d_model != view.d_model):
        raise MassiveLensError(f"this Calibration was measured on {calib.model_name} (d_model {calib.d_model}), not "
                               f"on {view.name} (d_model {view.d_model}): its means and sink dims belong to that "
                               "model; calibrate this model: calibrate(model, text)")
    cfg = view.cfg
    want = (view.n_layers, cfg.n_heads, cfg.d_head, getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    have = (*calib.sink_z.shape, calib.sink_k.shape[1])
    # the stack is as wide as the widest layer (local and global layers may differ in head width)
    if have[:2] != want[:2] or have[3] != want[3] or have[2] < want[2]:
        raise MassiveLensError(f"this Calibration was measured on a model with (layers, heads, head width, kv heads) "
                               f"= {tuple(have)}, but {view.name} has {want}; calibrate this model: "
                               "calibrate(model, text)")
    return calib
