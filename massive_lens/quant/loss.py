"""Each sequence's next-token loss without the batch's logits: the unembedding is applied a few
positions at a time and each slice is reduced to its loss as it is produced.

A pass is stopped where the output embedding (the model's ``lm_head``, an ``nn.Linear``) would
run; its input, the final normalized residual stream (``batch x pos x d_model``), is kept, and
the head is then called on 32 positions of one sequence at a time (through the module, so a
quantized head's hooks still apply). The largest tensor is a slice's logits (32 x d_vocab), not
the batch's (batch x pos x d_vocab, 0.4x of SmolLM2's weights for eight 128-token sequences).

A model whose logits are more than its head's output (a soft cap, a logit scale, a head that
is not an ``nn.Linear``) is found out on the first sequence: the chunked losses must equal the
full pass's, or the full logits are used, in passes of one or a few sequences
(:func:`~massive_lens.core.budget.logit_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from massive_lens.core.budget import trim_allocator
from massive_lens.metrics import next_token_stats

CHUNK = 32  # positions a slice of logits holds


class _Stop(Exception):
    """Raised by the head's pre-hook: the rest of the pass (the logits) is not wanted."""


def output_head(model: Any) -> nn.Linear | None:
    """The model's output embedding when it is an ``nn.Linear`` (a bridge's wrapper unwrapped; None otherwise)."""
    head = getattr(getattr(model, "original_model", model), "get_output_embeddings", lambda: None)()
    head = getattr(head, "original_component", head)
    return head if isinstance(head, nn.Linear) else None


class ChunkedLoss:
    """Per-sequence losses of ``forward(x, hooks)`` (a function that runs the model on tokens
    ``x``), computed slice by slice at the head; :meth:`check` decides once whether that is exact."""

    def __init__(self, model: Any, forward: Callable[[Tensor, Sequence[Any]], Any]) -> None:
        self.head, self.forward = output_head(model), forward
        self.exact = False  # set by check()
        self._inside = False

    def hidden(self, x: Tensor, hooks: Sequence[Any] = ()) -> Tensor | None:
        """The head's input for tokens ``x`` (the pass stops there), or None if it never ran."""
        grabbed: list[Tensor] = []

        def grab(module: Any, args: tuple) -> None:
            if not self._inside:
                grabbed.append(args[0].detach())
                raise _Stop

        handle = self.head.register_forward_pre_hook(grab, prepend=True)  # before any quantizer's hook
        try:
            self.forward(x, hooks)
        except _Stop:
            pass
        finally:
            handle.remove()
        return grabbed[0] if grabbed else None

    def losses(self, x: Tensor, targets: Tensor, start: int = 0, hooks: Sequence[Any] = ()) -> Tensor:
        """Mean next-token loss of each sequence; ``targets`` are the tokens the positions from
        ``start`` on predict (as :func:`~massive_lens.metrics.next_token_stats` reads them)."""
        if not self.exact:
            logits = self.forward(x, hooks)[:, start:]
            out = next_token_stats(logits, targets.to(logits.device))[0].cpu()
            del logits
            trim_allocator()
            return out
        h = self.hidden(x, hooks)[:, start:]
        out = []
        self._inside = True
        try:
            with torch.no_grad():
                for row, ids in zip(h, targets.to(h.device), strict=True):
                    pred, target = row[:-1], ids[1:]
                    total = sum(torch.nn.functional.cross_entropy(self.head(p).float(), t, reduction="sum")
                                for p, t in zip(pred.split(CHUNK), target.split(CHUNK), strict=True))
                    out.append(total / len(target))
        finally:
            self._inside = False
        del h
        trim_allocator()
        return torch.stack(out).cpu()

    def check(self, x: Tensor, logits: Tensor) -> None:
        """Use the chunked path from here on if it gives the losses of ``logits``, the model's
        full logits on tokens ``x`` (to 1e-5 relative)."""
        full = next_token_stats(logits, x.to(logits.device))[0].cpu()
        if self.head is not None:
            self.exact = True
            try:
                chunked = self.losses(x, x)
            except Exception:  # the head never ran on its own, or not on the stream: keep full logits
                chunked = None
            self.exact = chunked is not None and bool(torch.allclose(chunked, full, rtol=1e-5, atol=1e-6))
