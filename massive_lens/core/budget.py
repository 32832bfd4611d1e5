"""Memory budgets: the size of a model's weights, and batches that keep each forward pass's
largest tensor (the logits, ``batch x pos x d_vocab``) under a fixed share of it.

An analysis that scores text holds the model plus one pass's logits and their loss; sized by
:func:`logit_batches`, that stays a small fraction of the weights on any model: one
128-token sequence a pass on a 135M model with a 49k vocabulary, four on a 1.5B one with a
152k vocabulary.

>>> lin = torch.nn.Linear(4, 2)
>>> weight_bytes(lin)  # 4 * 2 weights and 2 biases in float32
40
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch
from jaxtyping import Int

_LIBC: Any = None
LOGITS_SHARE = 0.05  # one pass's logits stay under this share of the weights' bytes
MAX_BATCH = 8  # sequences a pass when the logits budget allows more
LOSS_CHUNK_BYTES = 8 * 2**20  # the float32 log-probabilities one step of a loss may hold
# a layer's activation ([batch, pos, width] float32) from which a pass hands the freed transients back every few
# layers (:class:`LayerTrim`); below it never (each trim costs the next layer's page faults, and small transients
# are reused)
TRIM_BYTES = 2 << 20


def each_module(*trees: torch.nn.Module | None) -> list[torch.nn.Module]:
    """Every module under ``trees``, each once, in ``Module.modules()``'s order (a plain walk of
    ``_modules``: several times faster on a bridge's thousands of modules)."""
    seen: set[int] = set()
    stack, out = list(reversed(trees)), []
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        stack.extend(reversed(module._modules.values()))
    return out


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers (each tensor once, tied weights too)."""
    seen, total = set(), 0
    if isinstance(model, torch.nn.Module):
        modules = each_module(model)
        tensors = (t for kind in ("_parameters", "_buffers") for m in modules for t in getattr(m, kind).values())
    else:  # a wrapper (an nnsight model): its own parameters() and buffers()
        tensors = (*model.parameters(), *model.buffers())
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta" or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def logit_batches(
    model: Any, tokens: Int[torch.Tensor, "batch pos"], batch_size: int | None = None
) -> list[torch.Tensor]:
    """``tokens`` split into batches of ``batch_size`` sequences; None: of as many (1 to
    ``MAX_BATCH``) as keep one pass's float32 logits under ``LOGITS_SHARE`` of the weights.

    >>> from massive_lens import tiny_model
    >>> model, tokens = tiny_model("llama"), torch.zeros(5, 8, dtype=torch.long)
    >>> [len(b) for b in logit_batches(model, tokens, batch_size=2)]
    [2, 2, 1]
    """
    if batch_size is None:
        per_seq = tokens.shape[1] * int(getattr(model.cfg, "d_vocab", 0) or 1) * 4
        batch_size = min(MAX_BATCH, max(1, int(weight_bytes(model) * LOGITS_SHARE) // per_seq))
    return list(tokens.split(batch_size))


def loss_positions(d_vocab: int) -> int:
    """How many positions' float32 log-probabilities one step of a loss may take: at most
    ``LOSS_CHUNK_BYTES`` (at least one position, at most 32), so that the loss of a large
    vocabulary never copies a sequence's logits.

    >>> loss_positions(49_152), loss_positions(262_144), loss_positions(50)
    (32, 8, 32)
    """
    return max(1, min(32, LOSS_CHUNK_BYTES // (4 * max(int(d_vocab), 1))))


def trim_allocator() -> None:
    """Hand the C allocator's freed pages back to the system (glibc's ``malloc_trim``).

    A pass's logits and loss are freed when it ends, but glibc keeps the pages of
    allocations under its mmap threshold (up to 32 MB) for reuse; across many passes they
    pile up as resident memory nothing uses. Trimming after each pass keeps the process near
    the weights; it costs about a millisecond. A no-op where there is no glibc.

    >>> trim_allocator()
    """
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
        except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl, Windows)
            _LIBC = False
    if _LIBC:
        _LIBC(0)


class LayerTrim:
    """For a pass that holds something of each layer until it ends: call it once per layer, and it
    calls :func:`trim_allocator` every ``every``-th time where a layer's ``[positions, width]`` float32
    reaches :data:`TRIM_BYTES` (``active``; ``every`` 0: never); below it nothing (each trim costs the next layer's page
    faults, and small transients are reused). :meth:`now` trims at once where active.

    glibc keeps a layer's freed transients (under its mmap threshold, up to 32 MB) for reuse, and the
    rows held at each layer land between them, so at length they pile up as resident memory nothing
    uses (docs/benchmarks.md, issue 50 rounds 4, 5 and 12).

    >>> trim = LayerTrim(4096, 576, every=5)
    >>> trim.active, LayerTrim(128, 576, every=5).active
    (True, False)
    >>> [trim() for _ in range(5)] == [None] * 5
    True
    """

    def __init__(self, positions: int, width: int, every: int):
        self.active, self.every, self.calls = every > 0 and positions * width * 4 >= TRIM_BYTES, every, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.active and self.calls % self.every == 0:
            trim_allocator()

    def now(self) -> None:
        """Trim at once, where active."""
        if self.active:
            trim_allocator()
