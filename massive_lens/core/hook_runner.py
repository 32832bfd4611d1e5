"""The running half of a :class:`~massive_lens.core.model_view.ModelView`: hooks attached
for one block under the model's lock (train mode off, every module's mode put back), the
no-grad forward pass with its early stop and the finite check of every hooked activation,
and the precision warning of a half-precision model.

:class:`HookRunner` holds no state; the view it is mixed into supplies ``model``,
``hook_names`` (and the ``_aliases`` read with them), ``name``, ``dtype``, ``input_device``
and ``require_text``. A view of another model kind (nnsight) replaces :meth:`HookRunner.hooked`
and :meth:`HookRunner.run_hooked`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.budget import each_module
from massive_lens.core.hooked import translate
from massive_lens.core.model_lock import model_lock
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError

__all__ = ["HookRunner"]


class HookRunner:
    """Running a model with temporary hooks: :meth:`hooked`, :meth:`forward`, :meth:`activation`."""

    @contextlib.contextmanager
    def hooked(self, fwd_hooks: list[tuple[str, Any]]) -> Iterator[None]:
        """Attach hooks for the block; only these hooks are removed afterwards, always.

        The model's :func:`model_lock` is held throughout, so another thread's analysis waits
        instead of running with (or adding) hooks of its own. A hook name the model does not
        have is a :class:`MassiveLensError` (TransformerLens raises a bare ``KeyError``). On a
        ``HookedTransformer`` a bridge hook name is read where it lives there
        (:mod:`massive_lens.core.hooked`). A model in train mode runs in eval mode (no dropout,
        so two identical calls agree) and every module's own mode is put back afterwards.
        """
        missing = [name for name, _ in fwd_hooks if isinstance(name, str) and name not in self.hook_names]
        if missing:
            raise MassiveLensError(f"{self.name} has no hook {missing[0]!r}; see model.hook_dict for the "
                                   "hooks it has")
        with model_lock(self.model), contextlib.ExitStack() as stack:
            inner = getattr(self.model, "original_model", None)  # a bridge keeps its HF model outside modules()
            trees = [self.model, *([inner] if isinstance(inner, torch.nn.Module) else [])]
            training = _training_modules(trees)
            if training:
                stack.callback(lambda: [setattr(m, "training", True) for m in training])
                for m in training:
                    m.training = False
            stack.enter_context(self.model.hooks(fwd_hooks=translate(fwd_hooks, self._aliases or {})))
            yield

    def forward(self, batch: Batch, fwd_hooks: list[tuple[str, Any]], stop_after: str | None = None,
                check_finite: bool = True, must_stop: bool = True) -> Any:
        """One no-grad forward pass with temporary hooks; returns the model's output.

        With ``stop_after`` (a hook name) the pass ends right after that hook fires and
        returns None: analyses that read the residual stream skip the rest (and the
        unembedding, often the costliest matmul of a small model).

        With ``check_finite`` (the default) the activation each hook receives is checked, at
        real (non-pad) positions, for NaN and inf: an overflow is a ``MassiveLensError``
        naming the first hook that saw it, never a quiet NaN in a result. Pass False where a
        non-finite value is itself the answer (the perplexity of an edited model).

        A ``stop_after`` hook that never fires is a ``MassiveLensError``; with ``must_stop=False``
        (a stop chosen only to save time) the pass runs to the end instead.
        """
        if batch.pixel_values is None:
            self.require_text()
        inputs = batch.tokens if batch.pixel_values is None else batch.pixel_values
        kwargs: dict[str, Any] = {}
        all_real = bool(batch.mask.all())
        if not all_real:
            kwargs["attention_mask"] = batch.mask.to(self.input_device).long()
        hooks = list(fwd_hooks)
        seen: list[tuple[str, Tensor]] = []  # (hook name, its float32 sum or a finite flag) in firing order
        if check_finite:
            mask = None if all_real else batch.mask.to(self.input_device)
            hooks = [(name, _finite_checked(fn, mask, seen)) for name, fn in hooks]
        if stop_after is not None and stop_after.startswith("ln_final."):
            # the final norm can also fire before the blocks (NanoChat normalizes the
            # embeddings with its final norm): stop at the unembedding's input, which fires once, at the end
            stop_after = "unembed.hook_in" if "unembed.hook_in" in self.hook_names else None
        if stop_after is not None:
            hooks.append((stop_after, _stop_forward))
        try:
            out = self.run_hooked(inputs.to(self.input_device), kwargs, hooks)
        except _StopForward:
            out = None
        except MassiveLensError:
            raise
        except Exception as exc:  # a hook that tripped over a NaN: say so, not the symptom
            self._raise_if_nonfinite(seen, exc)
            raise
        self._raise_if_nonfinite(seen)
        if stop_after is not None and out is not None and must_stop:  # ran to the end: the hook never fired
            raise MassiveLensError(f"{self.name}: hook {stop_after!r} exists but never fired in a forward pass "
                                   "(this architecture's bridge does not run it), so nothing can be read there")
        return out

    def run_hooked(self, inputs: Tensor, kwargs: dict[str, Any], hooks: list[tuple[str, Any]]) -> Any:
        """The model on ``inputs`` with ``hooks`` attached (no grad): what :meth:`forward` runs,
        after its checks (a view of another model kind runs it its own way)."""
        with torch.no_grad(), self.hooked(hooks):
            return self.model(inputs, **kwargs)

    def _raise_if_nonfinite(self, seen: list[tuple[str, Tensor]], cause: BaseException | None = None) -> None:
        if not seen:
            return
        device = seen[0][1].device
        sums = [i for i, (_, got) in enumerate(seen) if got.is_floating_point()]  # a sum: finite where all is
        ok = torch.ones(len(seen), dtype=torch.bool)
        if sums:
            ok[sums] = torch.isfinite(torch.stack([seen[i][1].to(device) for i in sums])).cpu()  # one sync per pass
        if len(sums) < len(seen):
            flags = [i for i, (_, got) in enumerate(seen) if not got.is_floating_point()]
            ok[flags] = torch.stack([seen[i][1].to(device) for i in flags]).cpu()
        if bool(ok.all()):
            return
        raise self.overflow_error(seen[int((~ok).nonzero()[0])][0]) from cause

    def overflow_error(self, hook: str) -> MassiveLensError:
        """The error for NaN or inf reached at ``hook``: where, and what to do about it."""
        dtype = self.dtype
        if dtype in (torch.float16, torch.bfloat16):
            fix = ("the model overflowed there; load it with dtype=torch.float32 (or torch.bfloat16, "
                   "which has float32's range)")
        else:
            fix = (f"in {dtype} this is not a rounding issue: check the weights (torch.isfinite) and any "
                   "hooks or edits applied before this point")
        return MassiveLensError(
            f"{self.name} ({dtype}): the activation at {hook} holds NaN or inf, so every result past "
            f"it would be wrong; {fix}"
        )

    def activation(self, batch: Batch, name: str) -> Tensor:
        """The activation at hook ``name`` for ``batch`` (float32, CPU); the pass stops there."""
        seen: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            seen["x"] = x.detach().float().cpu()

        self.forward(batch, [(name, keep)], stop_after=name)
        return seen["x"]

    def check_precision(self, peak: float, where: str) -> None:
        """Warn (with numbers) when a half-precision model carries values near its limits."""
        dtype = self.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return
        info = torch.finfo(dtype)
        if not torch.isfinite(torch.tensor(peak)):
            raise MassiveLensError(
                f"{self.name} in {dtype} overflowed ({where} reached {peak}); load it with "
                "dtype=torch.float32 (or bfloat16, which has float32's range)"
            )
        spacing = info.eps * 2.0 ** math.floor(math.log2(max(peak, 1e-30)))
        if peak > info.max / 4 or spacing >= 1.0:
            warnings.warn(
                f"{self.name} runs in {dtype}: the largest activation ({where}) is {peak:,.1f}; "
                f"at that size {dtype} resolves steps of {float(spacing):g} and overflows at "
                f"{info.max:,.0f}. Values and ratios are approximate; use float32 for exact ones.",
                stacklevel=3,
            )


def _training_modules(trees: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every module in train mode under ``trees``, each once."""
    return [m for m in each_module(*trees) if m.training]


def _finite_checked(fn: Any, mask: Any, seen: list[tuple[str, Tensor]]) -> Any:
    """``fn`` as a hook that first records whether its activation is finite at real positions
    (attention scores may hold -inf by design: there only NaN and +inf count)."""

    padded = mask is not None and not bool(mask.all())

    def hook_fn(x: Any, hook: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point():
            name = str(getattr(hook, "name", "?"))
            part = x
            if padded and x.ndim >= 2 and tuple(x.shape[:2]) == tuple(mask.shape):
                part = x[mask]
            elif padded and x.ndim == 4 and x.shape[0] == mask.shape[0] and x.shape[2] == mask.shape[1]:
                part = x.transpose(1, 2)[mask]  # [batch, head, query, key]: real queries
            if name.endswith("attn_scores"):
                ok = ~(torch.isnan(part).any() | torch.isposinf(part).any())
            else:  # one reduction: a NaN or an inf anywhere makes the float32 sum non-finite (judged after the pass)
                ok = part.sum(dtype=torch.float32)
            seen.append((name, ok))
        return fn(x, hook=hook)

    return hook_fn


class _StopForward(Exception):
    """Raised by the last hook an analysis needs, to end the forward pass early."""


def _stop_forward(activation: Tensor, hook: Any) -> None:
    raise _StopForward
