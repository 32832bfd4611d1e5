"""What :func:`~massive_lens.origin.trace.trace_origin` traces: the ``dim`` and ``pos`` it is given,
checked; the positions its capture pass keeps; and the entries it then traces, largest ``|peak|``
first (the text's token-specific massive entries, else those of outlier dimensions, else the
largest value where ``dim`` or ``pos`` points).

Every entry of a text (no ``pos``; from :data:`ONE_PASS_FROM` tokens, now every length, and wherever every
position's neuron activations would pass :data:`CAPTURE_BUDGET`) is traced in one pass that keeps each layer's
terms at the candidate positions only (:func:`capture_found`); a traced position that was not a candidate from
the first layer is read again by a forward of the text up to it (a causal model's residual stream there does
not depend on what follows; checked against the full pass's last layer, else the full text is read again).
Where that pass finds nothing to trace and the text is within the budget, the every-position capture runs
instead (a given ``dim`` then traces its largest value, as on a short text).
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.attention_pass import attention_reading, choose_path
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.reduce import ResidualReducer
from massive_lens.core.tokens import TOKEN_KINDS, Batch
from massive_lens.detect.find import find_in_batch
from massive_lens.errors import MassiveLensError
from massive_lens.origin.blocks import d_mlp
from massive_lens.origin.capture import Capture, capture
from massive_lens.origin.experts import find_experts
from massive_lens.origin.one_pass import capture_one_pass

CAPTURE_BUDGET = 1 << 30  # bytes of per-neuron activations kept when tracing all positions
# Tracing every entry of a text of this many tokens or more takes the candidates' one pass (capture_found),
# not the every-position capture: that one holds five [layer, pos, d_model] residual terms whole and reads
# every query's largest attention. Measured on SmolLM2 (benchmarks.length, docs/benchmarks.md, issue 50 round
# 5): every-position 1.25-1.30x the SDPA forward's time and 2.1-3.4x its memory at 512-1,536 tokens, the one
# pass within 1.1x; at 64-256 tokens every-position 1.0-1.2x a forward's time and 1.9-3.2x its memory, the one
# pass 0.93-1.01x and 0.56-0.94x: so every length (a mixture of experts, a given pos, and the one pass's
# fallback where it finds nothing still take the every-position capture).
ONE_PASS_FROM = 0
PREFIX_TOL = 1e-4  # relative (norm): the last residual read from the text up to a position vs the full pass


def check_index(view: ModelView, dim: int | None, pos: int | None, seq: int) -> tuple[int | None, int | None]:
    """``dim`` checked against the model, ``pos`` against the text's ``seq`` tokens (a negative one counted
    from the end, returned as its index)."""
    if dim is not None and not (isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < view.d_model):
        raise MassiveLensError(f"dim={dim!r} is out of range: {view.name} has d_model={view.d_model}")
    if pos is not None:
        if not (isinstance(pos, int) and not isinstance(pos, bool) and -seq <= pos < seq):
            raise MassiveLensError(f"pos={pos!r} is out of range: the text has {seq} tokens")
        pos %= seq
    return dim, pos


def capture_positions(view: ModelView, batch: Batch, pos: int | None, dim: int | None,
                      criterion: Criterion) -> torch.Tensor | None:
    """Positions to slice in the capture pass: ``pos``, else all (or, from :data:`ONE_PASS_FROM` tokens
    or over :data:`CAPTURE_BUDGET`, None: :func:`capture_found`'s one pass; with a mixture of experts
    every position within the budget, over it the massive positions from a first detection pass)."""
    seq = batch.tokens.shape[1]
    if pos is not None:
        return torch.tensor([pos])
    if _within_budget(view, seq) and seq < ONE_PASS_FROM:
        return torch.arange(seq)
    if all(find_experts(view.model, getattr(block, "mlp", None)) is None for block in view.blocks):
        return None
    if _within_budget(view, seq):  # a mixture of experts: every position where they fit
        return torch.arange(seq)
    with _reading(view, batch):  # on a long text, the fused kernel (the detection reads the residual only)
        found = find_in_batch(view, batch, criterion, view.chosen_layers(None)).to_frame()
    found = found[found.dim == dim] if dim is not None else found
    if dim is None and (found.scope == "token").any():  # outlier dimensions are traced only when asked
        found = found[found.scope == "token"]
    if found.empty:
        raise MassiveLensError(f"nothing massive to trace in {seq} tokens on {view.name}; pass pos= (and dim=)")
    return torch.tensor(sorted(found.pos.unique().tolist()))


def capture_found(view: ModelView, batch: Batch, dim: int | None, criterion: Criterion) -> Capture:
    """One pass over a long text keeping each layer's terms at its candidates, sliced to the massive
    positions found (at ``dim``; token-specific ones where there are any); a position that was not
    kept at every layer is read by a forward of the text up to it, merged in."""
    seq = batch.tokens.shape[1]
    try:
        main = capture_one_pass(view, batch, criterion, partial(_found_positions, view=view, dim=dim, seq=seq))
    except _NothingFound:
        if not _within_budget(view, seq):
            raise
        return capture(view, batch, torch.arange(seq), criterion)  # as on a short text (trace_targets says why)
    if main.missing is None or not len(main.missing):
        return main
    end, extra = int(main.missing.max()) + 1, None
    if batch.pixel_values is None and main.final is not None:  # an image's tokens may attend both ways
        extra = capture(view, Batch(batch.tokens[:, :end], batch.mask[:, :end], batch.has_bos), main.missing, None)
        last = extra.layers["resid_post"][-1]
        if float(((last - main.final).norm(dim=-1) / main.final.norm(dim=-1).clamp(min=1e-12)).max()) > PREFIX_TOL:
            extra = None
    if extra is None:  # not read, or not causal there: the whole text
        extra = capture(view, batch, main.missing, None)
    return _merged(main, extra)


def _found_positions(reducer: ResidualReducer, *, view: ModelView, dim: int | None, seq: int) -> torch.Tensor:
    """The positions of the massive entries found (at ``dim``): the token-specific ones where there are any."""
    found = {(p, d) for _, p, d in reducer.found() if dim is None or d == dim}
    token = {(p, d) for _, p, d in reducer.found("token") if dim is None or d == dim}
    found = token if dim is None and token else found
    if not found:
        raise _NothingFound(f"nothing massive to trace in {seq} tokens on {view.name}; pass pos= (and dim=)")
    return torch.tensor(sorted({p for p, _ in found}))


class _NothingFound(MassiveLensError):
    """The one pass found no massive entry (at ``dim``) to trace."""


def _within_budget(view: ModelView, seq: int) -> bool:  # every position's neuron activations fit CAPTURE_BUDGET
    return seq * d_mlp(view) * view.n_layers * 12 <= CAPTURE_BUDGET


def _merged(a: Capture, b: Capture) -> Capture:
    """One Capture of two at disjoint positions, in position order."""
    order = torch.cat([a.positions, b.positions]).argsort()

    def cat(x: Tensor | None, y: Tensor | None, dim: int = 0) -> Tensor | None:
        return None if x is None or y is None else torch.cat([x, y], dim).index_select(dim, order)

    data = {layer: {k: cat(v, b.neuron_data.get(layer, {}).get(k)) for k, v in d.items()}
            for layer, d in a.neuron_data.items()}
    return dataclasses.replace(
        a, positions=cat(a.positions, b.positions), embed=cat(a.embed, b.embed),
        pos_embed=cat(a.pos_embed, b.pos_embed), resid_pre0=cat(a.resid_pre0, b.resid_pre0),
        layers={k: cat(v, b.layers[k], 1) for k, v in a.layers.items()}, missing=None, final=None,
        neuron_data={layer: {k: v for k, v in d.items() if v is not None} for layer, d in data.items()},
        notes=list(dict.fromkeys([*a.notes, *b.notes])))


def _reading(view: ModelView, batch: Batch) -> Any:
    """The forward on the path :func:`~massive_lens.core.attention_pass.choose_path` takes for ``batch``,
    reading no attention (a null context where neither path runs)."""
    try:
        return attention_reading(view, None, path=choose_path(view, "auto", batch), layers=[])
    except MassiveLensError:
        return contextlib.nullcontext()


def trace_targets(view: ModelView, batch: Batch, cap: Capture, dim: int | None, pos: int | None,
             tokens: list[str], criterion: Criterion) -> tuple[list[dict[str, Any]], str]:
    """The entries to trace, largest ``|peak|`` first, and a note when the default had to trace
    outlier dimensions (no token-specific entry) or left them out."""
    reducer = cap.reducer
    found = {(p, d) for _, p, d in reducer.found()} if reducer is not None else set()
    token = {(p, d) for _, p, d in reducer.found("token")} if reducer is not None else set()
    note = ""
    if dim is None and pos is None and found:
        n_out = len(found - token)
        if token and n_out:
            note = (f"note: {n_out} entr{'y' if n_out == 1 else 'ies'} of outlier dimensions (massive at most tokens "
                    "of a layer) not traced; pass dim= (and pos=) to trace one")
        elif not token:
            note = "note: no token-specific massive activation; tracing the entries of outlier dimensions"
        found = token or found
    chosen = sorted((p, d) for p, d in found if (pos is None or p == pos) and (dim is None or d == dim))
    if not chosen:
        resid = cap.layers["resid_post"].abs()  # [layer, pos, d_model]
        if dim is not None and pos is not None:
            chosen = [(pos, dim)]
        elif pos is not None:
            chosen = [(pos, int(resid[:, 0].amax(0).argmax()))]
        elif dim is not None:
            chosen = [(int(cap.positions[int(resid[..., dim].amax(0).argmax())]), dim)]
        else:
            peak = float(resid.max())
            raise MassiveLensError(
                f"nothing in this {len(tokens)}-token text is massive on {view.name} under {criterion} "
                f"(largest |activation| {peak:,.1f}); pass dim= and pos= to trace one entry anyway, "
                "or lower the criterion, e.g. Criterion(abs_threshold=20, ratio_threshold=100)")
    kinds = view.token_kinds(batch)[0]
    out = []
    for p, d in chosen:
        values = cap.layers["resid_post"][:, cap.index(p), d]
        peak_layer = int(values.abs().argmax())
        scope = "token" if (p, d) in token or (p, d) not in found else "outlier_dim"
        out.append(dict(pos=p, dim=d, token=tokens[p], token_kind=TOKEN_KINDS[int(kinds[p])],
                        massive=(p, d) in found, scope=scope, peak=float(values[peak_layer]), peak_layer=peak_layer,
                        final=float(values[-1])))
    return sorted(out, key=lambda t: -abs(t["peak"])), note
