"""The streaming window (StreamingLLM, Xiao et al., 2023): why the first tokens must stay in the cache.

A model read with a rolling window of its ``W`` most recent tokens falls apart once the first
tokens leave the window: heads that parked their attention on the sink have nowhere to put it.
Keeping the first ``k`` tokens (``k = 4`` in the paper) restores perplexity to near full
attention. :func:`streaming_window` measures it on a text several times the window: full
attention, then the window with ``k = 0, 1, 2, 4`` first tokens kept, positions within the
cache as StreamingLLM assigns them (how: :mod:`massive_lens.effects.cache`), and asks the sink
census which ``k`` the model's primary sinks predict (one past the last primary sink position).

>>> from massive_lens import tiny_model
>>> run = streaming_window(tiny_model("llama"), "a b c d e f g h " * 40, window=16, sinks=(0, 1),
...                        seq_len=64, n_seqs=1, census=False)
>>> run.to_frame()["setting"].tolist()
['full', 'k=0', 'k=1']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention import sink_census
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.effects.cache import POSITIONS, window_hooks
from massive_lens.errors import MassiveLensError

FULL = "full"


def _exp(loss: float) -> float:
    """``exp(loss)``, inf past float64's range (a broken window can be that wrong)."""
    return float(torch.tensor(loss, dtype=torch.float64).exp())


@dataclass(frozen=True, kw_only=True)
class StreamingWindow(Result):
    """Perplexity under a StreamingLLM window against full attention (see the module docstring).

    ``to_frame()``: one row per ``setting`` (``full``, ``k=0``, ...): ``k`` (first tokens kept;
    -1 for full attention), ``window``, ``perplexity`` over every predicted token with
    ``perplexity_low``/``perplexity_high`` (95% bootstrap over sequences), ``ratio`` (over full
    attention), ``evicting_perplexity`` (only the tokens predicted once the cache is full, where
    the settings differ) and ``n_seqs``. ``curve``: perplexity per ``setting`` over position
    bins (``pos_start``, ``pos_end``). ``losses``: per-token loss ``[setting, seq, pos - 1]`` in
    the frame's order. ``predicted_k``: what the census's primary sinks predict (-1: not run).
    """

    frame: pd.DataFrame
    curve: pd.DataFrame
    losses: Tensor
    model_name: str
    window: int
    seq_len: int
    positions: str
    predicted_k: int = -1
    primary_positions: str = ""

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame.set_index("setting")
        full = f.loc[FULL]
        parts = [f"{row.setting}: {row.perplexity:.2f} ({row.ratio:.2f}x; after eviction "
                 f"{row.evicting_perplexity:.2f})" for row in self.frame.itertuples() if row.setting != FULL]
        text = (f"{self.model_name}, {int(full['n_seqs'])} sequences of {self.seq_len} tokens, window {self.window} "
                f"(positions: {self.positions}): full attention perplexity {full['perplexity']:.2f} (95% CI "
                f"{full['perplexity_low']:.2f}-{full['perplexity_high']:.2f}); " + "; ".join(parts))
        kept = self.frame[self.frame["k"] > 0]
        if len(kept):
            best = kept.loc[kept["ratio"].idxmin()]
            text += f". Fewest first tokens within 10% of the best: k={_enough(kept, best['ratio'])}"
        if self.predicted_k >= 0:
            text += (f". The census's primary sinks (positions {self.primary_positions}) predict "
                     f"k={self.predicted_k}")
        return text

    def plot(self, ax: Any = None) -> Any:
        """Perplexity over position (log), one line per setting; the window's end marked."""
        ax = ensure_axes(ax, (8, 4.5))
        for name, rows in self.curve.groupby("setting", sort=False):
            mid = (rows["pos_start"] + rows["pos_end"]) / 2
            ax.plot(mid, rows["perplexity"], marker="o", markersize=3, label=name, lw=2 if name == FULL else 1.2)
        ax.axvline(self.window, color="grey", ls=":", lw=1)
        ax.set(xlabel="position", ylabel="perplexity (log)", yscale="log",
               title=f"{self.model_name}: StreamingLLM window {self.window}")
        ax.legend(fontsize=8)
        return ax


def _enough(kept: pd.DataFrame, best: float) -> int:
    return int(kept[kept["ratio"] <= best * 1.1]["k"].min())


def _token_losses(view: ModelView, scorer: NextTokenLoss, tokens: Tensor, hooks: list, batch_size: int) -> Tensor:
    """Each prediction's loss ``[seq, pos - 1]``, never holding a batch's logits where the head
    can be applied slice by slice (:mod:`massive_lens.core.loss`). Full attention (no hooks)
    giving NaN or inf logits is the model overflowing: an error, as in every other analysis."""
    outs = [scorer(chunk, hooks=hooks, per_token=True) for chunk in scorer.batches(tokens, batch_size)]
    if not hooks and not all(out.finite for out in outs):
        raise view.overflow_error("the logits (full attention, before any window)")
    return torch.cat([out.token_loss for out in outs])


def _predicted_k(model: Any, tokens: Tensor, length: int) -> tuple[int, str]:
    """One past the last primary sink position (the median over sequences), and the positions."""
    census = sink_census(model, tokens[:, :length], batch_size=1)
    prim = census.level("primary")
    if not len(prim):
        return 0, "none"
    last = prim.groupby("seq")["pos"].max() + 1
    positions = ", ".join(str(p) for p in sorted(prim["pos"].unique())[:6])
    return int(last.median()), positions


def streaming_window(model: Any, text: Corpus = None, *, window: int = 256, sinks: Sequence[int] = (0, 1, 2, 4),
                     seq_len: int = 1024, n_seqs: int = 4, batch_size: int = 1, positions: str = "cache",
                     bins: int = 16, census: bool = True, census_len: int = 128) -> StreamingWindow:
    """Perplexity with a StreamingLLM window of ``window`` recent tokens plus the first ``k``
    tokens for each ``k`` in ``sinks``, against full attention (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a corpus (a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token
            tensor; None: the offline default text), cut into ``n_seqs`` sequences of ``seq_len``.
        window: recent tokens kept (the query included; default 256).
        sinks: numbers of first tokens kept (default ``(0, 1, 2, 4)``).
        seq_len: tokens per sequence (BOS included; default 1024, at least 4x the window for
            the published setting).
        n_seqs: sequences (default 4).
        batch_size: sequences per forward pass (default 1).
        positions: ``"cache"`` (StreamingLLM's positions within the cache; needs rotary
            embeddings) or ``"original"`` (each token keeps its position).
        bins: position bins of the curve (default 16).
        census: run :func:`~massive_lens.attention.sink_census` on the first ``census_len``
            tokens of each sequence to predict ``k``.
        census_len: tokens per sequence the census reads (default 128).

    Returns:
        A :class:`StreamingWindow`.

    Raises:
        MassiveLensError: for a window below 1, a negative ``k``, a ``census_len`` below 1,
            unknown ``positions``, ``positions="cache"`` on a model without HF-style rotary
            embeddings, or a model whose full-attention logits overflow (NaN or inf).

    >>> from massive_lens import tiny_model
    >>> run = streaming_window(tiny_model("llama"), "a b c d " * 40, window=64, sinks=(0, 1), seq_len=64, n_seqs=1,
    ...                        census=False)
    >>> run.to_frame()["ratio"].tolist()  # the window holds the whole text: full attention exactly
    [1.0, 1.0, 1.0]
    """
    view = ModelView(model)
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):  # sinks=3: say it is a list of counts
        raise MassiveLensError(f"sinks must be a non-empty sequence of integers >= 0 (how many first tokens each run "
                               f"keeps, e.g. sinks=({sinks!r},) or (0, 1, 2, 4)), got {sinks!r}")
    ks = list(sinks)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise MassiveLensError(f"window must be an integer >= 1, got {window!r}")
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ks):
        raise MassiveLensError(f"sinks must be a non-empty sequence of integers >= 0, got {sinks!r}")
    if census and (isinstance(census_len, bool) or not isinstance(census_len, int) or census_len < 1):
        raise MassiveLensError(f"census_len is how many tokens per sequence the sink census reads: an integer >= 1, "
                               f"got {census_len!r} (or census=False to skip the census)")
    if positions not in POSITIONS or bins < 1 or batch_size < 1:
        raise MassiveLensError(f"need positions in {POSITIONS}, bins >= 1 and batch_size >= 1, got {positions!r}, "
                               f"{bins}, {batch_size}")
    tokens = sequences(view, text, seq_len, n_seqs)
    settings = [(FULL, -1, [])] + [(f"k={k}", k, window_hooks(view, window, k, positions)) for k in ks]
    scorer = NextTokenLoss(view)
    losses = torch.stack([_token_losses(view, scorer, tokens, hooks, batch_size) for _, _, hooks in settings])
    n = losses.shape[-1]
    rows = []
    for i, (name, k, _) in enumerate(settings):
        per_seq = losses[i].double().mean(1)
        low, high = bootstrap_mean(per_seq)
        start = window + max(k, 0)  # predictions whose query sees a full cache: query index >= k + W
        late = losses[i][:, start:] if start < n else losses[i][:, :0]
        rows.append(dict(setting=name, k=k, window=window, perplexity=_exp(float(per_seq.mean())),
                         perplexity_low=_exp(low), perplexity_high=_exp(high),
                         evicting_perplexity=_exp(float(late.double().mean())) if late.numel() else float("nan"),
                         n_seqs=len(tokens)))
    frame = pd.DataFrame(rows)
    frame["ratio"] = frame["perplexity"] / frame.loc[0, "perplexity"]
    edges = torch.linspace(0, n, bins + 1).long().tolist()
    curve = pd.DataFrame([dict(setting=name, k=k, pos_start=a + 1, pos_end=b,
                               perplexity=_exp(float(losses[i][:, a:b].double().mean())))
                          for i, (name, k, _) in enumerate(settings) for a, b in zip(edges, edges[1:], strict=False)
                          if b > a])
    predicted, where = _predicted_k(model, tokens, min(census_len, tokens.shape[1])) if census else (-1, "")
    return StreamingWindow(frame=frame, curve=curve, losses=losses, model_name=view.name, window=window,
                           seq_len=int(tokens.shape[1]), positions=positions, predicted_k=predicted,
                           primary_positions=where)
