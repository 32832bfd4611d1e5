"""Perplexity as the judge of an intervention, with bootstrap intervals.

Sun et al. (2024) test what massive activations *do* by editing them and watching
WikiText perplexity: zeroing the few massive activations destroys the model, setting them to
their mean changes nothing. The same yardstick judges every hypothesis in
:mod:`massive_lens.interventions`.

- :func:`perplexity`: per-sequence loss, perplexity and next-token accuracy of a model on a
  corpus, optionally with forward hooks (an intervention) attached. Batched; no pass holds
  its logits (the head runs a few positions at a time, :mod:`massive_lens.core.loss`), or,
  where that is not exact (a final soft cap), one small batch's.
- :func:`bootstrap_mean`: a 95% bootstrap interval of a mean over sequences (paired
  comparisons resample the per-sequence difference), defined in :mod:`massive_lens.core.stats`.

>>> from massive_lens import tiny_model
>>> ppl = perplexity(tiny_model("llama"), "a b c d e f g h " * 40, seq_len=16, n_seqs=4, progress=False)
>>> len(ppl.per_seq), ppl.perplexity > 1
(4, True)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.core.charts import loss_axes
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError

__all__ = ["Perplexity", "as_hooks", "bootstrap_mean", "perplexity"]


def _exp(loss: float) -> float:
    """``exp(loss)``, ``inf`` past float64's range (a model can be that wrong under an edit)."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


@dataclass(frozen=True, kw_only=True)
class Perplexity(Result):
    """Per-sequence mean next-token loss (nats) and accuracy; every sequence has the same
    length, so the corpus perplexity is ``exp(mean loss)``. ``to_frame()`` columns:
    ``seq``, ``loss``, ``perplexity``, ``accuracy``."""

    per_seq: Float[Tensor, " seq"]
    accuracy_per_seq: Float[Tensor, " seq"]
    n_tokens: int
    model_name: str

    @property
    def loss(self) -> float:
        return float(self.per_seq.mean())

    @property
    def perplexity(self) -> float:
        return _exp(self.loss)

    @property
    def accuracy(self) -> float:
        return float(self.accuracy_per_seq.mean())

    @property
    def ci(self) -> tuple[float, float]:
        """95% bootstrap interval of the perplexity over sequences."""
        low, high = bootstrap_mean(self.per_seq)
        return _exp(low), _exp(high)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "seq": range(len(self.per_seq)),
            "loss": self.per_seq.tolist(),
            "perplexity": self.per_seq.exp().tolist(),
            "accuracy": self.accuracy_per_seq.tolist(),
        })

    def summary(self) -> str:
        low, high = self.ci
        return (f"{self.model_name}: perplexity {self.perplexity:.3f} (95% CI {low:.3f}-{high:.3f}) "
                f"over {len(self.per_seq)} sequences / {self.n_tokens} predicted tokens; "
                f"next-token accuracy {self.accuracy:.1%}")

    def plot(self, ax: Any = None) -> Any:
        """Each sequence's loss (nats), sorted, with the mean and its 95% interval."""
        low, high = bootstrap_mean(self.per_seq)
        return loss_axes(self.to_frame(), self.loss, (low, high), ax=ax,
                         title=f"{self.model_name}: per-sequence loss")


def as_hooks(hooks: Any) -> list[tuple[str, Any]]:
    """Accept a hook list or any object with ``fwd_hooks`` (an intervention, refused while it
    is active in a ``with`` block: its hooks are attached already and would fire twice)."""
    if getattr(hooks, "active", False) is True:
        raise MassiveLensError(
            f"{getattr(hooks, 'label', hooks)} is active (inside its with block), so its hooks are on the model "
            "already; passing it as hooks= too would apply its edit twice. Pass it in one place only"
        )
    hooks = getattr(hooks, "fwd_hooks", hooks)
    hooks = hooks() if callable(hooks) else hooks
    if hooks is None:  # no hooks, as hooks=() says
        return []
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Iterable):
        raise MassiveLensError(f"hooks must be a list of (hook_name, function) pairs, an intervention or None, got "
                               f"{type(hooks).__name__} {hooks!r:.60}")
    hooks = list(hooks)
    for item in hooks:
        if not (isinstance(item, tuple) and len(item) == 2 and callable(item[1])):
            raise MassiveLensError(
                f"hooks must be (hook_name, function) pairs or an intervention, got {item!r}"
            )
    return hooks


def _overflow(view: ModelView, edit: Any = None) -> MassiveLensError:
    """The error for NaN or inf logits: the model overflowed, with ``edit`` attached (hooks or an
    intervention) or with none passed (its own precision, or an edit left on the model)."""
    if edit is not None:
        label = getattr(edit, "label", None) or f"{len(as_hooks(edit))} hook(s)"
        return MassiveLensError(
            f"{view.name} ({view.dtype}) gives NaN or inf logits with the edit attached ({label}): the edit drives "
            "the model out of its number range, and a loss of non-finite logits measures nothing. Use a milder "
            "setting of the edit (a scale further from 0, a smaller ablation), or float32 if the model is in half "
            "precision")
    return MassiveLensError(
        f"{view.name} ({view.dtype}) gives NaN or inf logits with no edit passed: it overflowed. Load it with "
        "dtype=torch.float32 (or torch.bfloat16, which has float32's range); if an edit is on the model (a with "
        "block, hooks left attached), it is the edit: use a milder setting")


def perplexity(
    model: Any,
    corpus: Corpus | Tensor = None,
    *,
    seq_len: int = 128,
    n_seqs: int = 32,
    batch_size: int | None = None,
    hooks: Any = (),
    progress: bool = True,
) -> Perplexity:
    """Perplexity and next-token accuracy of ``model`` on ``corpus``, with ``hooks`` attached
    during every forward pass.

    Args:
        model: a TransformerLens-style model.
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor
            (evaluated as is), or None for the offline default text.
        seq_len: tokens per sequence (BOS included; default 128), for text input.
        n_seqs: sequences evaluated (the first ``n_seqs`` of the corpus; default 32), for
            text input.
        batch_size: sequences per forward pass (default None: up to 8, as many as keep one
            pass's logits small against the weights, see
            :func:`~massive_lens.core.budget.logit_batches`, whether or not the pass holds them).
        hooks: ``(hook_name, function)`` pairs, an
            :class:`~massive_lens.interventions.Intervention`, or any object with
            ``fwd_hooks``; attached during every forward pass (default: none).
        progress: show a progress bar.

    Returns:
        A :class:`Perplexity` with per-sequence loss and accuracy.

    Raises:
        MassiveLensError: if the logits are NaN or inf, with or without ``hooks`` (the model
            overflowed: no perplexity is measured), if ``hooks`` are not ``(name, function)`` pairs,
            a token tensor is not ``[seq, pos]`` with ``pos >= 2``, ``batch_size``, ``n_seqs`` or ``seq_len`` is
            out of range, or the corpus is too short for one sequence.

    >>> from massive_lens import tiny_model
    >>> model = tiny_model("gpt2")
    >>> a = perplexity(model, "some text here " * 30, seq_len=16, n_seqs=2, progress=False)
    >>> b = perplexity(model, "some text here " * 30, seq_len=16, n_seqs=2, progress=False,
    ...                hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 0)])
    >>> b.loss != a.loss
    True
    """
    view = ModelView(model)
    fwd_hooks = as_hooks(hooks)
    tokens = sequences(view, corpus, seq_len, n_seqs)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise MassiveLensError(f"token tensor must be [seq, pos] with pos >= 2, got {tuple(tokens.shape)}")
    if batch_size is not None and batch_size < 1:
        raise MassiveLensError(f"batch_size must be >= 1, got {batch_size}")
    scorer = NextTokenLoss(view)  # no finiteness check in the pass: an edit may yield inf
    losses, accs = [], []
    for chunk in tqdm(scorer.batches(tokens, batch_size), desc="perplexity", disable=not progress, leave=False):
        out = scorer(chunk, hooks=fwd_hooks)
        if not out.finite:  # NaN propagates: no loss of these logits is a measurement
            raise _overflow(view, hooks if fwd_hooks else None)
        losses.append(out.loss)
        accs.append(out.accuracy)
    per_seq = torch.cat(losses)
    return Perplexity(per_seq=per_seq, accuracy_per_seq=torch.cat(accs),
                      n_tokens=int(tokens.shape[0] * (tokens.shape[1] - 1)), model_name=view.name)

