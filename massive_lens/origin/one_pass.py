"""A long text's one pass of :func:`massive_lens.trace_origin`: every term kept at the candidates only.

Tracing every massive entry of a long text (:func:`~massive_lens.origin.targets.capture_found`), the
pass of :mod:`massive_lens.origin.capture` would hold every position's residual terms and read every
query's largest attention. :class:`OnePass` keeps *every* per-layer key (the residual terms, the heads'
outputs, the neuron-level activations) and reads the heads at the candidates only: the first layer
whole (cut to its candidates when it is settled), each later layer at the candidates of the layers
before it, the first position (:data:`PINNED`) at every layer. Once the pass is over, ``choose`` picks
the positions to trace from the entries found; those every layer kept make the Capture, the others are
:attr:`~massive_lens.origin.capture.Capture.missing` (read again by the caller). A few rows a layer go
into buffers allocated once per key (:data:`KEPT_ROWS`), so no small long-lived allocation lands between
a layer's activations (glibc's heap would keep the freed activations below it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.criterion import Criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.reduce import ResidualReducer
from massive_lens.core.tokens import Batch
from massive_lens.origin.capture import LAYERED, SCOPED, Capture, CapturePass

KEPT_ROWS = 64  # rows a layer kept in buffers (more: copies)
# The first position is kept at every layer: where a massive activation is most often born (the attention
# sink's token), a layer after it first passes the loose criterion, which would leave it to a reread (a
# forward of one token costs what reading the weights costs: 0.10-0.15 s on SmolLM2, about 6% of the pass at
# 512 tokens).
PINNED = 1


def capture_one_pass(view: ModelView, batch: Batch, criterion: Criterion,
                     choose: Callable[[ResidualReducer], Tensor], copy: bool = False) -> Capture:
    """One no-grad forward pass over every position of ``batch`` that finds the massive entries under
    ``criterion`` and keeps every key at the candidates only; the Capture holds the positions ``choose``
    picks from the entries found that every layer kept (the others: :attr:`Capture.missing`, with their last
    residual in :attr:`Capture.final` where the last layer kept it). A kept activation the model changes in
    place makes the pass run again with copies (``copy=True``), as in :func:`~massive_lens.origin.capture.capture`.

    >>> from massive_lens import tiny_model
    >>> from massive_lens.core.model_view import ModelView
    >>> view = ModelView(tiny_model("llama"))
    >>> cap = capture_one_pass(view, view.tokenize("Hi there."), Criterion(0.01, 1.5), lambda r: torch.tensor([0]))
    >>> cap.positions.tolist(), cap.layers["resid_post"].shape[:2] == (view.n_layers, 1)
    ([0], True)
    """
    state = OnePass(view, batch, criterion, choose, copy)
    state.run()
    if state.changed_in_place():
        return capture_one_pass(view, batch, criterion, choose, copy=True)
    return state.result()


class OnePass(CapturePass):
    """:class:`~massive_lens.origin.capture.CapturePass` over every position, keeping every key at the rows
    :meth:`rows_at` names as its hooks fire (in :data:`KEPT_ROWS` buffers), the heads read at the same rows."""

    CUT = (*SCOPED, *LAYERED, "z", "mlp_raw", "attn_raw")

    def __init__(self, view: ModelView, batch: Batch, criterion: Criterion,
                 choose: Callable[[ResidualReducer], Tensor], copy: bool = False) -> None:
        self.choose = choose
        self.looked: dict[int, Tensor | None] = {}  # layer -> the queries its heads were read at
        self.rows: dict[int, Tensor | None] = {}  # layer -> the positions its hooks keep (rows_at)
        self.buffers: dict[str, Tensor] = {}  # key -> [layer, KEPT_ROWS, _], the rows kept
        self.last: Tensor | None = None  # the last layer's resid_post, whole: the check of a reread
        super().__init__(view, batch, torch.arange(batch.tokens.shape[1]), criterion, copy)
        self.candidate[:PINNED] = True

    def max_queries(self) -> Callable[[int], Tensor | None]:
        return self.looking

    def looking(self, layer: int) -> Tensor | None:  # the queries the heads are read at
        self.looked[layer] = self.rows_at(layer)
        return self.looked[layer]

    def read_rows(self, layer: int) -> Tensor | None:
        return self.looked.get(layer)

    def rows_at(self, layer: int) -> Tensor | None:
        """The positions ``layer`` keeps as its hooks fire: every one at the first layer (cut to its
        candidates when it is settled), then the candidates of the layers before it."""
        if layer not in self.rows:
            self.rows[layer] = None if not self.rows else self.candidate.nonzero()[:, 0]
        return self.rows[layer]

    def hold(self, key: str, layer: int, act: Float[Tensor, "batch pos _"]) -> None:
        """A :attr:`CUT` key of a block: its rows at :meth:`rows_at`, into a buffer."""
        if key not in self.CUT or layer < 0:
            self.hold_part(key, layer, act[0].detach())
            return
        if key == "resid_post" and layer == self.view.n_layers - 1:  # whole: the check of a reread
            self.last = act[0].detach().to("cpu", torch.float32, copy=True)
        rows = self.rows_at(layer)
        if rows is None:  # the first layer: whole, cut when it is settled
            self.hold_part(key, layer, act[0].detach())
            return
        src, buf = act[0].detach(), self.buffers.get(key)  # no small allocation between
        buf = self.buffers.setdefault(key, torch.empty(self.view.n_layers, KEPT_ROWS, src.shape[-1])) \
            if buf is None else buf
        if len(rows) > KEPT_ROWS or src.shape[-1] != buf.shape[-1]:
            self.store[key, layer] = src[rows.to(src.device)].to("cpu", torch.float32)
        elif src.dtype == buf.dtype and src.device == buf.device:  # gathered into the buffer: no copy between
            self.store[key, layer] = torch.index_select(src, 0, rows, out=buf[layer, :len(rows)])
        else:
            self.store[key, layer] = buf[layer, :len(rows)].copy_(src[rows.to(src.device)])

    def settle(self, layer: int, mag: Tensor, scale: Tensor) -> None:
        if self.rows.get(layer) is not None:  # kept at rows_at as its hooks fired
            self.kept[layer] = self.rows[layer]
        super().settle(layer, mag, scale)

    def cut_to(self, layer: int, rows: Tensor) -> None:
        super().cut_to(layer, rows)
        self.rows[layer] = rows

    def result(self) -> Capture:
        self.chosen()
        return super().result()

    def chosen(self) -> None:
        """Cut the pass to the positions ``choose`` picks that every layer kept; the others are ``missing``,
        with their last resid_post (``final``) where the last layer kept them whole."""
        chosen = self.choose(self.reducer).long()
        sets = (*self.kept.values(), *(rows for rows in self.looked.values() if rows is not None), chosen)
        every = torch.stack([torch.isin(chosen, rows) for rows in sets]).all(0)
        self.positions, self.missing = chosen[every], chosen[~every]
        last = self.kept.get(self.view.n_layers - 1, self.missing)
        self.final = self.last[self.missing] if self.last is not None and bool(torch.isin(self.missing, last).all()) \
            else None
        for (key, layer), part in list(self.store.items()):
            rows = self.looked.get(layer) if key == "pattern" else self.kept.get(layer) if key in self.CUT and \
                layer >= 0 else None
            self.store[key, layer] = part[self.positions if rows is None else torch.searchsorted(rows, self.positions)]
        for key in LAYERED:
            for p in self.plans:
                if (key, p.layer) in self.store:
                    if key not in self.layered:
                        self.layered[key] = torch.zeros(self.view.n_layers, len(self.positions), self.view.d_model)
                    self.layered[key][p.layer] = self.store.pop((key, p.layer))
                    self.filled.add((key, p.layer))
        self.kept, self.versions = {}, {}
