"""The next-token loss without a batch's logits: the output head is applied a few positions at a
time and each slice is reduced (loss, argmax) as soon as it is produced.

A batch's logits (``batch x pos x d_vocab``) are often the largest tensor of a pass: 0.4x of
SmolLM2's weights for eight 128-token sequences, 1x a 262k-vocabulary model's for one. Yet a
perplexity, a quantization gap or a top-1 agreement needs only each position's loss and argmax.
:class:`NextTokenLoss` stops the pass where the output head (the model's ``lm_head``) would run,
keeps its input (the final normalized residual, ``batch x pos x d_model``), and calls the head
on :func:`~massive_lens.core.budget.loss_positions` positions of one sequence at a time, through
the module (so hooks on it, e.g. a quantizer's, still apply).

Exactness is checked, never assumed: on the first few positions of the first sequence the head's
output must equal the model's logits (to float rounding). Where it does not (a final soft cap
or logit scale, a head that is not a module of its own, hooks after it), and for any call with
hooks on the head (``unembed``), the full logits are used instead, in passes of as many sequences
as keep them small (:func:`~massive_lens.core.budget.logit_batches`). Either way the reduction is
:func:`next_token_stats`'s, slice by slice.

>>> from massive_lens import tiny_model
>>> model = tiny_model("llama")
>>> tokens = torch.randint(0, 200, (2, 12))
>>> scorer = NextTokenLoss(model)
>>> out = scorer(tokens, top1=True)
>>> scorer.exact, tuple(out.loss.shape), tuple(out.top1.shape)
(True, (2,), (2, 12))
>>> torch.allclose(out.loss, next_token_stats(model(tokens), tokens)[0], rtol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from massive_lens.core.budget import logit_batches, loss_positions, trim_allocator
from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

__all__ = ["NextToken", "NextTokenLoss", "next_token_stats", "output_head"]

EXACT = {torch.float32: 1e-5, torch.float64: 1e-9}  # largest relative logit difference; 2e-2 in half precision
# positions of the first sequence the check runs: the head acts on each position alone, so a few
# show whether slices of it give the model's logits (the probe is one more forward of the call)
PROBE_POSITIONS = 4
SOFT_CAPS = ("final_logit_softcapping", "output_logits_soft_cap")  # config fields of a cap applied after the head


class NextToken(NamedTuple):
    """What :class:`NextTokenLoss` reads off each sequence's logits (never the logits)."""

    loss: Float[Tensor, " batch"]  # mean next-token loss (nats), float32
    accuracy: Float[Tensor, " batch"]  # share of positions whose argmax is the next token
    top1: Int[Tensor, "batch pos"] | None  # argmax at every position (with top1=True)
    token_loss: Float[Tensor, "batch pos_1"] | None  # each prediction's loss (with per_token=True)
    finite: bool  # every logit computed was finite


class _Stop(Exception):
    """Raised by the head's pre-hook: the rest of the pass (the logits) is not wanted."""


def output_head(model: Any) -> nn.Module | None:
    """The module that turns the final residual into logits, or None: a bridge's Hugging Face
    ``lm_head`` (an ``nn.Linear``, unwrapped), else a HookedTransformer's ``unembed``.

    >>> from massive_lens import tiny_model
    >>> type(output_head(tiny_model("gpt2"))).__name__
    'Linear'
    """
    inner = getattr(model, "original_model", None)
    if inner is not None:
        head = getattr(inner, "get_output_embeddings", lambda: None)()
        head = getattr(head, "original_component", head)
        return head if isinstance(head, nn.Linear) else None
    head = getattr(model, "unembed", None)
    return head if isinstance(head, nn.Module) and not hasattr(head, "original_component") else None


def _soft_capped(model: Any) -> bool:
    configs = (getattr(model, "cfg", None), getattr(getattr(model, "original_model", None), "config", None))
    return any(isinstance(v, (int, float)) and v > 0 for c in configs for v in (getattr(c, f, None) for f in SOFT_CAPS))


def _reduce(logits_of: Callable[[int, int], Tensor], ids: Tensor, step: int, top1: bool, per_token: bool
            ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor]:
    """One sequence: ``logits_of(a, b)`` gives positions ``a:b``'s logits; ``ids`` the tokens."""
    n = len(ids)
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    hits = torch.zeros((), device=ids.device)
    finite = torch.ones((), dtype=torch.bool, device=ids.device)
    tops, losses = [], []
    for a in range(0, n if top1 else n - 1, step):
        logits = logits_of(a, min(a + step, n if top1 else n - 1))
        k = min(len(logits), n - 1 - a)  # positions of the slice that have a next token
        arg = logits.argmax(-1)
        finite &= torch.isfinite(logits).all()
        if k > 0:
            target = ids[a + 1: a + 1 + k]
            loss = torch.nn.functional.cross_entropy(logits[:k].float(), target, reduction="none")
            total += loss.sum()
            hits += (arg[:k] == target).sum()
            if per_token:
                losses.append(loss)
        if top1:
            tops.append(arg)
        del logits
    return (total / (n - 1), hits / (n - 1), torch.cat(tops) if top1 else None,
            torch.cat(losses) if per_token else None, finite)


def _stack(rows: list[tuple], top1: bool, per_token: bool) -> NextToken:
    loss, acc, tops, losses, finite = zip(*rows, strict=True)
    return NextToken(torch.stack(loss).cpu(), torch.stack(acc).float().cpu(),
                     torch.stack(tops).cpu() if top1 else None, torch.stack(losses).cpu() if per_token else None,
                     bool(torch.stack(finite).all()))


def _stats(logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], top1: bool = False,
           per_token: bool = False) -> NextToken:
    tokens = tokens.to(logits.device)
    step = loss_positions(logits.shape[-1])
    return _stack([_reduce(lambda a, b, row=row: row[a:b], ids, step, top1, per_token)
                   for row, ids in zip(logits, tokens, strict=True)], top1, per_token)


def next_token_stats(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, " batch"], Float[Tensor, " batch"]]:
    """Each sequence's mean next-token loss and accuracy from its logits, one sequence (and a few
    positions of it, :func:`~massive_lens.core.budget.loss_positions`) at a time, each chunk cast
    to float32 on its own, so the loss never copies the batch's logits, nor a sequence's.

    Args:
        logits: the model's logits.
        tokens: the tokens they were computed on (position ``p`` predicts ``p + 1``).

    Returns:
        ``(loss, accuracy)``, each ``[batch]`` float32 on the CPU.

    >>> logits = torch.zeros(1, 3, 5)
    >>> loss, acc = next_token_stats(logits, torch.tensor([[0, 0, 1]]))
    >>> round(float(loss), 4), float(acc)  # uniform over 5 tokens; argmax 0 is right once
    (1.6094, 0.5)
    """
    out = _stats(logits, tokens)
    return out.loss, out.accuracy


class NextTokenLoss:
    """Next-token statistics of ``model`` on tokens, computed slice by slice at the output head
    when that is exact (see the module docstring), else from the full logits.

    ``model`` is a model or its :class:`~massive_lens.core.model_view.ModelView`;
    ``forward(x, hooks)`` runs it on tokens ``x`` with hooks and returns the logits
    (default: :meth:`ModelView.forward <massive_lens.core.model_view.ModelView.forward>` with no
    finiteness check). Which path is taken is decided once, by :meth:`check`, on the first tokens
    seen, with no hooks of the call attached; ``exact`` then says it (False: full logits).
    """

    def __init__(self, model: Any, forward: Callable[[Tensor, Sequence[Any]], Any] | None = None) -> None:
        view = model if isinstance(model, ModelView) else None
        self.model = model = view.model if view is not None else model
        self.head = output_head(model)
        if forward is None:
            view = view or ModelView(model)
            forward = lambda x, hooks: view.forward(view.full_batch(x), list(hooks), check_finite=False)  # noqa: E731
        self.forward = forward
        self.exact: bool | None = None  # None until check()
        self._head_hooks: list[str] | None = None

    @torch.no_grad()
    def check(self, tokens: Int[Tensor, "batch pos"]) -> bool:
        """Decide (once) whether the head, applied slice by slice, gives the model's logits: on
        the first sequence's first :data:`PROBE_POSITIONS` positions, in one pass that records the head's input.
        False (full logits from then on) for a final soft cap in the config, a head that is not
        found or never runs, or logits that differ (a logit scale, a hook after the head)."""
        if self.exact is not None:
            return self.exact
        with model_lock(self.model):
            self.exact = self._exact(tokens)
        return self.exact

    def _exact(self, tokens: Tensor) -> bool:
        if self.head is None or _soft_capped(self.model):
            return False
        x = tokens[:1, :PROBE_POSITIONS]
        grabbed: list[Tensor] = []
        handle = self.head.register_forward_pre_hook(
            lambda m, args: grabbed.append(args[0].detach()) if args else None, prepend=True)
        try:
            full = self.forward(x, ())
        finally:
            handle.remove()
        if len(grabbed) != 1 or not isinstance(full, Tensor) or grabbed[0].shape[:-1] != full.shape[:-1]:
            return False
        n = x.shape[1]
        step = max(1, min(self.step, n // 2))  # two slices or more: the head applied slice by slice
        try:
            chunked = torch.cat([self.logits(grabbed[0][0], a, min(a + step, n)) for a in range(0, n, step)])
        except Exception:  # the head does not run on its own input: keep full logits
            return False
        tol = EXACT.get(grabbed[0].dtype, 2e-2)
        full = full[0].float()
        scale = full.abs().max().clamp(min=1e-12)
        return bool(torch.isfinite(full).all()) and chunked.shape == full.shape and \
            bool((chunked.float() - full).abs().max() <= tol * scale)

    def batches(self, tokens: Int[Tensor, "batch pos"], batch_size: int | None = None) -> list[Tensor]:
        """``tokens`` in passes of ``batch_size`` sequences; None: sized as if each pass held its
        logits (:func:`~massive_lens.core.budget.logit_batches`), so that a pass's activations, which
        the slicing does not shrink, stay as small as before (eight 128-token sequences in one pass
        raised the default model's report from 1.40x to 1.49x its weights)."""
        return logit_batches(self.model, tokens, batch_size)

    @torch.no_grad()
    def __call__(self, x: Tensor, targets: Int[Tensor, "batch pos"] | None = None, start: int = 0,
                 hooks: Sequence[Any] = (), *, top1: bool = False, per_token: bool = False) -> NextToken:
        """Statistics of the model's logits on ``x`` (from position ``start`` on) against
        ``targets`` (default ``x``; position ``p`` predicts ``targets[:, p + 1]``), with ``hooks``
        attached; ``top1``: also each position's argmax, ``per_token``: each prediction's loss."""
        targets = x if targets is None else targets
        with model_lock(self.model):
            return self._stats(x, targets, start, hooks, top1, per_token)

    def _stats(self, x: Tensor, targets: Tensor, start: int, hooks: Sequence[Any], top1: bool, per_token: bool
               ) -> NextToken:
        self.check(x)
        if not self.exact or self._hooks_at_head(hooks):
            logits = self.forward(x, hooks)[:, start:]
            out = _stats(logits, targets, top1, per_token)
            del logits
            trim_allocator()
            return out
        h = self.hidden(x, hooks)
        if h is None:  # the pass ended before the head: nothing to unembed
            raise MassiveLensError(f"{type(self.model).__name__}: the pass ended before the output head ran, so no "
                                   "loss can be read; remove the hook that stops it")
        h = h[:, start:]
        targets = targets.to(h.device)
        step = self.step
        rows = [_reduce(lambda a, b, row=row: self.logits(row, a, b), ids, step, top1, per_token)
                for row, ids in zip(h, targets, strict=True)]
        del h
        trim_allocator()
        return _stack(rows, top1, per_token)

    @property
    def step(self) -> int:
        """Positions the head runs on at a time (:func:`~massive_lens.core.budget.loss_positions`)."""
        return loss_positions(int(getattr(self.model.cfg, "d_vocab", 0) or getattr(self.head, "out_features", 0) or 1))

    @torch.no_grad()
    def logits(self, row: Tensor, a: int, b: int) -> Tensor:
        """The head on positions ``a:b`` of ``row``, one sequence's head input (an ``nn.Linear``
        is called on the rows, a HookedTransformer's ``unembed`` with a batch dimension)."""
        if isinstance(self.head, nn.Linear):
            return self.head(row[a:b])
        return self.head(row[None, a:b])[0]

    def _hooks_at_head(self, hooks: Sequence[Any]) -> bool:
        """Whether a hook of the call is on the head (it would not run on the slices)."""
        if not hooks:
            return False
        if self._head_hooks is None:
            self._head_hooks = [n for n in getattr(self.model, "hook_dict", {}) if "unembed" in n]
        return any("unembed" in name if isinstance(name, str) else any(name(n) for n in self._head_hooks)
                   for name, _ in hooks)

    @torch.no_grad()
    def hidden(self, x: Tensor, hooks: Sequence[Any] = ()) -> Tensor | None:
        """The head's input for tokens ``x`` (the pass stops there), or None if it never ran."""
        grabbed: list[Tensor] = []

        def grab(module: Any, args: tuple) -> None:
            if args:
                grabbed.append(args[0].detach())
                raise _Stop

        with model_lock(self.model):
            handle = self.head.register_forward_pre_hook(grab, prepend=True)  # before any quantizer's hook
            try:
                self.forward(x, hooks)
            except _Stop:
                pass
            finally:
                handle.remove()
        return grabbed[0] if grabbed else None
