"""Super weights, verified: the detector's candidates against the damage each one does.

:func:`~massive_lens.trace_origin` names *candidate* super weights with a detector: the
neurons whose terms ``post[n] * W_out[n, dim]`` write most of a massive entry, at the traced
position of the traced text (Yu et al., 2024). A detector is not a mechanism: in a
preregistered 22-model study, ranking super-weight rows by activation misorders the real
damage by 47x to 130x, and the row that breaks the model can be the fourth one ranked. The
only evidence that a weight matters is what removing it does.

:func:`verify_super_weights` takes the top ``top_k`` candidates of each layer, ranked by the
detector (``|contribution|`` at the traced entries), zeroes each one alone (one scalar,
Hugging Face ``down_proj.weight[dim, neuron]``) and measures the next-token loss on a corpus,
paired over sequences against the untouched model (95% bootstrap intervals, as everywhere in
the package). A candidate is **verified** only when its interval lies above zero. The most
damaging candidates are then zeroed in pairs: the *interaction* of a pair is what zeroing
both costs beyond the sum of what each costs alone (negative: they back each other up or
the loss saturates; positive: each covers for the other). Every weight is restored under the
model's lock, on every exit path.

Cost: one perplexity pass over the corpus per candidate and per pair, plus the untouched one;
the estimate is logged before the runs start, and a bar shows progress.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.fmt import num
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.metrics import perplexity
from massive_lens.origin.neurons import super_weight_rows, w_out
from massive_lens.origin.trace import OriginTrace
from massive_lens.origin.verify import zeroed_weights

log = logging.getLogger(__name__)
CANDIDATE_COLUMNS = ["layer", "neuron", "dim", "pos", "detector_rank", "contribution", "share", "w_out", "zscore",
                     "weight_rank", "hf_param", "hf_row", "hf_col", "loss_delta", "low", "high", "ppl_ratio",
                     "damage_rank", "verified"]
PAIR_COLUMNS = ["a", "b", "delta_a", "delta_b", "delta_ab", "interaction", "low", "high", "verdict"]
WARN_S = 60.0  # the estimate is a warning (else INFO) above this many seconds


@dataclass(frozen=True, kw_only=True)
class SuperWeightCheck(Result):
    """Candidate super weights with the loss change each one's removal measures.

    - ``candidates`` (also ``to_frame()``): one row per candidate weight ``W_out[neuron, dim]``
      of MLP ``layer`` (Hugging Face ``hf_param[hf_row, hf_col]``): the traced ``pos`` where the
      detector saw it, its ``detector_rank`` within the layer (1: largest ``|contribution|``),
      ``contribution`` and ``share`` of its MLP's term there, the weight ``w_out`` with its
      ``zscore`` and ``weight_rank`` among the matrix's entries; measured: ``loss_delta`` (mean
      per-sequence loss change in nats when it alone is zeroed) with its paired 95% interval
      ``low``/``high``, ``ppl_ratio`` (``exp(loss_delta)``), ``damage_rank`` within the layer
      (1: the largest ``loss_delta``) and ``verified`` (``low > 0``);
    - ``pairs``: the most damaging candidates zeroed two at a time (``a``, ``b`` are row
      indices of ``candidates``): ``delta_a``, ``delta_b``, ``delta_ab`` and the
      ``interaction`` ``delta_ab - delta_a - delta_b`` with its paired interval and a
      ``verdict`` (``sub-additive``, ``additive``, ``super-additive``);
    - ``per_seq``: each run's per-sequence loss change, candidates then pairs (row order).
    """

    candidates: pd.DataFrame
    pairs: pd.DataFrame
    per_seq: Float[Tensor, "run seq"]
    base_loss: float
    model_name: str
    n_seqs: int
    seq_len: int
    top_k: int
    notes: tuple[str, ...]

    def to_frame(self) -> pd.DataFrame:
        return self.candidates.copy()

    def summary(self) -> str:
        c = self.candidates
        head = (f"{self.model_name}: {len(c)} super-weight candidate{'s' if len(c) != 1 else ''} (the top "
                f"{self.top_k} per layer by |contribution| at the traced entries)")
        if c.empty:
            return "\n".join([head + ": no MLP write of the trace names a neuron, nothing to verify", *self.notes])
        layers = sorted(set(c.layer.tolist()))
        lines = [head + f" in MLP {', '.join(map(str, layers))}, each zeroed alone on {self.n_seqs} x "
                 f"{self.seq_len} tokens (base loss {self.base_loss:.3f} nats)",
                 f"verified (zeroing raises the loss, paired 95% interval above 0): {int(c.verified.sum())} of "
                 f"{len(c)}"]
        lines += [self._disagreement(c[c.layer == layer], f"MLP {layer}") for layer in layers]
        if len(layers) > 1:
            lines.append(self._disagreement(c, "over all layers", overall=True))
        for p in self.pairs.itertuples():
            lines.append(f"pair {_name(c.loc[p.a])} + {_name(c.loc[p.b])}: together {_delta(p.delta_ab)}, alone "
                         f"{_delta(p.delta_a)} and {_delta(p.delta_b)}: interaction {_delta(p.interaction)} "
                         f"[{_delta(p.low)}, {_delta(p.high)}] ({p.verdict})")
        return "\n".join([*lines, *self.notes])

    def _disagreement(self, rows: pd.DataFrame, where: str, overall: bool = False) -> str:
        """Does the detector's top row of ``rows`` do the most damage? With the paired difference."""
        top = rows.loc[rows.contribution.abs().idxmax()] if overall else rows[rows.detector_rank == 1].iloc[0]
        worst = rows.loc[rows.loss_delta.idxmax()]
        said = f"{where}: the detector's top row {_name(top)} costs {_interval(top)}"
        if not rows.verified.any():
            return said + "; no candidate here raises the loss beyond noise"
        if top.name == worst.name:
            return said + " and is the most damaging"
        diff = self.per_seq[int(worst.name)] - self.per_seq[int(top.name)]
        low, high = bootstrap_mean(diff)
        sure = "" if low > 0 else " (within noise)"
        rank = int(worst.detector_rank) if not overall else int((rows.contribution.abs() > abs(worst.contribution))
                                                                 .sum()) + 1
        return (said + f"; NOT the most damaging{sure}: the detector's #{rank} {_name(worst)} costs "
                f"{_interval(worst)}, paired difference {_delta(float(diff.mean()))} [{_delta(low)}, {_delta(high)}]")

    def plot(self, ax: Any = None) -> Any:
        """Loss change of each candidate (with its interval) against its detector score."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        c = self.candidates
        if c.empty:
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set(title=f"{self.model_name}: no super-weight candidate")
            return ax
        x = c.contribution.abs().clip(lower=1e-12)
        err = np.stack([(c.loss_delta - c.low).clip(lower=0), (c.high - c.loss_delta).clip(lower=0)])
        for layer, g in c.groupby("layer"):
            ax.errorbar(x[g.index], g.loss_delta, yerr=err[:, g.index], fmt="o", capsize=3, label=f"MLP {layer}")
        for i, r in c.iterrows():
            ax.annotate(str(int(r.neuron)), (x[i], r.loss_delta), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="detector score |contribution| at the traced entry",
               ylabel="loss change when zeroed (nats)", title=f"{self.model_name}: super-weight candidates")
        ax.legend(fontsize=7)
        return ax


def _name(r: Any) -> str:
    return f"{r.hf_param}[{int(r.hf_row)}, {int(r.hf_col)}]"


def _delta(x: float) -> str:
    return f"{x:+.3g}" if math.isfinite(x) else str(x)


def _interval(r: Any) -> str:
    ratio = f", x{num(r.ppl_ratio)} perplexity" if math.isfinite(r.ppl_ratio) else ""
    return f"{_delta(r.loss_delta)} [{_delta(r.low)}, {_delta(r.high)}] nats{ratio}"


def verify_super_weights(
    model: Any,
    trace: Any,
    corpus: Corpus = None,
    *,
    top_k: int = 3,
    pairs: int = 3,
    seq_len: int = 128,
    n_seqs: int = 16,
    progress: bool = True,
) -> SuperWeightCheck:
    """Zero each candidate super weight of ``trace`` alone, then the most damaging in pairs, and
    measure the loss change on ``corpus`` (see the module docstring).

    Args:
        model: the model ``trace`` was made on (its weights are checked against the trace).
        trace: an :class:`~massive_lens.origin.OriginTrace` of ``model``; its MLP writes'
            neurons (dense MLPs) are the candidates.
        corpus: what the loss is measured on: a text file, a string, strings, ``hf:`` name, a
            ``[seq, pos]`` token tensor, or None for the offline default text.
        top_k: candidates per layer, by the detector's rank (at most the trace's
            ``top_neurons``, 5 by default).
        pairs: zero every pair among this many most damaging candidates (0: no pairs).
        seq_len: tokens per sequence read from a text corpus.
        n_seqs: sequences read from a text corpus (at least 2: the intervals are over sequences).
        progress: show a progress bar over the runs.

    Returns:
        A :class:`SuperWeightCheck`.

    Raises:
        MassiveLensError: if ``trace`` is not an ``OriginTrace`` of this model, ``top_k`` or
            ``pairs`` is not a count, or the corpus gives fewer than 2 sequences.

    >>> import torch
    >>> from massive_lens import tiny_model, trace_origin
    >>> model = tiny_model("llama")
    >>> with torch.no_grad():
    ...     model.blocks[1].mlp.W_out[:, 5] *= 3000.0  # MLP 1 writes a massive value into dim 5
    >>> trace = trace_origin(model, "Hi there.", dim=5, pos=0)
    >>> check = verify_super_weights(model, trace, "Some text to read. " * 40, top_k=2, pairs=2,
    ...                              seq_len=16, n_seqs=4, progress=False)
    >>> sorted(set(check.candidates.layer)), len(check.pairs)
    ([1], 1)
    """
    view = ModelView(model)
    for name, value, low in (("top_k", top_k, 1), ("pairs", pairs, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise MassiveLensError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(trace, OriginTrace):
        raise MassiveLensError(f"trace must be the OriginTrace of trace_origin(model, text), got "
                               f"{type(trace).__name__}")
    if trace.model_name != view.name:
        raise MassiveLensError(f"the trace is of {trace.model_name}, not of {view.name}; trace this model first")
    rows, notes = candidates(view, trace, top_k)
    tokens = sequences(view, corpus, seq_len, n_seqs)
    if len(tokens) < 2:
        raise MassiveLensError(f"the corpus gives {len(tokens)} sequence of {tokens.shape[1]} tokens; the paired "
                               "intervals need at least 2 (pass a longer corpus or n_seqs >= 2)")
    if not rows:
        return _result(view, pd.DataFrame(columns=CANDIDATE_COLUMNS), [], torch.zeros(0, len(tokens)), math.nan,
                       tokens, top_k, notes)
    n_pairs = math.comb(min(pairs, len(rows)), 2)
    started = time.perf_counter()
    base = _losses(view, tokens, [])
    seconds = (time.perf_counter() - started) * (len(rows) + n_pairs)
    log.log(logging.WARNING if seconds > WARN_S else logging.INFO,
            "%s: %d candidates and %d pairs: %d passes over %d x %d tokens, estimated %.0f s", view.name, len(rows),
            n_pairs, len(rows) + n_pairs, *tokens.shape, seconds)
    bar = tqdm(total=len(rows) + n_pairs, desc="super weights (zeroed one at a time, then in pairs)",
               disable=not progress, leave=False)
    with bar:
        deltas = []
        for r in rows:
            deltas.append(_losses(view, tokens, [(r["layer"], r["neuron"], r["dim"])]) - base)
            bar.update()
        frame = _measured(pd.DataFrame(rows), deltas)
        chosen = frame.loss_delta.sort_values(ascending=False, kind="stable").index[:min(pairs, len(rows))]
        pair_rows = []
        for a, b in itertools.combinations(sorted(chosen.tolist()), 2):
            both = [(int(frame.at[i, "layer"]), int(frame.at[i, "neuron"]), int(frame.at[i, "dim"])) for i in (a, b)]
            together = _losses(view, tokens, both) - base
            deltas.append(together)
            pair_rows.append(_pair(a, b, deltas[a], deltas[b], together))
            bar.update()
    return _result(view, frame, pair_rows, torch.stack(deltas), float(base.mean()), tokens, top_k, notes)


def candidates(view: ModelView, trace: OriginTrace, top_k: int) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The top ``top_k`` candidate weights per layer from the trace's MLP writes (dense MLPs),
    each ``(layer, neuron, dim)`` once (where its ``|contribution|`` is largest), ranked by
    ``|contribution|``; with notes on what was left out."""
    n = trace.neurons
    notes = []
    if (n.expert >= 0).any():
        notes.append("note: the mixture-of-experts neurons are not candidates here (only dense MLP weights are "
                     "zeroed)")
    writes = n[(n.kind != "erasure") & (n.expert < 0) & (n.w_out != 0)]
    if writes.empty:
        return [], tuple(notes)
    writes = writes.assign(size=writes.contribution.abs()).sort_values("size", ascending=False, kind="stable")
    writes = writes.drop_duplicates(["layer", "neuron", "dim"])
    out: list[dict[str, Any]] = []
    seen: dict[int, Any] = {}
    for layer, group in writes.groupby("layer", sort=True):
        for rank, r in enumerate(group.head(top_k).itertuples(), start=1):
            now = float(w_out(view, int(layer))[int(r.neuron), int(r.dim)].detach())
            if not math.isclose(now, r.w_out, rel_tol=1e-3, abs_tol=1e-6):
                raise MassiveLensError(f"W_out[{r.neuron}, {r.dim}] of MLP {layer} is {now:.4g} on {view.name} but "
                                       f"{r.w_out:.4g} in the trace: the model changed since it was traced; trace it "
                                       "again")
            w = super_weight_rows(view, int(r.pos), int(r.dim), int(layer), [int(r.neuron)], seen)[0]
            out.append(dict(layer=int(layer), neuron=int(r.neuron), dim=int(r.dim), pos=int(r.pos),
                            detector_rank=rank, contribution=float(r.contribution), share=float(r.share),
                            w_out=w["value"], zscore=w["zscore"], weight_rank=w["rank"], hf_param=w["hf_param"],
                            hf_row=w["hf_row"], hf_col=w["hf_col"]))
    return out, tuple(notes)


def _losses(view: ModelView, tokens: Tensor, entries: list[tuple[int, int, int]]) -> Float[Tensor, " seq"]:
    """Per-sequence loss with the ``(layer, neuron, dim)`` weights zeroed (restored after)."""
    with zeroed_weights(view, entries):
        return perplexity(view.model, tokens, progress=False).per_seq.double()


def _measured(frame: pd.DataFrame, deltas: list[Tensor]) -> pd.DataFrame:
    """The candidates with their measured loss change, interval, damage rank and verdict."""
    stats = [(float(d.mean()), *_ci(d)) for d in deltas]
    frame = frame.assign(loss_delta=[s[0] for s in stats], low=[s[1] for s in stats], high=[s[2] for s in stats])
    frame["ppl_ratio"] = [math.exp(x) if x < 700 else math.inf for x in frame.loss_delta]
    frame["damage_rank"] = frame.groupby("layer").loss_delta.rank(ascending=False, method="first").astype(int)
    frame["verified"] = frame.low > 0
    return frame[CANDIDATE_COLUMNS]


def _ci(values: Tensor) -> tuple[float, float]:
    if not bool(torch.isfinite(values).all()):
        mean = float(values.mean())
        return mean, mean
    return bootstrap_mean(values)


def _pair(a: int, b: int, delta_a: Tensor, delta_b: Tensor, together: Tensor) -> dict[str, Any]:
    interaction = together - delta_a - delta_b
    low, high = _ci(interaction)
    verdict = "sub-additive" if high < 0 else "super-additive" if low > 0 else "additive"
    return dict(a=a, b=b, delta_a=float(delta_a.mean()), delta_b=float(delta_b.mean()),
                delta_ab=float(together.mean()), interaction=float(interaction.mean()), low=low, high=high,
                verdict=verdict)


def _result(view: ModelView, frame: pd.DataFrame, pair_rows: list[dict[str, Any]], per_seq: Tensor, base: float,
            tokens: Tensor, top_k: int, notes: tuple[str, ...]) -> SuperWeightCheck:
    return SuperWeightCheck(candidates=frame.reset_index(drop=True),
                            pairs=pd.DataFrame(pair_rows, columns=PAIR_COLUMNS), per_seq=per_seq.float(),
                            base_loss=base, model_name=view.name, n_seqs=int(tokens.shape[0]),
                            seq_len=int(tokens.shape[1]), top_k=top_k, notes=notes)
