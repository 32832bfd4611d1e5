"""Does scaling the attention to the first token help? A γ sweep of
:func:`~massive_lens.interventions.sink_scale.scale_sink_attention` (ZeroTuning, Han et al. 2026)
on two measures, each paired against the untouched model (γ = 1) on the same sequences:

- ``text``: the next-token loss on ordinary text (the perplexity ratio, with a paired 95%
  bootstrap interval over sequences) and its top-1 accuracy;
- ``repeat``: an in-context task every causal model can do: a sequence's first token, then a run of
  ``repeat_len`` random tokens (drawn from the corpus's own tokens), then the same run again. The
  score is the share of the second run's tokens (after its first) that the model predicts top-1,
  and the loss on them: copying from context, which ZeroTuning's tasks reward.

A γ "helps" only where its interval excludes no change in the better direction; the summary says
so, or says that no γ did.

>>> from massive_lens import tiny_model
>>> sweep = sink_scale_sweep(tiny_model("llama"), "The cat sat on the mat. " * 30, gammas=(0.5, 2.0),
...                          seq_len=16, n_seqs=2, repeat_len=6, repeat_seqs=2)
>>> sorted(set(sweep.to_frame()["task"])), sorted(set(sweep.to_frame()["gamma"]))
(['repeat', 'text'], [0.5, 1.0, 2.0])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.corpora import default_text, sequences
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.sink_scale import gamma_per_head, scale_sink_attention
from massive_lens.metrics import as_hooks

GAMMAS = (0.25, 0.5, 0.8, 1.25, 1.5, 2.0)
COLUMNS = ["gamma", "task", "loss", "accuracy", "ratio", "ratio_low", "ratio_high", "accuracy_change",
           "change_low", "change_high"]


@dataclass(frozen=True, kw_only=True)
class SinkScaleSweep(Result):
    """Results of :func:`sink_scale_sweep`. ``frame``: one row per (γ, task): ``gamma``, ``task``
    (``text`` or ``repeat``), ``loss`` (mean next-token loss, nats), ``accuracy`` (top-1), ``ratio``
    (``exp`` of the loss change against γ = 1: the perplexity ratio) with ``ratio_low``/``ratio_high``,
    ``accuracy_change`` (against γ = 1) with ``change_low``/``change_high`` (paired 95% bootstrap
    intervals over sequences)."""

    frame: pd.DataFrame
    model_name: str
    source: str
    heads: str

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def helps(self) -> pd.DataFrame:
        """The rows where γ helps: a perplexity ratio interval below 1, or an accuracy change interval above 0."""
        f = self.frame[self.frame["gamma"] != 1.0]
        return f[(f["ratio_high"] < 1) | (f["change_low"] > 0)]

    def summary(self) -> str:
        lines = [f"{self.model_name}: attention to the first token scaled by γ ({self.heads}; {self.source})"]
        for task, g in self.frame.groupby("task", sort=False):
            what = "ordinary text" if task == "text" else "repeated random tokens (second run, top-1)"
            parts = [f"γ={r.gamma:g}: ppl x{r.ratio:.3g} [{r.ratio_low:.3g}, {r.ratio_high:.3g}], accuracy "
                     f"{r.accuracy:.3f} ({r.accuracy_change:+.3f} [{r.change_low:+.3f}, {r.change_high:+.3f}])"
                     for r in g.itertuples() if r.gamma != 1.0]
            base = g[g["gamma"] == 1.0].iloc[0]
            lines.append(f"  {what}, untouched accuracy {base.accuracy:.3f}: " + "; ".join(parts))
        helped = self.helps()
        if len(helped):
            lines.append("helps (interval excludes no change): " + "; ".join(
                f"γ={r.gamma:g} on {r.task}" for r in helped.itertuples()))
        else:
            lines.append("no γ helps: on both measures every interval includes no change or is worse")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Perplexity ratio and accuracy change against γ, per task, with intervals."""
        ax = ensure_axes(ax, (6, 4), layout=None)
        for task, g in self.frame.groupby("task", sort=False):
            g = g.sort_values("gamma")
            ax.plot(g["gamma"], g["ratio"], marker="o", label=f"{task}: perplexity ratio")
            ax.fill_between(g["gamma"], g["ratio_low"], g["ratio_high"], alpha=0.2)
            ax.plot(g["gamma"], 1 + g["accuracy_change"], marker="x", ls="--", label=f"{task}: 1 + accuracy change")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("γ (attention to the first token multiplied by)")
        ax.set_title(f"{self.model_name}: scaling the sink's attention")
        ax.legend(frameon=False, fontsize=8)
        return ax


def repeat_task(tokens: Tensor, repeat_len: int, n_seqs: int, seed: int = 0) -> Tensor:
    """``n_seqs`` sequences of the corpus's first token, ``repeat_len`` random tokens drawn from
    ``tokens``, and the same run again."""
    pool = tokens[:, 1:].flatten().unique()
    gen = torch.Generator().manual_seed(seed)
    runs = pool[torch.randint(len(pool), (n_seqs, repeat_len), generator=gen)]
    first = tokens[:1, :1].expand(n_seqs, 1)
    return torch.cat([first, runs, runs], 1)


def _measure(scorer: NextTokenLoss, tokens: Tensor, repeat: Tensor, repeat_len: int, hooks: list
             ) -> dict[str, tuple[Tensor, Tensor]]:
    """Per sequence: (loss, accuracy) on the text and on the repeated run's second half."""
    text = scorer(tokens, hooks=hooks)
    rep = scorer(repeat, hooks=hooks, top1=True, per_token=True)
    if not (text.finite and rep.finite):
        raise MassiveLensError("sink_scale_sweep: a logit was not finite under the edit; try a γ closer to 1")
    start = 1 + repeat_len + 1  # targets: the second run after its first token
    preds = slice(start - 1, repeat.shape[1] - 1)
    hit = (rep.top1[:, preds].cpu() == repeat[:, start:]).float()
    return {"text": (text.loss.cpu(), text.accuracy.cpu()),
            "repeat": (rep.token_loss[:, preds].cpu().mean(1), hit.mean(1))}


def sink_scale_sweep(model: Any, corpus: Any = None, *, gammas: Sequence[float] = GAMMAS,
                     heads: Sequence[tuple[int, int]] | None = None, seq_len: int = 128, n_seqs: int = 8,
                     repeat_len: int = 32, repeat_seqs: int = 8, seed: int = 0) -> SinkScaleSweep:
    """Perplexity and an in-context copying task with the attention to the first token scaled by
    each ``γ`` in ``gammas``, against γ = 1 on the same sequences (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        corpus: the text (a file, text, token tensor; None: the offline default text); also the
            pool of the repeat task's random tokens.
        gammas: the factors, each > 0 (γ = 1, the untouched model, is always measured).
        heads: ``(layer, head)`` pairs to scale (None: every head of every layer).
        seq_len: tokens per text sequence.
        n_seqs: text sequences.
        repeat_len: random tokens in each run of the repeat task (the sequence holds two runs).
        repeat_seqs: repeat-task sequences.
        seed: the repeat task's draw.

    Returns:
        A :class:`SinkScaleSweep`.

    Raises:
        MassiveLensError: for an empty ``gammas``, a ``γ <= 0``, ``repeat_len`` below 2, a head out of
            range, a logit that is not finite under the edit, or an unusable model or corpus.
    """
    gammas = sorted({float(g) for g in gammas} | {1.0})
    if len(gammas) < 2 or repeat_len < 2 or repeat_seqs < 1:
        raise MassiveLensError(f"sink_scale_sweep needs at least one γ other than 1, repeat_len >= 2 and "
                               f"repeat_seqs >= 1; got gammas={gammas}, repeat_len={repeat_len}, "
                               f"repeat_seqs={repeat_seqs}")
    view = ModelView(model)
    for g in gammas:
        gamma_per_head(view, g)  # every γ checked before the first pass
    tokens = sequences(view, default_text() if corpus is None else corpus, seq_len, n_seqs)
    repeat = repeat_task(tokens, repeat_len, repeat_seqs, seed)
    if view.n_ctx and repeat.shape[1] > view.n_ctx:
        raise MassiveLensError(f"the repeat task's {repeat.shape[1]} tokens exceed {view.name}'s context of "
                               f"{view.n_ctx}; give a smaller repeat_len")
    scorer = NextTokenLoss(model)

    def scaled(g: float) -> Any:
        return {(layer, head): g for layer, head in heads} if heads is not None else g

    runs = {g: _measure(scorer, tokens, repeat, repeat_len, [] if g == 1.0 else
                        as_hooks(scale_sink_attention(model, scaled(g)))) for g in gammas}
    rows = []
    for g in gammas:
        for task, (loss, acc) in runs[g].items():
            base_loss, base_acc = runs[1.0][task]
            low, high = bootstrap_mean(loss - base_loss)
            c_low, c_high = bootstrap_mean(acc - base_acc)
            rows.append(dict(gamma=g, task=task, loss=float(loss.mean()), accuracy=float(acc.mean()),
                             ratio=math.exp(float((loss - base_loss).mean())), ratio_low=math.exp(low),
                             ratio_high=math.exp(high), accuracy_change=float((acc - base_acc).mean()),
                             change_low=c_low, change_high=c_high))
    source = (f"{len(tokens)} text sequences of {tokens.shape[1]} tokens; {repeat_seqs} repeat sequences of "
              f"2 x {repeat_len} random tokens")
    return SinkScaleSweep(frame=pd.DataFrame(rows, columns=COLUMNS), model_name=view.name, source=source,
                          heads="every head" if heads is None else f"{len(heads)} heads")
