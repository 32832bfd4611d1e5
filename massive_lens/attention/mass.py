"""Attention mass on the sinks per layer and head, and Gu et al.'s sink metric."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.null_mass import NullReader
from massive_lens.attention.sinks import Sinks, SinkSet, candidate_columns, sink_mask, sinks_from
from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.charts import sink_mass_axes
from massive_lens.core.checks import as_number
from massive_lens.core.criterion import SINK_THRESHOLD, SinkEvidence, first_token_mass, sink_metric
from massive_lens.core.lse import EAGER, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError


@dataclass(frozen=True, kw_only=True)
class SinkAttention(Result):
    """Per layer and head: ``sink_mass`` (mean attention of non-sink queries to the sinks)
    and ``first_token_mass`` (mean attention of the first 64 queries to the first token, Gu et al.).
    ``to_frame()`` columns: ``layer``, ``head``, ``sink_mass``, ``first_token_mass`` and, only where
    the attention has a null slot (``null_kind``: a learned sink logit, gpt-oss's ``s_aux``, or a
    trained slot variant; :func:`~massive_lens.attention.null_mass.off_switch_layers`), ``null_mass``:
    the mean attention of the real queries after the first token to the slot, as
    :func:`~massive_lens.attention.null_mass.null_mass` reports it. ``attention``: ``"lse"`` (from q,
    k and the SDPA kernel's log-sum-exp) or ``"eager"`` (the pattern)."""

    frame: pd.DataFrame
    threshold: float
    sink_source: str
    model_name: str
    n_texts: int
    sinks: SinkSet | None = None  # the positions treated as sinks
    attention: str = EAGER  # how attention was read: "lse" or "eager"
    null_kind: str = ""  # the attention's null slot ("": none, and no null_mass column)

    @property
    def sink_metric(self) -> float:
        """Share of heads whose mean attention to the first token exceeds ``threshold``."""
        return sink_metric(torch.tensor(self.frame["first_token_mass"].to_numpy()), self.threshold)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        per_layer = self.frame.groupby("layer")["sink_mass"].mean()
        top = per_layer.sort_values(ascending=False).head(3)
        treated = f" ({self.sinks.describe()})" if self.sinks is not None else ""
        return (f"{self.model_name}, {self.n_texts} text(s), sinks = {self.sink_source}{treated}: sink metric "
                f"{self.sink_metric:.0%} of heads put > {self.threshold:g} of their attention on the "
                f"first token; mean sink mass over all heads {self.frame['sink_mass'].mean():.2f}; "
                "highest layers " + ", ".join(f"{int(k)} ({v:.2f})" for k, v in top.items())
                + self._null_text() + f"; {path_text(self.attention)}")

    def _null_text(self) -> str:
        if not self.null_kind:
            return ""
        null = self.frame["null_mass"]
        return f"; null mass ({self.null_kind}) mean over heads {null.mean():.2f}, max {null.max():.2f}"

    def plot(self, ax: Any = None) -> Any:
        """Sink mass per layer: mean over heads, with the min-max range of heads."""
        return sink_mass_axes(self.frame, threshold=self.threshold, ax=ax,
                              title=f"{self.model_name}: attention to sinks")


def sink_attention(model: Any, text: str | Sequence[str] | Tensor, *, sinks: Sinks = None,
                   threshold: float = SINK_THRESHOLD, attention: str = "auto") -> SinkAttention:
    """Attention mass on the sink positions per layer and head, and the sink metric.

    Args:
        model: a TransformerLens-style model, or an nnsight model (the LSE path only).
        text: a string, a list of strings (padded into one batch) or a token tensor; for a
            vision model, ``pixel_values`` ``[batch, channels, height, width]``.
        sinks: sink positions (a list of ints, the same for every sequence, or a bool
            ``[batch, pos]`` mask); None: the positions that act as sinks (:func:`find_sinks`:
            they draw attention from many heads or carry a persistent massive activation),
            else the first token.
        threshold: the sink metric's attention share, in (0, 1) (default 0.3, Gu et al.).
        attention: ``"auto"`` (the default: the eager pattern below 512 tokens, where it is the
            faster; from there the attention on the sink columns from q, k and the fused SDPA
            kernel's log-sum-exp where the model supports it, no pattern built; see
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"`` or ``"eager"``.

    Returns:
        A :class:`SinkAttention` (one row per layer and head) with its ``sink_metric`` and
        the positions it treated as sinks (``.sinks``).

    Raises:
        MassiveLensError: if ``threshold`` is not in (0, 1), ``sinks`` is an empty list, a
            position outside the text or a mask of the wrong dtype or shape, ``text`` is
            empty or too long, ``model`` is not a TransformerLens model, or ``attention="lse"``
            on a model whose kernel cannot give the log-sum-exp.

    >>> from massive_lens import tiny_model
    >>> result = sink_attention(tiny_model("gpt2"), "Hello world.", sinks=[0])
    >>> list(result.to_frame().columns), 0 <= result.sink_metric <= 1
    (['layer', 'head', 'sink_mass', 'first_token_mass'], True)
    """
    threshold = as_number(threshold, "threshold", above=0)
    if not 0 < threshold < 1:
        raise MassiveLensError(f"threshold is an attention share in (0, 1), got {threshold}")
    view = ModelView(model)
    batch = view.tokenize(text)
    path = choose_path(view, attention, batch)
    given = None if sinks is None else sink_mask(model, batch, sinks, path)
    # the key columns read per layer: the given sinks' and the first token's or, when the sinks are found in
    # this same pass, every position that could turn out to be one (a sink elsewhere costs a second pass)
    at = candidate_columns(view, batch) if given is None else given.mask.any(0).nonzero()[:, 0]
    columns = torch.tensor(sorted({0, *at.tolist()}), dtype=torch.long)  # column 0: the first token
    tally, nulls = _ColumnMass(batch.mask, columns), NullReader(view)
    evidence = SinkEvidence(batch.mask, view.n_layers) if given is None else None
    attention_pass(view, batch, partial(_take, tally=tally, nulls=nulls), path=path, columns=columns,
                   evidence=evidence, **nulls.reads)
    found = given if evidence is None else sinks_from(evidence, view.token_kinds(batch), path)
    if given is None and not bool(found.mask[:, columns].sum() == found.mask.sum()):
        return sink_attention(model, text, sinks=found, threshold=threshold, attention=path)  # a sink elsewhere
    frame = tally.frame(found.mask)
    if nulls.kind:  # the attention's own off-switch: its mass beside the sinks'
        sums, n = nulls.head_sums(batch.mask)
        null = {layer: (s / n.clamp(min=1)).tolist() for layer, s in sums.items()}
        frame["null_mass"] = [null[lay][h] if lay in null else float("nan")
                              for lay, h in zip(frame["layer"], frame["head"], strict=True)]
    return SinkAttention(frame=frame, threshold=threshold, sink_source=found.source, model_name=view.name,
                         n_texts=len(batch.tokens), sinks=found, attention=path, null_kind=nulls.kind)


def _take(at: PassLayer, *, tally: _ColumnMass, nulls: NullReader) -> None:
    tally.add(at)
    nulls.take(at)


class _ColumnMass:
    """Per layer, what the sink mass needs from the attention on a few key ``columns`` (the first
    is the first token), kept until the sinks are known: each column's attention summed over the
    real queries, the attention among the columns (to take out the queries that are sinks) and
    the first-token mass. Small: ``[batch head col]`` and ``[batch head col col]`` a layer."""

    def __init__(self, valid: Tensor, columns: Tensor):
        self.valid, self.columns = valid, columns
        self.layers: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def add(self, at: PassLayer) -> None:
        """One layer's attention every query gives to the columns (``at.cols [batch head query col]``)."""
        layer, p = at.layer, at.cols.float()
        valid = self.valid.to(p.device, p.dtype)
        summed = torch.einsum("bhqc,bq->bhc", p, valid)
        among = p[:, :, self.columns.to(p.device)] * valid[:, None, self.columns.to(p.device), None]
        self.layers[layer] = (summed.cpu(), among.cpu(), first_token_mass(p, self.valid).cpu())

    def frame(self, sinks: Tensor) -> pd.DataFrame:
        """One row per layer and head for the sinks ``[batch pos]`` (all within the columns):
        the mean attention of the real non-sink queries to the sinks."""
        keys = sinks[:, self.columns].float()  # [batch col]
        n_queries = (self.valid & ~sinks).sum().clamp(min=1)
        rows = []
        for layer in sorted(self.layers):
            summed, among, first = self.layers[layer]
            from_sinks = torch.einsum("bhqc,bq->bhc", among, keys)  # the sink queries' share, taken out
            mass = torch.einsum("bhc,bc->h", summed - from_sinks, keys) / n_queries
            rows.append(torch.stack([torch.full_like(mass, layer), torch.arange(len(mass)).float(), mass, first], 1))
        frame = pd.DataFrame(torch.cat(rows).numpy(), columns=["layer", "head", "sink_mass", "first_token_mass"])
        frame[["layer", "head"]] = frame[["layer", "head"]].astype(int)
        return frame
