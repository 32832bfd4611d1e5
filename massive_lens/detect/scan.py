"""Scanning a corpus for massive activations.

One text can mislead; a corpus tells how often a (dimension, token kind) is massive: "dim d
at bos: 100% of sequences; at the first delimiter: 97%". :func:`scan_corpus` streams
sequences through the model, reduces every layer's residual stream inside its hook (top-k
magnitudes, the median, which (kind, dim) pairs are massive), and keeps only running sums,
so memory does not grow with the corpus. Under ``torchrun`` each rank scans every
``world_size``-th batch and the sums are all-reduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.core.corpora import Corpus, token_batches
from massive_lens.core.criterion import Criterion, as_criterion
from massive_lens.core.model_view import ModelView
from massive_lens.core.reduce import ProfileSums
from massive_lens.core.results import Result
from massive_lens.core.tokens import TOKEN_KINDS
from massive_lens.detect.find import LayerProfile, run_reducer
from massive_lens.detect.scope import outlier_lines
from massive_lens.errors import MassiveLensError


@dataclass(frozen=True, kw_only=True)
class CorpusScan(Result):
    """Statistics of a corpus scan. ``profile`` is the per-layer table of a
    :class:`~massive_lens.detect.LayerProfile` (``layer``, ``top1_mean``, ...); ``frequency``
    has one row per massive (``dim``, ``token_kind``): ``sequences`` (how many sequences
    have a token of that kind), ``massive`` (in how many the dim is massive there at some
    layer), ``frequency``, ``first_layer``, ``last_layer``. The kind ``first_delimiter`` is
    the first delimiter of each sequence."""

    profile: pd.DataFrame
    frequency: pd.DataFrame
    n_sequences: int
    n_tokens: int
    model_name: str
    criterion: Criterion = field(default_factory=Criterion)

    @property
    def layer_profile(self) -> LayerProfile:
        """The per-layer statistics as a :class:`~massive_lens.detect.LayerProfile`."""
        return LayerProfile(frame=self.profile, model_name=self.model_name, n_sequences=self.n_sequences)

    def to_frame(self) -> pd.DataFrame:
        return self.frequency.copy()

    def summary(self) -> str:
        lines = [f"{self.model_name}: {self.n_sequences} sequences, {self.n_tokens:,} tokens. "
                 + self.layer_profile.summary().split(": ", 1)[1]]
        if self.frequency.empty:
            lines.append("  no massive activations under the criterion")
        scope = self.frequency.get("scope", pd.Series("token", index=self.frequency.index))
        for r in self.frequency[scope == "token"].head(12).itertuples():
            lines.append(f"  dim {r.dim} at {r.token_kind}: {r.frequency:.0%} of {r.sequences} sequences "
                         f"(layers {r.first_layer}-{r.last_layer})")
        outliers = self.frequency[scope == "outlier_dim"]
        return "\n".join(lines + outlier_lines(outliers))

    def plot(self, ax: Any = None) -> Any:
        """The layer profile over the corpus (see :meth:`LayerProfile.plot`)."""
        return self.layer_profile.plot(ax=ax)


def scan_corpus(
    model: Any,
    corpus: Corpus = None,
    *,
    seq_len: int = 256,
    batch_size: int = 4,
    max_tokens: int | None = 16_384,
    criterion: Criterion | None = None,
    k: int = 3,
    prepend_bos: bool | None = None,
    progress: bool = True,
) -> CorpusScan:
    """Stream a corpus (default: the offline default text) and measure massive activations.

    Memory stays flat: each layer's activation is reduced inside its hook. Under
    ``torchrun`` (an initialised ``torch.distributed`` group) each rank takes every
    ``world_size``-th batch and the statistics are all-reduced, so every rank returns the
    same result.

    Args:
        model: a TransformerLens-style model.
        corpus: a text file (``Path`` or existing path), a string, strings, ``"hf:NAME[:CONFIG[:SPLIT]]"``,
            a ``[n_seqs, seq_len]`` token tensor, or None for the offline default text.
        seq_len: tokens per sequence (BOS included; default 256); text is cut into
            back-to-back sequences of this length and a shorter remainder is dropped.
        batch_size: sequences per forward pass (default 4).
        max_tokens: stop after ``max_tokens // seq_len`` whole sequences (default 16,384
            tokens; None: the whole corpus).
        criterion: when a value is massive (None: ``Criterion()``).
        k: how many of the largest magnitudes the profile keeps per layer (default 3).
        prepend_bos: whether each sequence starts with BOS (None: the model's default).
        progress: show a progress bar (on rank 0 only).

    Returns:
        A :class:`CorpusScan`: the layer profile and how often each (dim, token kind) is massive.

    Raises:
        MassiveLensError: if ``seq_len`` is below 2 or longer than the model's context,
            ``batch_size`` or ``max_tokens`` is below 1, ``k`` outside 1..d_model, ``max_tokens`` is below one
            sequence, the corpus is too short for one sequence, a corpus file does not
            exist, a token tensor is not ``[n_seqs, seq_len]``, or an ``hf:`` dataset cannot
            be opened.

    >>> from massive_lens import tiny_model
    >>> scan = scan_corpus(tiny_model("llama"), seq_len=32, max_tokens=128, progress=False)
    >>> scan.n_sequences, scan.n_tokens
    (4, 128)
    """
    view = ModelView(model)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= view.d_model:
        raise MassiveLensError(f"k={k!r}: the largest magnitudes kept per layer is a whole number from 1 to "
                               f"d_model ({view.d_model})")
    criterion = as_criterion(criterion)
    layers = view.chosen_layers(None)
    rank, world = _distributed()
    n_kinds = len(TOKEN_KINDS) + 1
    sums = ProfileSums(layers, k)
    hits = torch.zeros(len(layers), n_kinds, view.d_model, dtype=torch.float64)  # per layer
    any_hits = torch.zeros(n_kinds, view.d_model, dtype=torch.float64)  # any layer
    present = torch.zeros(n_kinds, dtype=torch.float64)
    outlier = torch.zeros(len(layers), view.d_model, dtype=torch.float64)  # sequences where an outlier dim, per layer
    outlier_any = torch.zeros(view.d_model, dtype=torch.float64)  # ... at some layer
    share = torch.zeros(len(layers), view.d_model, dtype=torch.float64)  # summed token share there
    counts = torch.zeros(2, dtype=torch.float64)  # sequences, tokens
    batches = token_batches(view, corpus, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens,
                            prepend_bos=prepend_bos)
    total = None if max_tokens is None else math.ceil(max_tokens // seq_len / batch_size)
    for i, tokens in enumerate(tqdm(batches, total=total, disable=not progress or rank != 0, desc="scan")):
        if i % world != rank:
            continue
        batch = view.full_batch(tokens)
        kinds = view.token_kinds(batch)
        reducer = run_reducer(view, batch, criterion, "resid_post", layers, k=k, kinds=kinds)
        sums.add(reducer)
        per_layer = torch.stack([reducer.token_kind_hits(layer) for layer in layers])  # [L b kinds d], a batch is a run
        hits += per_layer.sum(1)
        any_hits += per_layer.any(0).sum(0)
        present += _kinds_present(kinds).sum(0)
        flags = torch.stack([reducer.outlier[layer] for layer in layers]).double()  # [L b d]
        outlier += flags.sum(1)
        outlier_any += flags.amax(0).sum(0)
        share += (flags * torch.stack([reducer.share[layer] for layer in layers]).double()).sum(1)
        counts += torch.tensor([len(tokens), tokens.numel()], dtype=torch.float64)
    if world > 1:
        sums.sum, sums.sq, hits, any_hits, present, counts, outlier, outlier_any, share = _all_reduce(
            [sums.sum, sums.sq, hits, any_hits, present, counts, outlier, outlier_any, share])
    n_seqs = int(counts[0])
    if n_seqs == 0:
        raise MassiveLensError("the corpus gave no sequences; lower seq_len or give more text")
    sums.n = n_seqs
    frequency = pd.concat([_frequency(hits, any_hits, present, layers),
                           _outliers(outlier, outlier_any, share, layers, n_seqs)], ignore_index=True)
    return CorpusScan(profile=sums.frame(), frequency=frequency, n_sequences=n_seqs, n_tokens=int(counts[1]),
                      model_name=view.name, criterion=criterion)


def _kinds_present(kinds: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch n_kinds"]:
    has = [(kinds == c).any(1) for c in range(len(TOKEN_KINDS))]
    return torch.stack(has + [has[TOKEN_KINDS.index("delimiter")]], 1).double()


def _frequency(hits: Tensor, any_hits: Tensor, present: Tensor, layers: list[int]) -> pd.DataFrame:
    names = [*TOKEN_KINDS, "first_delimiter"]
    rows = []
    for c, d in any_hits.nonzero().tolist():
        active = hits[:, c, d].nonzero().flatten()
        rows.append((d, names[c], int(present[c]), int(any_hits[c, d]), float(any_hits[c, d] / present[c]),
                     layers[int(active[0])], layers[int(active[-1])]))
    frame = pd.DataFrame(rows, columns=_COLUMNS[:7])
    frame = frame.sort_values(["massive", "dim"], ascending=[False, True]).reset_index(drop=True)
    return frame.assign(scope="token", share=float("nan"))


def _outliers(outlier: Tensor, outlier_any: Tensor, share: Tensor, layers: list[int], n_seqs: int) -> pd.DataFrame:
    """One row per outlier dimension of the corpus (``token_kind`` ``"any"``)."""
    rows = []
    for d in outlier_any.nonzero().flatten().tolist():
        mine = outlier[:, d].nonzero().flatten().tolist()
        where = tuple(layers[i] for i in mine)
        rows.append((d, "any", n_seqs, int(outlier_any[d]), float(outlier_any[d] / n_seqs), where[0], where[-1],
                     "outlier_dim", float(share[mine, d].sum() / outlier[mine, d].sum())))
    frame = pd.DataFrame(rows, columns=_COLUMNS)
    return frame.sort_values(["massive", "share"], ascending=False).reset_index(drop=True)


_COLUMNS = ["dim", "token_kind", "sequences", "massive", "frequency", "first_layer", "last_layer", "scope", "share"]


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(tensors: list[Tensor]) -> list[Tensor]:
    flat = torch.cat([t.flatten() for t in tensors])
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    dist.all_reduce(flat)
    flat, out, start = flat.cpu(), [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view_as(t))
        start += t.numel()
    return out
