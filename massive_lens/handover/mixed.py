"""Run a model in half precision with some blocks kept in float32: the fix that
:func:`~massive_lens.handover.precision_check` proposes, measured.

:func:`cast` casts the model's floating parameters and buffers in place and puts every one
back (the same tensors) on every exit path; with ``keep``, the parameters of those blocks stay
in float32. :func:`block_dtype_hooks` casts the residual stream to each block's dtype where it
enters the block (``hook_resid_pre``), and back to the half-precision dtype after the last
block, so a float32 block reads and writes float32 and the others the half-precision dtype.

>>> from massive_lens import tiny_model
>>> m = tiny_model("llama")
>>> with cast(m, torch.float16, keep=[0]):
...     kept, other = m.blocks[0].ln1.w.dtype, m.blocks[1].ln1.w.dtype
>>> kept, other, m.blocks[1].ln1.w.dtype
(torch.float32, torch.float16, torch.float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView


@contextlib.contextmanager
def cast(model: Any, dtype: torch.dtype, keep: Sequence[int] = ()) -> Iterator[None]:
    """Run the block with ``model``'s floating parameters and buffers in ``dtype``, but those of
    the blocks in ``keep``; every one is put back afterwards (the same tensors: dtype, device
    and bits), exceptions included. The model's :func:`~massive_lens.core.model_lock.model_lock`
    is held from before the tensors are saved until the last one is back, so another thread's
    analysis of the same model waits instead of running on the cast weights.

    >>> from massive_lens import tiny_model
    >>> m = tiny_model("llama")
    >>> with cast(m, torch.bfloat16):
    ...     inside = next(m.parameters()).dtype
    >>> inside, next(m.parameters()).dtype
    (torch.bfloat16, torch.float32)
    """
    with model_lock(model):  # before the tensors are saved: another cast may be under way
        inner = getattr(model, "original_model", None)
        trees = [model, *([inner] if isinstance(inner, torch.nn.Module) else [])]
        kept = {id(t) for layer in keep for t in [*model.blocks[layer].parameters(), *model.blocks[layer].buffers()]}
        params = [p for p in {id(p): p for tree in trees for p in tree.parameters()}.values() if id(p) not in kept]
        saved = [(p, p.data) for p in params]
        buffers = [(m, name, b) for m, name, b in
                   {(id(m), name): (m, name, b) for tree in trees for m in tree.modules()
                    for name, b in m._buffers.items() if b is not None and b.is_floating_point()}.values()
                   if id(b) not in kept]
        cfg = getattr(model, "cfg", None)
        had_dtype = cfg is not None and hasattr(cfg, "dtype")
        old_dtype = getattr(cfg, "dtype", None)
        try:
            for p in params:
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for m, name, b in buffers:
                m._buffers[name] = b.to(dtype)
            if had_dtype:
                cfg.dtype = dtype
            yield
        finally:
            for p, data in saved:
                p.data = data
            for m, name, b in buffers:
                m._buffers[name] = b
            if had_dtype:
                cfg.dtype = old_dtype


def _to(x: Tensor, hook: Any, *, dtype: torch.dtype) -> Tensor:
    return x.to(dtype)


def block_dtype_hooks(view: ModelView, dtype: torch.dtype, keep: Sequence[int]) -> list[tuple[str, Any]]:
    """Hooks that hand each block the residual in its own dtype (float32 for the blocks in
    ``keep``, ``dtype`` for the others) and the final norm and unembedding ``dtype``."""
    hooks = [(view.hook_name(layer, "resid_pre"), partial(_to, dtype=torch.float32 if layer in keep else dtype))
             for layer in range(view.n_layers)]
    return [*hooks, (view.hook_name(view.n_layers - 1, "resid_post"), partial(_to, dtype=dtype))]
