"""Attention mass on the sinks per layer and head, and Gu et al.'s sink metric."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.sinks import Sinks, SinkSet, sink_mask
from massive_lens.core.criterion import SINK_THRESHOLD, first_token_mass, sink_metric
from massive_lens.core.lse import EAGER, LSE, LayerAttention, choose_path, lse_run, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import sink_mass_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

QUERY_BLOCK = 256  # query rows of a pattern reduced at once


@dataclass(frozen=True, kw_only=True)
class SinkAttention(Result):
    """Per layer and head: ``sink_mass`` (mean attention of non-sink queries to the sinks)
    and ``first_token_mass`` (mean attention of the first 64 queries to the first token, Gu et al.).
    ``to_frame()`` columns: ``layer``, ``head``, ``sink_mass``, ``first_token_mass``. ``attention``:
    ``"lse"`` (from q, k and the SDPA kernel's log-sum-exp) or ``"eager"`` (the pattern)."""

    frame: pd.DataFrame
    threshold: float
    sink_source: str
    model_name: str
    n_texts: int
    sinks: SinkSet | None = None  # the positions treated as sinks
    attention: str = EAGER  # how attention was read: "lse" or "eager"

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
                + f"; {path_text(self.attention)}")

    def plot(self, ax: Any = None) -> Any:
        """Sink mass per layer: mean over heads, with the min-max range of heads."""
        return sink_mass_axes(self.frame, threshold=self.threshold, ax=ax,
                              title=f"{self.model_name}: attention to sinks")


def sink_attention(model: Any, text: str | Sequence[str] | Tensor, *, sinks: Sinks = None,
                   threshold: float = SINK_THRESHOLD, attention: str = "auto") -> SinkAttention:
    """Attention mass on the sink positions per layer and head, and the sink metric.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor; for a
            vision model, ``pixel_values`` ``[batch, channels, height, width]``.
        sinks: sink positions (a list of ints, the same for every sequence, or a bool
            ``[batch, pos]`` mask); None: the positions that act as sinks (:func:`find_sinks`:
            they draw attention from many heads or carry a persistent massive activation),
            else the first token.
        threshold: the sink metric's attention share, in (0, 1) (default 0.3, Gu et al.).
        attention: ``"auto"`` (the default: the attention on the sink columns from q, k and the
            fused SDPA kernel's log-sum-exp where the model supports it, with no pattern built;
            else the eager pattern), ``"lse"`` or ``"eager"`` (:mod:`massive_lens.core.lse`).

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
    if not 0 < threshold < 1:
        raise MassiveLensError(f"threshold is an attention share in (0, 1), got {threshold}")
    view = ModelView(model)
    batch = view.tokenize(text)
    path = choose_path(view, attention)
    found = sink_mask(model, batch, sinks, path)
    mask, source = found.mask, found.source
    valid = batch.mask.float()
    queries = valid * (~mask).float()
    rows: list[Tensor] = []

    def reduce(pattern: Tensor, hook: Any, layer: int) -> None:
        on_keys = mask[:, None, :, None].to(pattern.device, torch.float32)
        # [batch head query]: a query block at a time in float32, never a pattern-sized product
        on_sinks = torch.cat([block.float() @ on_keys for block in pattern.split(QUERY_BLOCK, dim=2)], 2)[..., 0]
        add(layer, on_sinks, first_token_mass(pattern, batch.mask))

    def add(layer: int, on_sinks: Tensor, first: Tensor) -> None:
        sink = torch.einsum("bhq,bq->h", on_sinks, queries.to(on_sinks.device)).cpu() / queries.sum().clamp(min=1)
        first = first.cpu()
        rows.append(torch.stack([torch.full_like(sink, layer), torch.arange(len(sink)).float(), sink, first], 1))

    cols = sorted({0, *mask.any(0).nonzero()[:, 0].tolist()})  # the sink columns, and the first token's

    def from_lse(att: LayerAttention) -> None:
        p = att.columns(cols)  # [batch head query col]
        on_sinks = p @ mask[:, cols].to(p.device, p.dtype)[:, None, :, None]
        add(att.layer, on_sinks[..., 0], first_token_mass(p, batch.mask))  # column 0 is the first token

    names = [view.hook_name(layer, "attn.hook_pattern") for layer in range(view.n_layers)]
    if path == LSE:
        outs = [view.hook_name(layer, "attn.hook_out") for layer in range(view.n_layers)]
        with lse_run(view, from_lse):  # the outputs' hooks only check them for NaN and inf
            view.forward(batch, [(n, _watch) for n in outs], stop_after=outs[-1])
    else:
        view.forward(batch, [(n, partial(reduce, layer=i)) for i, n in enumerate(names)], stop_after=names[-1])
    frame = pd.DataFrame(torch.cat(rows).numpy(), columns=["layer", "head", "sink_mass", "first_token_mass"])
    frame = frame.sort_values(["layer", "head"], ignore_index=True)
    frame[["layer", "head"]] = frame[["layer", "head"]].astype(int)
    return SinkAttention(frame=frame, threshold=threshold, sink_source=source, model_name=view.name,
                         n_texts=len(batch.tokens), sinks=found, attention=path)


def _watch(x: Tensor, hook: Any) -> None:
    """A hook that reads nothing: the forward checks what it sees for NaN and inf."""
