"""What :func:`~massive_lens.origin.trace.trace_origin` traces: the ``dim`` and ``pos`` it is given,
checked; the positions its capture pass keeps; and the entries it then traces, largest ``|peak|``
first (the text's token-specific massive entries, else those of outlier dimensions, else the
largest value where ``dim`` or ``pos`` points).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from massive_lens.core.attention_pass import attention_reading, choose_path
from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import TOKEN_KINDS, Batch
from massive_lens.detect.find import find_in_batch
from massive_lens.errors import MassiveLensError
from massive_lens.origin.blocks import d_mlp
from massive_lens.origin.capture import Capture

CAPTURE_BUDGET = 1 << 30  # bytes of per-neuron activations kept when tracing all positions


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
                      criterion: Criterion) -> torch.Tensor:
    """Positions to slice in the capture pass: ``pos``, else all (or, for a long text on a large
    model, the massive positions from a first detection pass)."""
    seq = batch.tokens.shape[1]
    if pos is not None:
        return torch.tensor([pos])
    if seq * d_mlp(view) * view.n_layers * 12 <= CAPTURE_BUDGET:
        return torch.arange(seq)
    with _reading(view, batch):  # on a long text, the fused kernel (the detection reads the residual only)
        found = find_in_batch(view, batch, criterion, view.chosen_layers(None)).to_frame()
    found = found[found.dim == dim] if dim is not None else found
    if dim is None and (found.scope == "token").any():  # outlier dimensions are traced only when asked
        found = found[found.scope == "token"]
    if found.empty:
        raise MassiveLensError(f"nothing massive to trace in {seq} tokens on {view.name}; pass pos= (and dim=)")
    return torch.tensor(sorted(found.pos.unique().tolist()))


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
