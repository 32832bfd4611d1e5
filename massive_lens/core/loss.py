"""The next-token loss without a batch's logits: the output head is applied a few positions at a
time and each slice is reduced (loss, argmax) as soon as it is produced.

A batch's logits (``batch x pos x d_vocab``) are often the largest tensor of a pass: 0.4x of
SmolLM2's weights for eight 128-token sequences, 1x a 262k-vocabulary model's for one. Yet a
perplexity, a quantization gap or a top-1 agreement needs only each position's loss and argmax.
:class:`NextTokenLoss` stops the pass where the output head (the model's ``lm_head``) would run,
keeps its input (the final normalized residual, ``batch x pos x d_model``), and calls the head
on :func:`head_positions` positions of one sequence at a time, through the module (so hooks on
it, e.g. a quantizer's, still apply).

Exactness is checked, never assumed: on the first few positions of the first sequence the head's
output must equal the model's logits (to float rounding). The first call checks it in its own
forward: past the head only those positions run, and their logits, the model's own, are compared
with the head's on the first slice. Where they differ (a final soft cap or logit scale, a head
that is not a module of its own, hooks after it), and for any call with hooks on the head
(``unembed``), the full logits are used instead, in passes of as many sequences as keep them
small (:func:`~massive_lens.core.budget.logit_batches`). Either way the reduction is
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
from functools import partial
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from massive_lens.core.budget import LOGITS_SHARE, logit_batches, loss_positions, trim_allocator, weight_bytes
from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

__all__ = ["NextToken", "NextTokenLoss", "next_token_stats", "output_head"]

EXACT = {torch.float32: 1e-5, torch.float64: 1e-9}  # largest relative logit difference; 2e-2 in half precision
# positions of the first sequence the check compares: the head acts on each position alone, so a few
# show whether slices of it give the model's logits (in the call's own forward, only these run past the head)
PROBE_POSITIONS = 4
# positions the head runs on at a time where the memory budget allows: each call reads the head's whole matrix,
# so 32-position slices cost SmolLM2 1.34x the head (and loss) of a 256-token batch in one call, 128-position
# ones 1.01x (one thread); more gain nothing
HEAD_POSITIONS = 128
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


def head_positions(d_vocab: int, weights: int) -> int:
    """Positions of one sequence the output head runs on at a time: up to :data:`HEAD_POSITIONS`
    where their float32 logits stay under ``LOGITS_SHARE`` of the weights' bytes (``weights``;
    :func:`~massive_lens.core.budget.logit_batches`' budget), never fewer than
    :func:`~massive_lens.core.budget.loss_positions`.

    >>> head_positions(49_152, 538 * 2**20), head_positions(262_144, 128 * 2**20)  # SmolLM2; 262k on width 64
    (128, 8)
    """
    per_position = 4 * max(int(d_vocab), 1)
    return max(loss_positions(d_vocab), min(HEAD_POSITIONS, int(weights * LOGITS_SHARE) // per_position))


def _finite(logits: Tensor) -> Tensor:
    """Whether every entry is finite (0-dim bool): the smallest and largest entries are, as NaN
    propagates through both (one pass over the entries, a tenth of ``isfinite(...).all()``'s time)."""
    low, high = torch.aminmax(logits)
    return torch.isfinite(low) & torch.isfinite(high)


def _agrees(mine: Tensor, full: Tensor) -> bool:
    """Whether the head's own logits ``mine`` are the model's ``full`` ones (``[pos, d_vocab]``) to
    float rounding (:data:`EXACT`, relative to the largest); False where the model's are not finite."""
    tol = EXACT.get(mine.dtype, 2e-2)
    full = full.float()
    scale = full.abs().max().clamp(min=1e-12)
    return bool(torch.isfinite(full).all()) and mine.shape == full.shape and \
        bool((mine.float() - full).abs().max() <= tol * scale)


def _argmax(logits: Float[Tensor, "pos d_vocab"]) -> Int[Tensor, " pos"]:
    """``logits.argmax(-1)``, by NumPy for float32 and float64 on the CPU (a seventeenth of torch's time
    there on one thread: 1.0 against 17 ms for 128 x 49,152), with the same answer: the first maximum,
    or the first NaN.

    >>> _argmax(torch.tensor([[1.0, 3.0, 3.0], [0.0, float("nan"), 1.0]])).tolist()
    [1, 1]
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    return logits.argmax(-1)


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
        arg = _argmax(logits).to(ids.device)
        finite &= _finite(logits)
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
    finiteness check). Which path is taken is decided once, on the first tokens seen: by the
    first call, in its own forward (see the module docstring), or before any call by
    :meth:`check`, in a forward of its own with no hooks; ``exact`` then says it (False: full
    logits).
    """

    def __init__(self, model: Any, forward: Callable[[Tensor, Sequence[Any]], Any] | None = None) -> None:
        view = model if isinstance(model, ModelView) else None
        self.model = model = view.model if view is not None else model
        self.head = output_head(model)
        if forward is None:
            view = view or ModelView(model)
            forward = lambda x, hooks: view.forward(view.full_batch(x), list(hooks), check_finite=False)  # noqa: E731
        self.forward = forward
        self.exact: bool | None = None  # None until the first call or check()
        self._head_hooks: list[str] | None = None
        self._step: int | None = None

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
        try:
            return _agrees(self._sliced(grabbed[0][0], x.shape[1]), full[0])
        except Exception:  # the head does not run on its own input: keep full logits
            return False

    def _sliced(self, row: Tensor, n: int) -> Tensor:
        """The head on positions ``:n`` of ``row`` in two slices or more (one where ``n`` is 1)."""
        step = max(1, min(self.step, n // 2))
        return torch.cat([self.logits(row, a, min(a + step, n)) for a in range(0, n, step)])

    def batches(self, tokens: Int[Tensor, "batch pos"], batch_size: int | None = None) -> list[Tensor]:
        """``tokens`` in passes of ``batch_size`` sequences; None: sized as if each pass held its
        logits (:func:`~massive_lens.core.budget.logit_batches`), so that a pass's activations, which
        the slicing does not shrink, stay as small as before (eight 128-token sequences in one pass
        raised the default model's report from 1.40x to 1.49x its weights)."""
        return logit_batches(self.model, tokens, batch_size)

    @torch.no_grad()
    def __call__(self, x: Tensor, targets: Int[Tensor, "batch pos"] | None = None, start: int = 0,
                 hooks: Sequence[Any] = (), *, top1: bool = False, per_token: bool = False, once: bool = False
                 ) -> NextToken | None:
        """Statistics of the model's logits on ``x`` (from position ``start`` on) against
        ``targets`` (default ``x``; position ``p`` predicts ``targets[:, p + 1]``), with ``hooks``
        attached; ``top1``: also each position's argmax, ``per_token``: each prediction's loss.
        ``once``: the hooks read the forward and must see one only: where the first call's check
        finds the slices inexact, None (``exact`` is then False; call again) instead of a second
        forward for the full logits."""
        targets = x if targets is None else targets
        with model_lock(self.model):
            return self._stats(x, targets, start, hooks, top1, per_token, once)

    def _stats(self, x: Tensor, targets: Tensor, start: int, hooks: Sequence[Any], top1: bool, per_token: bool,
               once: bool) -> NextToken | None:
        at_head = self._hooks_at_head(hooks)
        if self.exact is None and (at_head or self.head is None or _soft_capped(self.model) or x.shape[1] <= start):
            self.check(x)  # no check in this forward (or none needed)
        if self.exact is False or at_head:
            return self._full(x, targets, start, hooks, top1, per_token)
        h, probe = self._to_head(x, hooks, start, probe=self.exact is None)
        if h is None:  # the pass ended before the head: nothing to unembed
            raise MassiveLensError(f"{type(self.model).__name__}: the pass ended before the output head ran, so no "
                                   "loss can be read; remove the hook that stops it")
        h = h[:, start:]
        targets = targets.to(h.device)
        step, checking = self.step, self.exact is None
        try:
            rows = [_reduce(partial(self._first, probe, row) if i == 0 and checking else partial(self.logits, row),
                            ids, step, top1, per_token) for i, (row, ids) in enumerate(zip(h, targets, strict=True))]
            if self.exact is None:  # no slice ran (a one-token sequence without top1): the check on its own
                self._first(probe, h[0], 0, 1)
        except Exception:
            if not checking:
                raise
            self.exact = False  # the head does not run on its own input: full logits
        del h
        trim_allocator()
        if self.exact:
            return _stack(rows, top1, per_token)
        return None if once else self._full(x, targets, start, hooks, top1, per_token)

    def _first(self, probe: Tensor | None, row: Tensor, a: int, b: int) -> Tensor:
        """The head on positions ``a:b`` of the first sequence's ``row``; on its first slice the check
        against ``probe``, the model's logits of its first positions (None: the pass did not give them)."""
        out = self.logits(row, a, b)
        if self.exact is None:
            k = len(probe) if probe is not None else 0
            # the model's logits came from the head on k positions: compared with a slice of more of them, or,
            # where the slice is no longer, with the head on them in two slices or more
            mine = out[:k] if len(out) > k else self._sliced(row, k) if k else None
            self.exact = mine is not None and _agrees(mine, probe)
        return out

    def _full(self, x: Tensor, targets: Tensor, start: int, hooks: Sequence[Any], top1: bool, per_token: bool
              ) -> NextToken:
        """From the model's full logits, in one forward."""
        logits = self.forward(x, hooks)[:, start:]
        out = _stats(logits, targets, top1, per_token)
        del logits
        trim_allocator()
        return out

    @property
    def may_slice(self) -> bool:
        """Whether the head may run slice by slice (no full logits): False once a check found it inexact, and,
        before any, for a model without a head of its own or with a final soft cap (:meth:`check`'s early
        answers, no forward run)."""
        if self.exact is not None:
            return self.exact
        return self.head is not None and not _soft_capped(self.model)

    @property
    def step(self) -> int:
        """Positions the head runs on at a time (:func:`head_positions`, for the weights as first asked)."""
        if self._step is None:
            vocab = int(getattr(self.model.cfg, "d_vocab", 0) or getattr(self.head, "out_features", 0) or 1)
            self._step = head_positions(vocab, weight_bytes(self.model))
        return self._step

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
        return self._to_head(x, hooks)[0]

    def _to_head(self, x: Tensor, hooks: Sequence[Any], start: int = 0, probe: bool = False
                 ) -> tuple[Tensor | None, Tensor | None]:
        """The head's input for tokens ``x`` (None if the head never ran) and, with ``probe``, the model's
        logits of the first sequence's :data:`PROBE_POSITIONS` positions from ``start``: past the head the
        pass goes on for those only (None where it did not give them, one per position)."""
        grabbed: list[Tensor] = []

        def grab(module: Any, args: tuple) -> tuple | None:
            if not args:
                return None
            grabbed.append(args[0].detach())
            if probe and len(grabbed) == 1 and args[0].ndim == 3:
                return (args[0][:1, start:start + PROBE_POSITIONS], *args[1:])
            raise _Stop

        out = None
        with model_lock(self.model):
            handle = self.head.register_forward_pre_hook(grab, prepend=True)  # before any quantizer's hook
            try:
                out = self.forward(x, hooks)
            except _Stop:
                pass
            finally:
                handle.remove()
        h = grabbed[0] if grabbed else None
        k = min(PROBE_POSITIONS, h.shape[1] - start) if h is not None and h.ndim == 3 else 0
        ok = probe and len(grabbed) == 1 and isinstance(out, Tensor) and out.ndim == 3 and out.shape[:2] == (1, k)
        return h, out[0] if ok else None
