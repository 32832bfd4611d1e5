"""What :func:`~massive_lens.train.train_model` records at every step, from hooks on the
training forward pass itself (no extra pass, no activations kept).

Per step (one row of :data:`STEP_COLUMNS`):

- ``loss`` (the step's training loss, before the update) and ``grad_norm`` (before clipping);
- ``max_act``: the largest |activation| in the residual stream (``blocks.<l>.hook_resid_post``)
  over the batch and every layer, ``max_act_layer`` the layer where it is, ``median_act`` the
  median |activation| of that layer's whole hidden state over the batch and ``act_ratio`` their
  ratio (Sun et al.'s top-1 / median); ``max_act_first`` the largest |activation| of the first
  token (position 0) at that layer;
- ``first_attn``: the attention weight on the first token (key 0), mean over the first
  :data:`ATTN_SEQS` sequences of the batch (the batch is a random draw, so they are a random
  sample; all of them cost 4x more), heads, queries 1.. (query 0 sees only itself) and layers;
  ``first_attn_top`` the same mean in the layer where it is highest. A slot variant's extra keys
  count in the normalization, so this is what ``hook_pattern[..., 0]`` shows.

The hooks reduce while the pass runs: a max per layer, one median (at the layer of the maximum,
from the residual tensor autograd holds anyway), and the first key's weight recomputed from the
layer's queries and keys (:meth:`~massive_lens.train.variants.AttentionVariant.first_key_weight`)
so that the pass keeps its fused attention and its numbers: recording does not change training.
With gradient accumulation the maxima are over the micro-batches and the attention is their
mean; under DDP each rank records its own shard (the loss and gradient norm are global).

>>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
>>> model = MassiveLM(MassiveLMConfig(n_layers=2, d_model=16, n_heads=2, n_ctx=8))
>>> with StepRecorder(model) as rec:
...     with rec.watching():
...         _ = model(torch.randint(0, 200, (2, 8)))
...     row = rec.row(step=1, loss=5.0, grad_norm=1.0, lr=1e-3)
>>> sorted(row) == sorted(STEP_COLUMNS), 0 < row["first_attn"] <= 1, len(model.blocks[0].hook_resid_post._forward_hooks)
(True, True, 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

ATTN_SEQS = 4  # sequences of each micro-batch whose attention on the first token is recomputed
STEP_COLUMNS = ("step", "loss", "grad_norm", "lr", "max_act", "max_act_layer", "median_act", "act_ratio",
                "max_act_first", "first_attn", "first_attn_top")


class StepRecorder:
    """Hooks on a :class:`~massive_lens.train.MassiveLM` that reduce each watched forward pass to
    the per-step numbers above. ``with StepRecorder(model)`` attaches them and removes them on
    exit; only passes inside :meth:`watching` are recorded (held-out evaluation is not)."""

    def __init__(self, model: Any):
        self.model = model
        self.handles: list[Any] = []
        self.active = False
        self._passes: list[dict[str, Tensor]] = []
        self._layer: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._attn: dict[int, Tensor] = {}

    def __enter__(self) -> StepRecorder:
        for layer, block in enumerate(self.model.blocks):
            self.handles.append(block.hook_resid_post.register_forward_hook(self._resid_hook(layer)))
            self.handles.append(block.attn.variant.register_forward_pre_hook(self._attn_hook(layer)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Record the forward passes run inside the block (one micro-batch each)."""
        self.active, self._layer, self._attn = True, {}, {}
        try:
            yield
        finally:
            self.active = False
            if self._layer:
                self._passes.append(self._reduce())
            self._layer, self._attn = {}, {}

    def _resid_hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, out: Tensor) -> None:
            if self.active:
                x = out.detach()  # held by autograd anyway; only the top layer's is read again
                self._layer[layer] = (_abs_max(x), _abs_max(x[:, 0]), x)
        return hook

    def _attn_hook(self, layer: int) -> Any:
        def hook(module: Any, args: tuple) -> None:
            if self.active:
                q, k = args[0][:ATTN_SEQS].detach(), args[1][:ATTN_SEQS].detach()
                self._attn[layer] = module.first_key_weight(q, k)[..., 1:].float().mean()
        return hook

    def _reduce(self) -> dict[str, Tensor]:
        """One pass: the largest |activation|, its layer, that layer's median and first-token max."""
        layers = sorted(self._layer)
        maxima = torch.stack([self._layer[layer][0].float() for layer in layers])
        top = int(maxima.argmax())
        _, first, x = self._layer[layers[top]]
        median = x.abs().flatten().float().median()
        attn = torch.stack([self._attn[layer] for layer in sorted(self._attn)]) if self._attn \
            else torch.full((1,), float("nan"))
        return dict(max_act=maxima[top], max_act_layer=torch.tensor(float(layers[top])), median_act=median,
                    max_act_first=first.float(), first_attn=attn.mean(), first_attn_top=attn.max())

    def row(self, *, step: int, loss: float, grad_norm: float, lr: float) -> dict[str, Any]:
        """The step's row, from the passes watched since the last row (then forgotten)."""
        passes, self._passes = self._passes, []
        if not passes:
            return dict.fromkeys(STEP_COLUMNS, float("nan")) | dict(step=step, loss=loss, grad_norm=grad_norm, lr=lr)
        best = max(range(len(passes)), key=lambda i: float(passes[i]["max_act"]))
        values = {k: float(v) for k, v in passes[best].items()}  # the pass holding the largest |activation|
        values["first_attn"] = float(torch.stack([p["first_attn"] for p in passes]).mean())
        values["first_attn_top"] = float(torch.stack([p["first_attn_top"] for p in passes]).mean())
        values["act_ratio"] = values["max_act"] / max(values["median_act"], 1e-12)
        values.update(step=step, loss=loss, grad_norm=grad_norm, lr=lr, max_act_layer=int(values["max_act_layer"]))
        return {c: values[c] for c in STEP_COLUMNS}


def _abs_max(x: Tensor) -> Tensor:
    """``x.abs().amax()`` without the ``|x|`` copy."""
    return torch.maximum(x.amax(), -x.amin()).float()
