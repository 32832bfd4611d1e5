"""nnsight models behind the same :class:`~massive_lens.core.model_view.ModelView`.

`nnsight <https://nnsight.net>`_ runs a Hugging Face model inside ``with lm.trace(...)``: the
body of the block reads and writes module inputs and outputs (``lm.model.layers[3].output``)
while the model runs, in the order the model computes them. :class:`NnsightView` serves the
TransformerLens names the residual-stream analyses ask for on such a model, so
``find_massive(lm, text)`` works as ``find_massive(bridge, text)`` does:

- ``blocks.{l}.hook_resid_pre``: the decoder layer's input; ``hook_resid_post``: its output;
- ``hook_resid_mid``: the input of the norm before the MLP (``post_attention_layernorm``,
  ``pre_feedforward_layernorm`` in sandwich-norm blocks, GPT-2's ``ln_2``);
- ``hook_attn_out`` and ``hook_mlp_out``: the attention's and the MLP's outputs (blocks with
  no norm after them only: elsewhere TransformerLens's names mean another tensor);
- ``mlp.hook_post``: the MLP's neuron activations, the input of its output projection
  (``down_proj``, GPT-2's ``c_proj``), whose weights :meth:`NnsightView.mlp_w_out` gives as
  TransformerLens's ``W_out``.

The hook functions run inside the trace, in firing order, so only what they reduce leaves it
(what NDIF's ``remote=True`` would ship back). Three traps nnsight users meet are handled here:
text is tokenized by the view, **right**-padded with an attention mask (nnsight's own tokenizer
pads on the left, which shifts every real token's position and, in models with learned
absolute positions, its embedding); the first token is position 0 of every row; and a layer
whose output (or input) is a tuple ``(hidden, residual)`` of two same-shaped tensors (vLLM's
fused-residual layers) carries the residual stream as their **sum**, which is what is read,
and what an edit writes back (``(edited, zeros)``).

The sink analyses (``find_sinks``, ``sink_attention``, ``sink_census``) run here on the LSE path
(:mod:`massive_lens.core.lse`): :meth:`NnsightView.attention_modules` hands over each decoder
layer's Hugging Face attention module, whose attention function the kernel that returns the
log-sum-exp replaces for the pass, so attention on a few key columns is computed inside the
trace without any pattern. What needs TransformerLens's own modules (per-head hooks,
attention patterns, TransformerLens-style weights) is a :class:`MassiveLensError` naming the
calls that run here.

The nnsight model itself, as the package reads it, is :mod:`massive_lens.core.nnsight_model`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.core.nnsight_model import NnsightModel, is_nnsight_model, nnsight_model, trace_options
from massive_lens.errors import MassiveLensError

__all__ = ["SUPPORTED_CALLS", "NnsightView", "serves_nnsight"]

# the per-block sites served, in the order a block computes them
SITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out", "hook_resid_post")
SUPPORTED_CALLS = ("find_massive", "layer_profile", "scan_corpus", "perplexity", "find_sinks", "sink_attention",
                   "sink_census", "calibrate", "offswitch", "run_interventions (the residual-stream settings)")
_ATTN = ("self_attn", "attn", "attention", "self_attention")
_MLP = ("mlp", "feed_forward", "ffn")
_DOWN = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "fc_out", "w2")  # the MLP's output projection
_MID_NORM = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")  # first found: resid_mid is its input
_POST_NORMS = ("post_feedforward_layernorm", "post_mlp_layernorm")  # a sublayer output normed before the add


@dataclass(frozen=True)
class _Hook:
    """What a TransformerLens hook function receives as ``hook``: its name and layer."""

    name: str

    def layer(self) -> int:
        return int(self.name.split(".")[1])


class NnsightView(ModelView):
    """:class:`ModelView` over an nnsight model (``ModelView(lm)`` builds one); ``.model`` is its
    :class:`NnsightModel`, ``.lm`` the nnsight model, ``.hf`` the Hugging Face model inside."""

    def __init__(self, model: Any):
        adapter = model if isinstance(model, NnsightModel) else nnsight_model(model)
        self.lm, self.hf, self.model, self.cfg = adapter.lm, adapter.original_model, adapter, adapter.cfg
        self.layers_path = adapter.layers_path
        self._hook_names = frozenset(self.block_hook(layer, site) for layer in range(self.cfg.n_layers)
                                     for site in self._sites(layer))
        self._aliases = {}
        self.image_layout = None


    # ------------------------------------------------------------------ facts
    @property
    def tokenizer(self) -> Any:
        tok = getattr(self.lm, "tokenizer", None)
        if tok is None:
            raise MassiveLensError(f"this nnsight {type(self.lm).__name__} of {self.name} has no tokenizer; load it "
                                   "with massive_lens.load_model(hf_model, tokenizer=tokenizer, backend='nnsight'), or "
                                   "pass token ids (a LongTensor [batch, pos]) instead of text")
        return tok

    def str_tokens(self, batch: Any) -> list[list[str]]:
        """Token strings; with no tokenizer (``nnsight.NNsight`` over token ids), the ids as text."""
        if getattr(self.lm, "tokenizer", None) is None:
            return [[str(t) for t in row[: int(n)].tolist()] for row, n in zip(batch.tokens, batch.lengths,
                                                                                strict=True)]
        return super().str_tokens(batch)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def input_device(self) -> torch.device:
        embed = self.hf.get_input_embeddings() if hasattr(self.hf, "get_input_embeddings") else None
        return next((embed or self.hf).parameters()).device

    @property
    def hook_names(self) -> frozenset[str]:
        return self._hook_names

    @property
    def blocks(self) -> Any:
        raise self.unsupported("TransformerLens-style weights (model.blocks)")

    def block(self, layer: int) -> Any:
        raise self.unsupported(f"block {layer}'s TransformerLens-style weights")

    def hook_name(self, layer: int, hook: str) -> str:
        name = self.block_hook(layer, hook)
        if 0 <= layer < self.n_layers and name not in self.hook_names:
            raise self.unsupported(f"the hook {name!r}")
        return super().hook_name(layer, hook)

    def attention_modules(self) -> list[tuple[int, torch.nn.Module]]:
        """``(layer, attention module)`` of every decoder layer that has one (its ``self_attn``,
        ``attn``, ...): the Hugging Face modules whose attention function the LSE path swaps
        (:func:`~massive_lens.core.lse.lse_run`)."""
        found = []
        for layer in range(self.n_layers):
            path = f"{self.layers_path}.{layer}"
            name = _child(self.hf, path, _ATTN)
            if name is not None:
                found.append((layer, self.hf.get_submodule(f"{path}.{name}")))
        return found

    def mlp_w_out(self, layer: int) -> Tensor | None:
        """The MLP's output projection as TransformerLens's ``W_out`` ``[d_mlp, d_model]`` (a
        ``Linear``'s weight transposed, a GPT-2 ``Conv1D``'s as stored), None without one."""
        down = self._down(layer) if 0 <= layer < self.n_layers else None
        if down is None:
            return None
        module = self.hf.get_submodule(down)
        return module.weight.T if isinstance(module, torch.nn.Linear) else module.weight

    def sandwich_norm(self) -> bool:
        """Whether the blocks norm each sublayer's output before adding it (Gemma 2/3: a
        ``post_feedforward_layernorm``), as TransformerLens's ``ln1_post`` says on a bridge."""
        return any(_child(self.hf, f"{self.layers_path}.{layer}", _POST_NORMS) is not None
                   for layer in range(self.n_layers))

    @property
    def serves_patterns(self) -> bool:
        return False

    def pattern_refusal(self) -> str:
        return (f"{self.name} is an nnsight model, which cannot serve attention patterns, so attention='eager' "
                "does not run on it; use attention='auto' or 'lse' (the attention on the few key columns an "
                "analysis needs, from q, k and the fused SDPA kernel's log-sum-exp: sink_attention, sink_census "
                "and find_sinks run this way on nnsight)")

    def unsupported(self, what: str) -> MassiveLensError:
        """The error for what the nnsight backend cannot serve, naming what runs on it."""
        sites = ", ".join(sorted({n.split(".", 2)[2] for n in self.hook_names}))
        return MassiveLensError(
            f"{self.name} is an nnsight model, which serves the residual stream and MLP activations ({sites}) and "
            f"attention on key columns from the fused kernel's log-sum-exp (attention='lse'); {what} needs "
            f"TransformerLens's own modules (per-head hooks, attention patterns, TransformerLens-style weights). "
            f"On nnsight these run: {', '.join(SUPPORTED_CALLS)}. For the rest load the model with "
            "massive_lens.load_model(..., backend='bridge')")

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def hooked(self, fwd_hooks: list[tuple[str, Any]]) -> Iterator[None]:
        raise self.unsupported("attaching hooks outside a forward pass (view.hooked)")
        yield  # pragma: no cover

    def run_hooked(self, inputs: Tensor, kwargs: dict[str, Any], hooks: list[tuple[str, Any]]) -> Any:
        """One traced pass: each hook function runs on its site's tensor inside ``model.trace``,
        in the order the model computes them; a tensor it returns replaces the site's value.
        Returns the model's logits."""
        order = []
        for i, (name, fn) in enumerate(hooks):
            if name not in self.hook_names:
                raise self.unsupported(f"the hook {name!r}")
            layer, site = int(name.split(".")[1]), name.split(".", 2)[2]
            order.append((layer, SITES.index(site), i, site, name, fn))
        order.sort(key=lambda item: item[:3])
        box: dict[str, Any] = {}
        lm = self.lm
        with model_lock(self.model), _eval_mode(self.hf), torch.no_grad():
            with lm.trace(inputs, **kwargs, **trace_options(lm)):
                for layer, _, _, site, name, fn in order:
                    self._run_hook(layer, site, name, fn)
                box["out"] = lm.output
        out = box["out"]
        return getattr(out, "logits", out[0] if isinstance(out, tuple) else out)

    def _run_hook(self, layer: int, site: str, name: str, fn: Any) -> None:
        envoy, side = self._site(layer, site)
        raw = envoy.input if side == "input" else envoy.output
        value, split = residual_of(raw)
        new = fn(value, hook=_Hook(name))
        if new is None or new is value:
            if split is None:  # read, or edited in place: the model's own tensor
                return
            new = value  # a split stream's sum is a new tensor: an in-place edit is written back
        replaced = replace_residual(raw, new, split)
        if side == "input":
            envoy.input = replaced
        else:
            envoy.output = replaced

    def _site(self, layer: int, site: str) -> tuple[Any, str]:
        block = _envoy(self.lm, f"{self.layers_path}.{layer}")
        if site in ("hook_resid_pre", "hook_resid_post"):
            return block, "input" if site == "hook_resid_pre" else "output"
        if site == "mlp.hook_post":
            return _envoy(self.lm, self._down(layer)), "input"
        child = {"hook_attn_out": _ATTN, "hook_mlp_out": _MLP, "hook_resid_mid": _MID_NORM}[site]
        found = _child(self.hf, f"{self.layers_path}.{layer}", child)
        return _envoy(block, found), "input" if site == "hook_resid_mid" else "output"

    def _sites(self, layer: int) -> list[str]:
        path = f"{self.layers_path}.{layer}"
        sites = ["hook_resid_pre", "hook_resid_post"]
        if _child(self.hf, path, _MID_NORM) is not None:
            sites.append("hook_resid_mid")
        sandwich = _child(self.hf, path, _POST_NORMS) is not None
        if not sandwich and _child(self.hf, path, _ATTN) is not None:
            sites.append("hook_attn_out")
        if not sandwich and _child(self.hf, path, _MLP) is not None:
            sites.append("hook_mlp_out")
        if self._down(layer) is not None:
            sites.append("mlp.hook_post")
        return sites

    def _down(self, layer: int) -> str | None:
        """The path of layer ``layer``'s MLP output projection (a ``Linear``, or a GPT-2 ``Conv1D``
        whose weight is ``[d_mlp, d_model]``), None where the MLP has none (a mixture of experts)."""
        path = f"{self.layers_path}.{layer}"
        mlp = _child(self.hf, path, _MLP)
        down = _child(self.hf, f"{path}.{mlp}", _DOWN) if mlp is not None else None
        if down is None:
            return None
        module = self.hf.get_submodule(f"{path}.{mlp}.{down}")
        w = getattr(module, "weight", None)
        if not isinstance(w, Tensor) or w.ndim != 2:
            return None
        fits = (w.shape[0] == self.d_model if isinstance(module, torch.nn.Linear)
                else type(module).__name__ == "Conv1D" and w.shape[1] == self.d_model)
        return f"{path}.{mlp}.{down}" if fits else None


def residual_of(raw: Any) -> tuple[Tensor, Tensor | None]:
    """The residual stream in a module's input or output: a tensor as it is; a tuple's first
    part, or, when its second part is a tensor of the same shape (a fused-residual layer's
    ``(hidden, residual)``), the sum of the two, with that second part.

    >>> h, r = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0)
    >>> float(residual_of((h, r))[0][0, 0, 0]), residual_of((h, None))[1] is None
    (3.0, True)
    """
    if isinstance(raw, Tensor):
        return raw, None
    if isinstance(raw, (tuple, list)) and raw and isinstance(raw[0], Tensor):
        second = raw[1] if len(raw) > 1 else None
        if isinstance(second, Tensor) and second.shape == raw[0].shape:
            return raw[0] + second, second
        return raw[0], None
    raise MassiveLensError(f"an nnsight module gave a {type(raw).__name__}, not a tensor or a tuple of tensors; "
                           "its residual stream cannot be read")


def replace_residual(raw: Any, new: Tensor, split: Tensor | None) -> Any:
    """``raw`` with its residual stream replaced by ``new`` (a split one as ``(new, zeros)``)."""
    if isinstance(raw, Tensor):
        return new
    rest = tuple(raw[2:]) if split is not None else tuple(raw[1:])
    head = (new, torch.zeros_like(split)) if split is not None else (new,)
    return type(raw)((*head, *rest)) if isinstance(raw, tuple) else [*head, *rest]


def _child(hf: torch.nn.Module, path: str, names: tuple[str, ...]) -> str | None:
    block = hf.get_submodule(path)
    return next((n for n in names if isinstance(getattr(block, n, None), torch.nn.Module)), None)


def _envoy(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode inside the block; the ones in train mode put back after."""
    training = [m for m in module.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


def serves_nnsight(model: Any) -> bool:
    """Whether :class:`NnsightView` serves ``model`` (an nnsight model or its adapter);
    :mod:`massive_lens.models.backends` registers the view with this test."""
    return isinstance(model, NnsightModel) or is_nnsight_model(model)
