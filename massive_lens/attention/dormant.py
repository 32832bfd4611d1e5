"""Dormant heads: heads that, on a given input, park their attention on the sinks and write
almost nothing.

Guo et al. (2024, "Active-Dormant Attention Heads") show heads that switch between an active
state and a dormant one, where nearly all attention goes to the sink whose value is small, so
the head's output is close to zero; Sandoval-Segura et al. (2025, arXiv 2504.03889) find that
zeroing such heads keeps accuracy, and that a score on the head's *output norm* finds more of
them than one on first-token attention alone. :func:`dormant_heads` uses both, per input
sequence, in one forward pass (plus the one ``find_sinks`` needs when the sinks are not given):

- ``sink_mass``: the mean attention the real non-sink queries after a sink put on the sinks;
- ``out_norm``: the mean norm of the head's output in the residual stream (``z_h W_O[h]``) over
  the real query positions; ``norm_ratio``: that over the mean of the layer's heads;
- a head is **dormant** on a sequence when ``sink_mass > sink_share`` (most of its attention
  on the sinks; default 0.5) **and** ``norm_ratio < norm_ratio`` (a small output; default 0.2,
  a fifth of its layer's mean head). Both defaults are massive_lens's choices, to be varied:
  the papers sweep their thresholds rather than fix one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.output_weights import head_gram, output_weights
from massive_lens.attention.sinks import Sinks, SinkSet, candidate_columns, sink_mask, sinks_from
from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.criterion import SinkEvidence
from massive_lens.core.lse import EAGER, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

SINK_SHARE = 0.5  # most of the head's attention on the sinks
NORM_RATIO = 0.2  # output norm below a fifth of its layer's mean head


@dataclass(frozen=True, kw_only=True)
class DormantHeads(Result):
    """Per sequence, layer and head: ``sink_mass``, ``out_norm``, ``norm_ratio`` and ``dormant``
    (see the module docstring). ``to_frame()`` columns: ``seq``, ``layer``, ``head``,
    ``sink_mass``, ``out_norm``, ``norm_ratio``, ``dormant``. ``attention``: ``"lse"`` (the
    attention on the sinks from q, k and the SDPA kernel's log-sum-exp) or ``"eager"`` (the pattern)."""

    frame: pd.DataFrame
    model_name: str
    sink_source: str
    sink_share: float
    norm_ratio: float
    sinks: SinkSet | None = None
    attention: str = EAGER

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def share(self) -> pd.DataFrame:
        """Per layer and head, the share of sequences where it is dormant (column ``dormant``)."""
        return self.frame.groupby(["layer", "head"], as_index=False)["dormant"].mean()

    def heads(self, min_share: float = 1.0) -> list[tuple[int, int]]:
        """The heads dormant on enough of the sequences.

        Args:
            min_share: the share of sequences a head must be dormant on (default all).

        Returns:
            ``(layer, head)`` pairs, in layer and head order.
        """
        s = self.share()
        return [(int(r.layer), int(r.head)) for r in s.itertuples() if r.dormant >= min_share - 1e-12]

    def summary(self) -> str:
        s = self.share()
        n = len(s)
        always, ever = len(self.heads(1.0)), int((s["dormant"] > 0).sum())
        per_layer = s.groupby("layer")["dormant"].apply(lambda d: int((d > 0).sum()))
        busiest = per_layer[per_layer > 0].sort_values(ascending=False).head(3)
        where = ", ".join(f"layer {int(k)} ({v})" for k, v in busiest.items()) or "none"
        n_seqs = self.frame["seq"].nunique()
        return (f"{self.model_name}, {n_seqs} sequence(s), sinks = {self.sink_source}: dormant = sink mass > "
                f"{self.sink_share:g} and output norm < {self.norm_ratio:g}x its layer's mean head; {always} of {n} "
                f"heads ({always / max(n, 1):.1%}) dormant on every sequence, {ever} ({ever / max(n, 1):.1%}) on at "
                f"least one; most in {where} ({path_text(self.attention)})")

    def plot(self, ax: Any = None) -> Any:
        """Every head as a point: sink mass against output norm ratio, dormant ones marked."""
        ax = ensure_axes(ax, (6, 4), layout=None)
        f = self.frame
        for flag, label, marker in ((False, "active", "."), (True, "dormant", "x")):
            part = f[f["dormant"] == flag]
            ax.scatter(part["sink_mass"], part["norm_ratio"], s=10, marker=marker, label=label)
        ax.axvline(self.sink_share, color="gray", lw=0.8, ls="--")
        ax.axhline(self.norm_ratio, color="gray", lw=0.8, ls="--")
        ax.set(xlabel="attention on the sinks", ylabel="output norm / layer's mean head", yscale="log",
               title=f"{self.model_name}: dormant heads")
        ax.legend()
        return ax


def dormant_heads(model: Any, text: str | Sequence[str] | Tensor, *, sinks: Sinks = None,
                  sink_share: float = SINK_SHARE, norm_ratio: float = NORM_RATIO, attention: str = "auto"
                  ) -> DormantHeads:
    """Classify every head, on every input sequence, as dormant or active (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch; each is one input) or a token tensor.
        sinks: sink positions (a list of ints, a bool ``[batch, pos]`` mask, or a ``SinkSet`` that
            ``find_sinks`` gave for the same text); None: the
            positions that act as sinks (``find_sinks``), else the first token.
        sink_share: attention on the sinks above which a head may be dormant, in (0, 1).
        norm_ratio: output norm, as a share of its layer's mean head, below which it may be dormant (> 0).
        attention: ``"auto"`` (the default: the eager pattern below 512 tokens, where it is the
            faster; from there the attention on the sinks from q, k and the fused SDPA kernel's
            log-sum-exp where the model supports it, no pattern built; see
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"`` or ``"eager"``.

    Returns:
        A :class:`DormantHeads`.

    Raises:
        MassiveLensError: for a threshold out of range, invalid ``sinks``, or a layer whose heads'
            outputs cannot be read (no ``hook_z`` or no per-head ``W_O``), or ``attention="lse"`` on a
            model whose kernel cannot give the log-sum-exp.

    >>> from massive_lens import tiny_model
    >>> result = dormant_heads(tiny_model("llama"), "Hello there, world.", sinks=[0])
    >>> list(result.to_frame().columns)
    ['seq', 'layer', 'head', 'sink_mass', 'out_norm', 'norm_ratio', 'dormant']
    """
    if not 0 < sink_share < 1 or not norm_ratio > 0:
        raise MassiveLensError(f"sink_share must be in (0, 1) and norm_ratio > 0, got {sink_share}, {norm_ratio}")
    view = ModelView(model)
    batch = view.tokenize(text)
    path = choose_path(view, attention, batch)
    given = None if sinks is None else sink_mask(model, batch, sinks, path)
    # the key columns read per layer: the given sinks' or, when the sinks are found in this same pass, every
    # position that could turn out to be one (a sink elsewhere costs a second pass)
    columns = candidate_columns(view, batch) if given is None else (given.mask & batch.mask).any(0).nonzero()[:, 0]
    reader = _Rows(view, columns, {layer: output_weights(view, layer)[0] for layer in range(view.n_layers)},
                   batch.mask)
    evidence = SinkEvidence(batch.mask, view.n_layers) if given is None else None
    # a layer's head outputs are what its output projection reads (``attn.hook_z``, after any gate or
    # sub-norm the attention applies; the kernel's output where that hook does not fire on the LSE path)
    attention_pass(view, batch, reader.add, path=path, columns=columns, want=("z_read",), evidence=evidence,
                   stop_after=view.hook_name(view.n_layers - 1, "resid_post"))
    found = given if evidence is None else sinks_from(evidence, view.token_kinds(batch), path)
    sink = found.mask & batch.mask
    if not bool(sink[:, columns].sum() == sink.sum()):  # a sink outside the columns read: a second pass
        return dormant_heads(model, text, sinks=found, sink_share=sink_share, norm_ratio=norm_ratio, attention=path)
    if len(reader.layers) != view.n_layers:
        raise MassiveLensError(f"{view.name}: the pattern and z hooks did not fire in every layer; dormant_heads "
                               "cannot read the heads' outputs")
    frame = pd.DataFrame(reader.rows(sink).numpy(), columns=["seq", "layer", "head", "sink_mass", "out_norm",
                                                             "norm_ratio"])
    frame[["seq", "layer", "head"]] = frame[["seq", "layer", "head"]].astype(int)
    frame["dormant"] = (frame["sink_mass"] > sink_share) & (frame["norm_ratio"] < norm_ratio)
    frame = frame.sort_values(["seq", "layer", "head"], ignore_index=True)
    return DormantHeads(frame=frame, model_name=view.name, sink_source=found.source, sink_share=float(sink_share),
                        norm_ratio=float(norm_ratio), sinks=found, attention=path)


class _Rows:
    """Per layer, what a row needs, reduced as the layer passes: each head's output norm, and from the
    attention on the key ``columns`` (which hold every sink) the sums that give the sink mass once the
    sinks are known: ``after [batch head col j]``, each column's attention summed over the real queries
    after column ``j``, and ``among [batch head i col]``, the attention column ``i``'s query gives each
    column. Small: ``[batch head col col]`` a layer."""

    def __init__(self, view: ModelView, columns: Tensor, weights: dict[int, Tensor], valid: Tensor):
        self.view, self.columns, self.weights, self.valid = view, columns, weights, valid
        self.layers: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def add(self, at: PassLayer) -> None:
        layer, heads = at.layer, self.weights[at.layer].shape[0]
        z = at.z_read.detach().float()
        if z.ndim != 4 or tuple(z.shape[:2]) != tuple(self.valid.shape) or z.shape[2] != heads or at.shape[1] != heads:
            raise MassiveLensError(f"{self.view.name}: layer {layer} has z {tuple(z.shape)}, pattern "
                                   f"{at.shape} and W_O for {heads} heads; dormant_heads needs one [batch, "
                                   "pos, head, d_head] z and one pattern per head of W_O (multi-head latent attention "
                                   "is not read)")
        r = self.valid.to(z.device).float()
        # [h d d]: ||z_h W_O[h]|| from W_O[h]'s Gram matrix (kept between calls on the same weights), z_h W_O[h]
        # never built
        gram = head_gram(self.weights[layer], z, self.view.block(layer).attn)
        out = ((z.transpose(1, 2) @ gram) * z.transpose(1, 2)).sum(-1)
        out = out.clamp(min=0).sqrt().transpose(1, 2)  # [b q h]
        out = torch.einsum("bqh,bq->bh", out, r) / r.sum(1, keepdim=True).clamp(min=1)
        ratio = out / out.mean(1, keepdim=True).clamp(min=1e-12)
        p = at.cols.detach().float() * r[:, None, :, None]  # [b h q col], the real queries only
        cols = self.columns.to(p.device)
        later = p.flip(2).cumsum(2).flip(2)  # [b h q col]: summed over the queries at or after q
        later = torch.cat([later, torch.zeros_like(later[:, :, :1])], 2)  # (none after the last)
        after = later[:, :, cols + 1].transpose(2, 3)  # [b h col j]: over the queries after column j
        self.layers[layer] = (after.cpu(), p[:, :, cols].cpu(), out.cpu(), ratio.cpu())

    def rows(self, sink: Tensor) -> Tensor:
        """One row per layer, sequence and head (in that order): the mean attention the real non-sink queries
        after the first sink give the sinks (``sink [batch pos]``, all within the columns), every layer at once."""
        layers = sorted(self.layers)
        after, among, out, ratio = (torch.stack(x) for x in zip(*(self.layers[layer] for layer in layers),
                                                                  strict=True))  # [layer b h ...]
        n_layers, n_seq, heads = out.shape
        if len(self.columns):
            keys = sink[:, self.columns].float()  # [b col]
            first = keys.argmax(1)  # the first sink (the first column where there is none)
            later = torch.arange(len(self.columns))[None, :] > first[:, None]  # [b col]: the columns after it
            pos = torch.arange(sink.shape[1])[None, :]
            n_queries = (self.valid & ~sink & (pos > self.columns[first][:, None])).sum(1).float()  # [b]
            from_first = after.permute(0, 1, 4, 2, 3)[:, torch.arange(n_seq), first]  # [layer b h col]: after it
            from_sinks = torch.einsum("lbhic,bi->lbhc", among, keys * later)  # the later sinks' own queries
            mass = torch.einsum("lbhc,bc->lbh", from_first - from_sinks, keys) / n_queries.clamp(min=1)[:, None]
        else:  # no sink at all (a given empty mask): no attention on one
            mass = torch.zeros(out.shape)
        layer, seq, head = torch.meshgrid(torch.tensor(layers, dtype=torch.float32), torch.arange(n_seq).float(),
                                          torch.arange(heads).float(), indexing="ij")
        return torch.stack([seq.flatten(), layer.flatten(), head.flatten(), mass.flatten(), out.flatten(),
                            ratio.flatten()], 1)
