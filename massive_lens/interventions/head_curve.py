"""Perplexity against the share of heads zeroed: the most dormant heads first, against random
heads (Sandoval-Segura et al. 2025: zeroing more than 4% of the heads, the dormant ones, keeps
accuracy; Guo et al. 2024), and the pruning criteria of Sok et al. 2026 ("Garbage Attention":
the first-token sink score against weight magnitude and activation norm).

The heads are ranked once on calibration text (:func:`~massive_lens.interventions.heads.head_order`
over one :func:`~massive_lens.attention.dormant.dormant_heads` pass), never on the evaluation text.
Each share zeroes the first ``round(share * n_heads)`` heads of each ranking in ``orders``, and of
``draws`` random orders (one per seed; a draw's heads at a larger share include its heads at a
smaller one). Every point is a perplexity ratio against the untouched model on the same sequences:
each ranked order's point with a paired 95% bootstrap interval over sequences, the random points
with the geometric mean and a 95% interval over draws (t distribution on the log ratios).
:meth:`HeadCurve.best` names, per share, the ranked order that keeps perplexity lowest, with the
paired interval of its ratio to the runner-up's.

>>> from massive_lens import tiny_model
>>> text = "The cat sat on the mat. " * 40
>>> curve = head_curve(tiny_model("llama"), text, calibration="A dog ran in the park. " * 40,
...                    shares=(0.25,), draws=2, seq_len=16, n_seqs=2)
>>> curve.to_frame()[["order", "draw", "n_heads"]].values.tolist()
[['dormant', 0, 4], ['random', 0, 4], ['random', 1, 4]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from massive_lens.attention.dormant import dormant_heads
from massive_lens.core.corpora import default_text, sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean, t95
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.heads import ORDERS, head_order, zero_dormant_heads
from massive_lens.metrics import perplexity

SHARES = (0.02, 0.04, 0.08, 0.16, 0.32)
LABELS = {"dormant": "dormant-first", "sink": "sink-score-first", "activation": "lowest-activation-first",
          "weight": "lowest-weight-first"}


@dataclass(frozen=True, kw_only=True)
class HeadCurve(Result):
    """Results of :func:`head_curve`. ``frame``: one row per (order, draw, share): ``order``
    (one of :data:`~massive_lens.interventions.heads.ORDERS`), ``draw``, ``share``, ``n_heads``,
    ``perplexity``, ``ratio`` (to the untouched model), ``ratio_low``/``ratio_high`` (ranked
    orders: paired 95% bootstrap over sequences; NaN for the random rows, whose interval is over
    draws, see :meth:`curve`), ``heads`` (the zeroed heads, ``layer.head``). ``per_seq``: per ranked
    order, share and evaluation sequence, ``log_ratio`` (its mean loss minus the untouched one's),
    which :meth:`best` pairs."""

    frame: pd.DataFrame
    baseline: float
    model_name: str
    source: str
    per_seq: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["order", "share", "seq",
                                                                               "log_ratio"]))

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def curve(self) -> pd.DataFrame:
        """Per (order, share): ``n_heads``, ``ratio`` (random: the geometric mean over draws) and its
        95% interval (dormant: paired bootstrap over sequences; random: t interval over draws, on the
        log ratios)."""
        rows = []
        for (order, share), g in self.frame.groupby(["order", "share"], sort=False):
            if order != "random" or len(g) == 1:
                low, high = float(g.ratio_low.iloc[0]), float(g.ratio_high.iloc[0])
                rows.append(dict(order=order, share=share, n_heads=int(g.n_heads.iloc[0]),
                                 ratio=float(g.ratio.iloc[0]), low=low, high=high, draws=len(g)))
                continue
            logs = g.ratio.map(math.log)  # ratios are heavy-tailed: the interval is taken on their logs
            mean, half = float(logs.mean()), t95(len(g) - 1) * float(logs.std(ddof=1)) / math.sqrt(len(g))
            rows.append(dict(order=order, share=share, n_heads=int(g.n_heads.iloc[0]), ratio=math.exp(mean),
                             low=math.exp(mean - half), high=math.exp(mean + half), draws=len(g)))
        return pd.DataFrame(rows)

    def summary(self) -> str:
        curve = self.curve()
        lines = [f"{self.model_name}: perplexity ratio with a share of heads zeroed (untouched perplexity "
                 f"{self.baseline:.2f}; {self.source})"]
        best = self.best().set_index("share") if len(self.per_seq) else None
        for share, g in curve.groupby("share", sort=True):
            parts = []
            for r in g.itertuples():
                what = LABELS[r.order] if r.order != "random" else f"random ({r.draws} draws, geometric mean)"
                parts.append(f"{what} x{r.ratio:.3g} [{r.low:.3g}, {r.high:.3g}]")
            line = f"  {share:.0%} of heads ({int(g.n_heads.iloc[0])}): " + "; ".join(parts)
            if best is not None and share in best.index:
                b = best.loc[share]
                verdict = ("lowest, below" if b.low > 1 or b.high < 1 else "lowest, but not shown apart from")
                line += (f"; {LABELS[b.order]} {verdict} {LABELS[b.runner_up]} (paired ratio x{b.ratio:.3g} "
                         f"[{b.low:.3g}, {b.high:.3g}])")
            lines.append(line)
        return "\n".join(lines)

    def best(self) -> pd.DataFrame:
        """Per share with two or more ranked orders: ``order`` (the one whose perplexity is lowest),
        ``runner_up``, and ``ratio`` (its perplexity over the runner-up's, ``exp`` of the mean
        per-sequence difference of their losses) with ``low``/``high``, the paired 95% bootstrap
        interval over sequences (the difference is shown only when it excludes 1)."""
        rows = []
        for share, g in self.per_seq.groupby("share", sort=True):
            means = g.groupby("order")["log_ratio"].mean().sort_values()
            if len(means) < 2:
                continue
            first, second = means.index[0], means.index[1]
            a = g[g.order == first].sort_values("seq")["log_ratio"].to_numpy()
            b = g[g.order == second].sort_values("seq")["log_ratio"].to_numpy()
            low, high = bootstrap_mean(torch.as_tensor(a - b))
            rows.append(dict(share=share, order=first, runner_up=second, ratio=math.exp(float((a - b).mean())),
                             low=math.exp(low), high=math.exp(high)))
        return pd.DataFrame(rows, columns=["share", "order", "runner_up", "ratio", "low", "high"])

    def plot(self, ax: Any = None) -> Any:
        """Ratio against the share of heads zeroed, dormant-first and random, with intervals."""
        ax = ensure_axes(ax, (6, 4), layout=None)
        for order, g in self.curve().groupby("order", sort=False):
            label = LABELS[order] if order != "random" else f"random heads ({g.draws.max()} draws)"
            ax.plot(g.share * 100, g.ratio, marker="o", label=label)
            ax.fill_between(g.share * 100, g.low, g.high, alpha=0.2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("heads zeroed (% of all heads)")
        ax.set_ylabel("perplexity ratio to the untouched model")
        ax.set_title(f"{self.model_name}: zeroing heads")
        ax.legend(frameon=False, fontsize=8)
        return ax


def head_curve(model: Any, corpus: Any = None, *, calibration: Any = None, shares: Sequence[float] = SHARES,
               draws: int = 5, seq_len: int = 128, n_seqs: int = 8, calibration_seqs: int = 4,
               orders: Sequence[str] = ("dormant", "random")) -> HeadCurve:
    """Perplexity with a growing share of heads zeroed, in each of ``orders`` (by default most
    dormant first against random heads; ``orders=ORDERS`` adds the sink-score, activation-norm
    and weight-magnitude criteria).

    Args:
        model: a TransformerLens-style model.
        corpus: the evaluation text (a file, text, token tensor; None: the offline default text).
        calibration: the text the dormant heads are ranked on (None: the ``calibration_seqs``
            sequences of ``corpus`` after the evaluation ones); use other text than ``corpus``.
        shares: shares of all heads to zero, each in (0, 1] (default :data:`SHARES`).
        draws: random orders (seeds 0 to ``draws - 1``), at least 1.
        seq_len: tokens per sequence (evaluation and calibration).
        n_seqs: evaluation sequences.
        calibration_seqs: calibration sequences.
        orders: the orders, from :data:`~massive_lens.interventions.heads.ORDERS` (``"dormant"``,
            ``"sink"``, ``"activation"``, ``"weight"``, ``"random"``; see
            :func:`~massive_lens.interventions.heads.head_order`), all ranked on the same calibration text.

    Returns:
        A :class:`HeadCurve`.

    Raises:
        MassiveLensError: for an empty ``shares``, a share outside (0, 1], ``draws`` below 1, an
            empty ``orders`` or an order name that does not exist, a
            calibration sequence that repeats an evaluation one (also when one is shorter), or an
            unusable model or corpus (see :func:`~massive_lens.perplexity`).
    """
    shares = sorted({float(s) for s in shares})
    if not shares or not 0 < shares[0] <= shares[-1] <= 1 or draws < 1:
        raise MassiveLensError(f"shares must be non-empty and in (0, 1], draws >= 1; got {shares}, {draws}")
    orders = list(dict.fromkeys(orders))
    if not orders or set(orders) - set(ORDERS):
        raise MassiveLensError(f"orders must be a non-empty selection of {ORDERS}, got {orders}")
    view = ModelView(model)
    if calibration is None:  # the sequences after the evaluation ones (disjoint text), as the report does
        both = sequences(view, default_text() if corpus is None else corpus, seq_len, n_seqs + calibration_seqs)
        tokens, calib = both[:n_seqs], both[n_seqs:]
        if len(calib) == 0:
            raise MassiveLensError(f"the corpus gives {len(both)} sequences of {seq_len} tokens, none left to rank "
                                   "the heads on after the evaluation ones; give more text or pass calibration=")
    else:
        tokens = sequences(view, corpus, seq_len, n_seqs)
        calib = sequences(view, calibration, seq_len, calibration_seqs)
    n = min(tokens.shape[1], calib.shape[1])
    same = (calib[:, None, :n] == tokens[None, :, :n]).all(-1).nonzero()  # [calibration, evaluation] pairs
    if len(same):
        c, e = (int(i) for i in same[0])
        raise MassiveLensError(f"calibration sequence {c} is evaluation sequence {e} (their first {n} tokens are "
                               f"the same; {len(same)} such pair(s)), so the heads would be ranked on the text "
                               "they are evaluated on: rank the heads on other text (calibration=)")
    found = dormant_heads(model, calib)
    ranked = {order: head_order(model, found, order) for order in orders if order != "random"}
    every = head_order(model, found, "dormant")
    base = perplexity(model, tokens, progress=False)
    rows, per_seq = [], []

    def point(order: str, draw: int, share: float, heads: list[tuple[int, int]]) -> None:
        run = perplexity(model, tokens, hooks=zero_dormant_heads(model, heads=heads), progress=False)
        diff = run.per_seq - base.per_seq
        low, high = bootstrap_mean(diff) if order != "random" else (math.nan, math.nan)
        if order != "random":
            per_seq.extend(dict(order=order, share=share, seq=i, log_ratio=float(d)) for i, d in enumerate(diff))
        rows.append(dict(order=order, draw=draw, share=share, n_heads=len(heads), perplexity=run.perplexity,
                         ratio=math.exp(float(diff.mean())), ratio_low=math.exp(low), ratio_high=math.exp(high),
                         heads=" ".join(f"{layer}.{head}" for layer, head in sorted(heads))))

    n_all = len(every)
    for share in shares:
        k = max(1, round(share * n_all))
        for order, heads in ranked.items():
            point(order, 0, share, heads[:k])
        for draw in range(draws if "random" in orders else 0):
            drawn = torch.randperm(n_all, generator=torch.Generator().manual_seed(draw)).tolist()
            point("random", draw, share, [every[i] for i in drawn[:k]])
    frame = pd.DataFrame(rows).sort_values(["share", "order", "draw"], ignore_index=True)
    source = (f"{len(tokens)} sequences of {tokens.shape[1]} tokens; heads ranked on {len(calib)} calibration "
              f"sequences")
    return HeadCurve(frame=frame, baseline=base.perplexity, model_name=view.name, source=source,
                     per_seq=pd.DataFrame(per_seq, columns=["order", "share", "seq", "log_ratio"]))
