"""Calibration for the interventions: what a model's massive activations and sinks look like
on calibration text (the massive dims and the layer where each first appears, their mean
values, and per head the mean sink term and the mean key and value at the sinks), plus the
per-forward state the intervention hooks share (the sink mask found online).

>>> from massive_lens import tiny_model
>>> calib = calibrate(tiny_model("qwen2"), "Calibration text. " * 20, seq_len=16, n_seqs=2,
...                   progress=False)
>>> calib.detect_layer is None, tuple(calib.sink_v.shape)
(True, (4, 2, 16))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.attention import sink_term
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, massive_mask
from massive_lens.core.fmt import num, short
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import sink_mass_axes
from massive_lens.core.results import Result
from massive_lens.detect import find_massive


@dataclass(frozen=True)
class Calibration(Result):
    """What the interventions need to know about a model, measured on calibration text.

    ``dims[layer]``: massive dims whose first massive layer is ``layer``; ``means[layer]``:
    their mean value at massive entries; ``sink_z [layer head d_head]``: each head's mean
    sink term over non-sink query positions; ``sink_k``/``sink_v [layer kv_head d_head]``:
    mean key (post-RoPE) and value at sink positions; ``sink_mass [layer head]``.
    ``to_frame()``: one row per fact, ``kind`` (``massive_mean``: ``layer``, ``dim``,
    ``value``; ``sink_mass``: ``layer``, ``head``, ``value``).
    """

    source: str
    dims: dict[int, Tensor]
    means: dict[int, Tensor]
    attn_layers: tuple[int, ...]
    sink_z: Float[Tensor, "layer head_index d_head"]
    sink_k: Float[Tensor, "layer kv_head d_head"]
    sink_v: Float[Tensor, "layer kv_head d_head"]
    sink_mass: Float[Tensor, "layer head_index"]
    criterion: Criterion
    n_seqs: int

    @property
    def detect_layer(self) -> int | None:
        """The first layer where a massive activation appears (None: none in the text)."""
        return min(self.dims) if self.dims else None

    def to_frame(self) -> pd.DataFrame:
        rows = [("massive_mean", layer, dim, -1, float(mean))
                for layer, dims in sorted(self.dims.items())
                for dim, mean in zip(dims.tolist(), self.means[layer].tolist(), strict=True)]
        rows += [("sink_mass", layer, -1, head, float(self.sink_mass[layer, head]))
                 for layer in self.attn_layers for head in range(self.sink_mass.shape[1])]
        return pd.DataFrame(rows, columns=["kind", "layer", "dim", "head", "value"])

    def summary(self) -> str:
        if not self.dims:
            found = "no massive activations; the sinks fall back to the first token"
        else:
            found = "massive dims " + "; ".join(
                f"{', '.join(map(str, dims.tolist()))} from layer {layer} (mean "
                f"{', '.join(num(m) for m in self.means[layer].tolist())})"
                for layer, dims in sorted(self.dims.items()))
        mass = float(self.sink_mass[list(self.attn_layers)].mean()) if self.attn_layers else float("nan")
        return (f"calibration on {self.source} ({self.n_seqs} sequences, {self.criterion}): {found}; mean "
                f"attention to the sinks after them {mass:.2f}")

    def plot(self, ax: Any = None) -> Any:
        """Mean attention of non-sink queries to the sinks, per layer (range over heads)."""
        frame = self.to_frame()
        frame = frame[frame.kind == "sink_mass"].rename(columns={"value": "sink_mass"})
        return sink_mass_axes(frame.assign(first_token_mass=float("nan")), ax=ax,
                              title=f"calibration: attention to sinks ({self.source})")


class HookState:
    """Per-forward scratch shared by the hooks of one intervention (the current sink mask
    and the current layer's pattern, values, queries)."""

    def __init__(self) -> None:
        self.sinks: Tensor | None = None
        self.stash: dict[str, Tensor] = {}

    def mask(self, batch: int, pos: int, device: torch.device) -> Bool[Tensor, "batch pos"]:
        if self.sinks is None or tuple(self.sinks.shape) != (batch, pos):
            fallback = torch.zeros(batch, pos, dtype=torch.bool, device=device)
            fallback[:, 0] = True  # no massive activations: the first token (Gu et al.)
            return fallback
        return self.sinks.to(device)


def massive_entries(resid: Float[Tensor, "batch pos d_model"], dims: Tensor, criterion: Criterion) -> Tensor:
    """Bool [batch pos n_dims]: which calibrated dims are massive at which positions."""
    return massive_mask(resid, criterion)[..., dims.to(resid.device)]


def rotated_hook(view: ModelView, layer: int, kind: str) -> str:
    rot = f"attn.hook_rot_{kind}"
    return view.hook_name(layer, rot if f"blocks.{layer}.{rot}" in view.model.hook_dict else f"attn.hook_{kind}")


def calibrate(
    model: Any,
    corpus: Corpus | Calibration = None,
    *,
    seq_len: int = 128,
    n_seqs: int = 16,
    batch_size: int = 8,
    criterion: Criterion | None = None,
    progress: bool = True,
) -> Calibration:
    """Measure massive dims, their means and the sink keys/values/terms on ``corpus``.

    The massive dims (and the layer where each first appears) are found with
    :func:`~massive_lens.find_massive` on the first ``batch_size`` sequences; the means
    over all sequences. The sinks of each sequence are the positions where those dims are
    massive at that layer, else the first token.

    Args:
        model: a TransformerLens-style model.
        corpus: calibration text (a file, a string, strings, ``hf:`` name, a token tensor;
            None: the offline default text), or a :class:`Calibration`, returned unchanged
            (the other arguments are then ignored). Use other text than the evaluation text.
        seq_len: tokens per sequence (BOS included; default 128), for text input.
        n_seqs: calibration sequences (default 16), for text input.
        batch_size: sequences per forward pass (default 8).
        criterion: when a value is massive (None: ``Criterion()``).
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
        return corpus
    view, criterion = ModelView(model), criterion or Criterion()
    tokens = sequences(view, corpus, seq_len, n_seqs)
    found = find_massive(model, tokens[:batch_size], criterion=criterion).to_frame()
    first = found.groupby("dim")["layer"].min()
    dims = {int(layer): torch.tensor(sorted(first[first == layer].index.tolist())) for layer in first.unique()}
    detect = min(dims) if dims else -1
    attn_layers = tuple(range(detect + 1, view.n_layers))
    cfg = model.blocks[0].attn
    n_heads, n_kv, d_head = cfg.W_Q.shape[0], cfg.W_K.shape[0], cfg.W_Q.shape[-1]
    sums = {k: torch.zeros(view.n_layers, h, d_head, dtype=torch.float64) for k, h in
            (("z", n_heads), ("k", n_kv), ("v", n_kv))}
    sums["mass"] = torch.zeros(view.n_layers, n_heads, dtype=torch.float64)
    counts = torch.zeros(3, dtype=torch.float64)  # non-sink queries, sink keys, sequences
    value_sums = {layer: torch.zeros(len(d), dtype=torch.float64) for layer, d in dims.items()}
    value_counts = {layer: torch.zeros(len(d), dtype=torch.float64) for layer, d in dims.items()}
    state = HookState()

    def on_resid(resid: Tensor, hook: Any, layer: int) -> None:
        hits = massive_entries(resid, dims[layer], criterion)
        values = resid[..., dims[layer].to(resid.device)]
        value_sums[layer] += (values * hits).sum((0, 1)).double().cpu()
        value_counts[layer] += hits.sum((0, 1)).double().cpu()
        if layer == detect:
            state.sinks = hits.any(-1)

    def on_z(z: Tensor, hook: Any, layer: int) -> None:
        sinks = state.mask(z.shape[0], z.shape[1], z.device)
        pattern, v, k = state.stash["pattern"], state.stash["v"], state.stash["k"]
        sink_z = sink_term(pattern, v, sinks)
        queries = (~sinks).double()
        sums["z"][layer] += torch.einsum("bqhd,bq->hd", sink_z.double(), queries).cpu()
        sums["mass"][layer] += torch.einsum("bhqk,bk,bq->h", pattern.double(), sinks.double(), queries).cpu()
        sums["k"][layer] += torch.einsum("bkhd,bk->hd", k.double(), sinks.double()).cpu()
        sums["v"][layer] += torch.einsum("bkhd,bk->hd", v.double(), sinks.double()).cpu()
        if layer == attn_layers[0]:
            counts.add_(torch.tensor([float(queries.sum()), float(sinks.sum()), z.shape[0]], dtype=torch.float64))

    hooks = [(view.hook_name(layer, "resid_post"), partial(on_resid, layer=layer)) for layer in dims]
    for layer in attn_layers:
        hooks += [(view.hook_name(layer, "attn.hook_pattern"), partial(stash, state=state, key="pattern")),
                  (view.hook_name(layer, "attn.hook_v"), partial(stash, state=state, key="v")),
                  (rotated_hook(view, layer, "k"), partial(stash, state=state, key="k")),
                  (view.hook_name(layer, "attn.hook_z"), partial(on_z, layer=layer))]
    for start in tqdm(range(0, len(tokens), batch_size), desc="calibrate", disable=not progress, leave=False):
        view.forward(view.full_batch(tokens[start:start + batch_size]), hooks, stop_after=hooks[-1][0])
    means = {layer: (value_sums[layer] / value_counts[layer].clamp(min=1)).float() for layer in dims}
    q, s = counts[0].clamp(min=1), counts[1].clamp(min=1)
    return Calibration(
        source=describe_source(corpus), dims=dims, means=means, attn_layers=attn_layers,
        sink_z=(sums["z"] / q).float(), sink_k=(sums["k"] / s).float(), sink_v=(sums["v"] / s).float(),
        sink_mass=(sums["mass"] / q).float(), criterion=criterion, n_seqs=len(tokens),
    )


def describe_source(corpus: Any) -> str:
    """A short label for a corpus: the file name, ``default text``, or ``a token tensor``."""
    if corpus is None:
        return "default text"
    if isinstance(corpus, Tensor):
        return "a token tensor"
    return short(corpus) if isinstance(corpus, (str, os.PathLike)) else f"{type(corpus).__name__} corpus"


def stash(act: Tensor, hook: Any, *, state: HookState, key: str) -> None:
    state.stash[key] = act
