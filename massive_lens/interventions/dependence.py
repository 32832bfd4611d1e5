"""Dependence beside mass: does a sink head need its sink, and what does the sink give it?

A head that puts 97% of its attention on the first token may need it or not: Llama-2-7B and
its RoPE-free DroPE variant both attend ~97-99% to BOS, yet ablating the BOS path costs x1249
perplexity in one and x1.00 in the other (drope-activations, 2026). Attention mass
(:func:`~massive_lens.attention.sink_census`, :func:`~massive_lens.attention.sink_attention`)
is where a head looks, not what it depends on. :func:`sink_dependence` measures, per sink head:

- **dependence**: the change of the next-token loss when that one head's attention to the
  sinks is removed and its rows renormalised (sink queries keep theirs), per sequence, with a
  paired 95% bootstrap interval over sequences (one extra forward pass per head and batch);
- **no-op or broadcast** (arXiv 2606.08105: a sink can be an adaptive no-op, or a broadcast of
  information it gathered): how much the head's output ``z`` at non-sink queries changes when
  the sinks' values are swapped with another input's (the next sequence's sink of the same
  rank), relative to ``|z|``; computed from the pattern and values of the untouched pass, so it
  costs no pass. Below ``broadcast_at`` the sink's value does not carry the input: ``no-op``;
  above it: ``broadcast``. A first token that sees only itself (a BOS in a causal model) has
  the same value for every input, so its swap is exactly a no-op.

>>> v = torch.arange(4.0).view(2, 2, 1, 1)  # two inputs, their sinks at position 0
>>> swap_values(v, torch.tensor([[True, False], [True, False]]))[:, 0].flatten().tolist()
[2.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.attention.sinks import SinkSet, candidate_columns, sinks_from, sinks_of
from massive_lens.core.attention_pass import PassLayer, attention_pass, attention_reading, choose_path
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import SinkEvidence, SinkRule, as_rule
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.pass_reader import attention_layers
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.access import require
from massive_lens.interventions.edits import drop_sinks
from massive_lens.interventions.state import HookState
from massive_lens.metrics import perplexity

COLUMNS = ["layer", "head", "sink_mass", "measured", "loss_change", "loss_low", "loss_high", "ratio", "swap_change",
           "label"]


@dataclass(frozen=True, kw_only=True)
class SinkDependence(Result):
    """Per sink head: its attention to the sinks, the loss change when that attention is removed
    (with a paired 95% interval over sequences) and its no-op / broadcast label.

    ``to_frame()``: one row per head whose mean attention to the sinks reaches ``threshold``
    (and any head asked for): ``layer``, ``head``, ``sink_mass`` (mean attention of non-sink
    queries to the sinks), ``measured`` (its removal was run), ``loss_change`` (mean over
    sequences of the loss with its sink attention removed minus the untouched loss, nats per
    token), ``loss_low``/``loss_high`` (paired 95% bootstrap interval), ``ratio`` (the
    perplexity ratio ``exp(loss_change)``), ``swap_change`` (``|dz| / |z|`` at non-sink queries
    when the sinks' values are swapped with another input's) and ``label`` (``no-op`` below
    ``broadcast_at``, else ``broadcast``).
    """

    frame: pd.DataFrame
    model_name: str
    n_seqs: int
    seq_len: int
    threshold: float
    broadcast_at: float
    sinks: SinkSet | None = None

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame
        head = (f"{self.model_name}: sink dependence on {self.n_seqs} sequences of {self.seq_len} tokens "
                f"(sinks: {self.sinks.describe() if self.sinks is not None else '?'}); {len(f)} sink head(s) "
                f"(attention to the sinks >= {self.threshold:g}), {int(f['measured'].sum())} measured")
        lines = [head]
        for r in f[f["measured"]].itertuples():
            low, high = r.loss_low, r.loss_high
            needs = ("depends on it" if low > 0 else "gains without it" if high < 0 else
                     "no dependence shown (interval includes 0)")
            lines.append(f"  L{r.layer}H{r.head}: sink mass {r.sink_mass:.2f}; removing it costs {r.loss_change:+.4f} "
                         f"nats/token [{low:+.4f}, {high:+.4f}] (x{r.ratio:.3f}): {needs}; a swapped sink value "
                         f"moves its output {r.swap_change:.1%}: {r.label}")
        rest = f[~f["measured"]]
        if len(rest):
            lines.append(f"  {len(rest)} more sink head(s) not measured (max_heads or heads=): their mass alone is "
                         "not a finding")
        if f["measured"].any():
            dep = f[f["measured"] & (f["loss_low"] > 0)]
            lines.append(f"{len(dep)} of {int(f['measured'].sum())} measured sink heads depend on their sink; "
                         f"{int((f['label'] == 'broadcast').sum())} of {len(f)} broadcast (swap change >= "
                         f"{self.broadcast_at:.0%})")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Loss change against sink mass per measured head, with the 95% intervals."""
        ax = ensure_axes(ax, (6, 4), layout=None)
        f = self.frame[self.frame["measured"]]
        ax.errorbar(f["sink_mass"], f["loss_change"], yerr=[f["loss_change"] - f["loss_low"],
                    f["loss_high"] - f["loss_change"]], fmt="o", capsize=3)
        for r in f.itertuples():
            ax.annotate(f"L{r.layer}H{r.head}", (r.sink_mass, r.loss_change), fontsize=7)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(xlabel="attention to the sinks", ylabel="loss change without it (nats/token)",
               title=f"{self.model_name}: sink mass vs dependence")
        return ax


# the sinks are found in the untouched pass itself where every layer's attention on the candidate columns, held
# until the pass has judged them, takes at most this many bytes (128 tokens: ~18 MB on the default model), or half
# the batch's float32 logits, which a plain forward holds and the loss at the head never makes (2,048 tokens: 283 of
# 805 MB on the default model); beyond, in a pass of their own, and the memory stays linear in the length
HOLD_BYTES = 1 << 26


class _Tally:
    """The untouched pass reduced per layer from the attention pass: per layer and head the attention
    of non-sink queries to the sinks, and ``|dz|``/``|z|`` of the value swap, as sums and counts. Each
    :class:`~massive_lens.core.attention_pass.PassLayer` of a chunk is held (:meth:`take`: the attention
    on the columns :meth:`read` set, the values there, the heads' output norms) until the chunk's sinks
    are known (:meth:`reduce`)."""

    def __init__(self, n_layers: int, n_heads: int):
        self.mass = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.dz = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.z = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.queries = 0.0
        self.cols = torch.zeros(0, dtype=torch.long)
        self.held: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def read(self, cols: Tensor) -> Tensor:
        """Read the key columns ``cols`` (sorted) of the next pass; returns them."""
        self.cols, self.held = cols, {}
        return cols

    def take(self, at: PassLayer) -> None:
        """One layer, held: ``at.cols`` the attention on the columns, ``at.v`` the values there, the norms of
        ``at.z_read`` (the heads' outputs)."""
        self.held[at.layer] = (at.cols.float(), at.v[:, self.cols.to(at.v.device)].float(),
                               at.z_read.detach().float().norm(dim=-1))

    def reduce(self, sinks: Bool[Tensor, "batch pos"]) -> None:
        """The held layers' sums, once the chunk's sinks are known (every one among the columns)."""
        on, queries = sinks[:, self.cols], (~sinks).float()  # on [batch col]: the column is this sequence's sink
        self.queries += float(queries.sum())
        used = on.any(0)  # the columns that are a sink somewhere (the others add nothing): 1 of 64 candidates, often
        on = on[:, used]
        for layer, (p, v, z) in sorted(self.held.items()):
            q = queries.to(p.device)
            p, v = p[..., used.to(p.device)], v[:, used.to(v.device)]
            to_sinks = p * on.to(p.device)[:, None, None, :].float()  # [batch head query col]
            self.mass[layer] += torch.einsum("bhqc,bq->h", to_sinks, q).double().cpu()
            dv = swap_values(v, on.to(v.device)) - v  # a swap moves only the sinks' values
            delta = torch.einsum("bhqc,bchd->bqhd", to_sinks, dv.repeat_interleave(p.shape[1] // v.shape[2], 2))
            self.dz[layer] += torch.einsum("bqh,bq->h", delta.norm(dim=-1), q).double().cpu()
            self.z[layer] += torch.einsum("bqh,bq->h", z, q).double().cpu()
        self.held = {}


def swap_values(v: Float[Tensor, "batch pos kv_head d_head"], sinks: Bool[Tensor, "batch pos"]) -> Tensor:
    """``v`` with each sequence's sinks holding the values of the next sequence's sinks (its sink of
    the same rank, or its last sink)."""
    out = v.clone()
    batch = v.shape[0]
    for b in range(batch):
        other = (b + 1) % batch
        mine, theirs = sinks[b].nonzero().flatten(), sinks[other].nonzero().flatten()
        if len(theirs):
            out[b, mine] = v[other, theirs[torch.clamp(torch.arange(len(mine)), max=len(theirs) - 1)]]
    return out


def _untouched(view: ModelView, batch: Batch, rule: SinkRule, tally: _Tally, scorer: NextTokenLoss,
               base: list[Tensor]) -> SinkSet:
    """The untouched pass of one chunk: its loss (appended to ``base``), each layer read into ``tally``
    on the path :func:`~massive_lens.core.attention_pass.choose_path` takes, and its sinks (returned),
    found in the same forward where the held columns fit their budget (:func:`_holds`), else in a pass of their own."""
    path = choose_path(view, "auto", batch)
    candidates = candidate_columns(view, batch)
    given = None if _holds(view, batch, len(candidates), scorer) else sinks_of(view, batch, rule)
    out = None
    while out is None:  # again only where the loss's first check, in this forward, took the head's slices inexact
        evidence = SinkEvidence(batch.mask, view.n_layers, rule) if given is None else None
        reader = attention_reading(view, tally.take, path=path, batch=batch, want=("v", "z_read"), evidence=evidence,
                                   columns=tally.read(candidates if given is None else _columns(given)))
        with reader:  # the loss and the reading in one forward
            out = scorer(batch.tokens, hooks=reader.hooks, once=True)
    if not out.finite:
        raise MassiveLensError(f"{view.name} ({view.dtype}) gives NaN or inf logits on the untouched pass: it "
                               "overflowed; load it with dtype=torch.float32 or torch.bfloat16")
    base.append(out.loss)
    sinks = given if given is not None else sinks_from(evidence, view.token_kinds(batch), path)
    if int(sinks.mask[:, tally.cols].sum()) < int(sinks.mask.sum()):  # a sink outside the candidates: read again
        attention_pass(view, batch, tally.take, path=path, columns=tally.read(_columns(sinks)), want=("v", "z_read"))
    return sinks


def _holds(view: ModelView, batch: Batch, n_columns: int, scorer: NextTokenLoss) -> bool:
    """Whether every layer's attention on ``n_columns`` key columns may be held until the pass ends: at most
    :data:`HOLD_BYTES`, or half the batch's float32 logits where the loss is not taken from them."""
    held = len(attention_layers(view)) * batch.mask.numel() * view.cfg.n_heads * n_columns * 4
    logits = batch.mask.numel() * int(getattr(view.cfg, "d_vocab", 0) or 0) * 4 if scorer.may_slice else 0
    return held <= max(HOLD_BYTES, logits // 2)


def _columns(sinks: SinkSet) -> Tensor:
    """The positions that are a sink in some sequence."""
    return sinks.mask.any(0).nonzero().flatten()


def _drop_head(pattern: Tensor, hook: Any, *, head: int, state: HookState) -> Tensor:
    """One head's attention to the sinks removed and its rows renormalised (sink queries keep theirs)."""
    out = pattern.clone()
    out[:, head:head + 1] = drop_sinks(pattern[:, head:head + 1], hook, state=state, renormalize=True)
    return out


def sink_dependence(
    model: Any,
    text: Corpus | Tensor = None,
    *,
    heads: Sequence[tuple[int, int]] | None = None,
    max_heads: int = 8,
    seq_len: int = 64,
    n_seqs: int = 8,
    batch_size: int = 4,
    threshold: float | None = None,
    broadcast_at: float = 0.05,
    rule: SinkRule | None = None,
    progress: bool = True,
) -> SinkDependence:
    """Per sink head: the loss change when its attention to the sinks is removed (paired 95%
    interval over sequences) and whether the sink is a no-op or a broadcast for it (see the
    module docstring). Costs one untouched pass and one pass per measured head, per batch.

    Args:
        model: a TransformerLens-style model (not nnsight: the removal edits the pattern).
        text: the text (a corpus, text or a token tensor; None: the offline default text), cut
            into ``n_seqs`` sequences of ``seq_len`` tokens.
        heads: the ``(layer, head)`` pairs to measure (None: the ``max_heads`` sink heads with the
            most attention to the sinks).
        max_heads: how many sink heads to measure when ``heads`` is None (default 8).
        seq_len: tokens per sequence (default 64).
        n_seqs: sequences (default 8; at least 2: the swap takes another input's sink value).
        batch_size: sequences per forward pass (default 4; a last batch of one joins the one before).
        threshold: the attention to the sinks that makes a sink head (None: the rule's, 0.3).
        broadcast_at: the relative output change from which a head's sink is a ``broadcast``.
        rule: the sink rule that finds each sequence's sinks (None: ``SinkRule()``).
        progress: show a progress bar.

    Returns:
        A :class:`SinkDependence`.

    Raises:
        MassiveLensError: for fewer than 2 sequences, a head out of range, ``max_heads`` or
            ``batch_size`` below 1, a negative ``broadcast_at``, an nnsight model, or a model whose
            attention pattern edit does not reach its output.

    >>> from massive_lens import tiny_model
    >>> dep = sink_dependence(tiny_model("llama"), "The cat sat on the mat. " * 20, seq_len=16, n_seqs=2,
    ...                       heads=[(1, 0)], progress=False)
    >>> dep.to_frame()[["layer", "head", "measured", "label"]].values.tolist()
    [[1, 0, True, 'no-op']]
    """
    rule = as_rule(rule)
    threshold = rule.threshold if threshold is None else float(threshold)
    if max_heads < 1 or batch_size < 1 or not broadcast_at >= 0:
        raise MassiveLensError(f"max_heads and batch_size must be >= 1 and broadcast_at >= 0, got {max_heads}, "
                               f"{batch_size}, {broadcast_at}")
    view = ModelView(model)
    require(model, "sink_dependence", range(view.n_layers), reads=("pattern", "v", "z"),
            order=(("pattern", "z"), ("v", "z")), per_head=("v", "z"), edits_pattern=True)
    n_heads = view.cfg.n_heads
    for layer, head in heads or ():
        if not (0 <= layer < view.n_layers and 0 <= head < n_heads):
            raise MassiveLensError(f"head ({layer}, {head}) is not in {view.name} ({view.n_layers} layers of {n_heads} "
                                   "heads); pass (layer, head) pairs within it")
    tokens = sequences(view, text, seq_len, n_seqs)
    if len(tokens) < 2:
        raise MassiveLensError(f"sink_dependence needs at least 2 sequences (the swap takes another input's sink "
                               f"value), got {len(tokens)}; pass more text or n_seqs >= 2")
    chunks = list(tokens.split(batch_size))
    if len(chunks) > 1 and len(chunks[-1]) == 1:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    bar = tqdm(total=len(chunks), desc="sink dependence", disable=not progress, leave=False)
    tally, scorer, base, found = _Tally(view.n_layers, n_heads), NextTokenLoss(view), [], []
    for chunk in chunks:
        sinks = _untouched(view, view.full_batch(chunk), rule, tally, scorer, base)
        found.append(sinks)
        tally.reduce(sinks.mask)
        bar.update()
    mass = (tally.mass / max(tally.queries, 1.0)).float()
    swap = (tally.dz / tally.z.clamp(min=1e-12)).float()
    chosen = [tuple(h) for h in heads] if heads is not None else [
        tuple(divmod(int(i), n_heads)) for i in mass.flatten().argsort(descending=True)[:max_heads]
        if float(mass.flatten()[i]) >= threshold]
    listed = sorted(set(chosen) | {tuple(divmod(int(i), n_heads)) for i in (mass.flatten() >= threshold).nonzero()})
    bar.total += len(chunks) * len(chosen)
    base_loss = torch.cat(base)
    rows = []
    for layer, head in listed:
        row = dict(layer=layer, head=head, sink_mass=float(mass[layer, head]), measured=(layer, head) in chosen,
                   loss_change=float("nan"), loss_low=float("nan"), loss_high=float("nan"), ratio=float("nan"),
                   swap_change=float(swap[layer, head]),
                   label="broadcast" if float(swap[layer, head]) >= broadcast_at else "no-op")
        if row["measured"]:
            losses = []
            for chunk, sinks in zip(chunks, found, strict=True):
                hook = partial(_drop_head, head=head, state=HookState(sinks=sinks.mask))
                losses.append(perplexity(model, chunk, batch_size=len(chunk), progress=False,
                                         hooks=[(view.hook_name(layer, "attn.hook_pattern"), hook)]).per_seq)
                bar.update()
            diff = torch.cat(losses) - base_loss
            low, high = bootstrap_mean(diff)
            row.update(loss_change=float(diff.mean()), loss_low=low, loss_high=high, ratio=float(diff.mean().exp()))
        rows.append(row)
    bar.close()
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame = frame.sort_values(["measured", "sink_mass"], ascending=False, ignore_index=True)
    every = SinkSet(torch.cat([f.mask for f in found]), torch.cat([f.kinds for f in found]), found[0].source,
                    torch.cat([f.by_attention for f in found]), torch.cat([f.by_massive for f in found]))
    return SinkDependence(frame=frame, model_name=view.name, n_seqs=len(tokens), seq_len=int(tokens.shape[1]),
                          threshold=threshold, broadcast_at=broadcast_at, sinks=every)
