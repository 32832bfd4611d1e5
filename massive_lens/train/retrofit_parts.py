"""The parts of :mod:`massive_lens.train.retrofit`: settings, removal, and the tracked evaluation.

* A **setting** is ``"<variant>-kept"`` or ``"<variant>-removed"`` (``"-removed-held"``
  also holds the traced dims at zero at every position from the first birth layer on, so
  they cannot regrow).
* **Removal** zeroes the super weights that :func:`~massive_lens.trace_origin` names: the
  down-projection entries ``W_out[neuron, dim]`` of the neurons that give birth to each
  massive activation.
* The **tracked evaluation** runs held-out tokens once and reads, per layer, the largest
  ``|value|`` of the formerly massive dims (anywhere, and at the first token), the
  top-1/median ratio of ``|residual|`` (per sequence, then averaged), and
  the attention mass on the first token and on the off-switch slot.

>>> parse_setting("softmax1-removed")
Setting(name='softmax1-removed', variant='softmax1', remove=True, hold=False)
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Int
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from massive_lens.core.criterion import Criterion, median_scale
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import wrap_hf_model
from massive_lens.origin import trace_origin
from massive_lens.train.hf_attention import SUPPORTED, attention_modules, bridge_hooks, swap_attention, variant_of


@dataclass(frozen=True)
class Setting:
    """One fine-tuning setting: the attention variant, and whether the massive activations
    are removed (``remove``) and their dims held at zero (``hold``)."""

    name: str
    variant: str
    remove: bool
    hold: bool


def parse_setting(name: str) -> Setting:
    """``"softmax-kept"``, ``"kv_bias-removed"``, ``"softmax-removed-held"``... as a :class:`Setting`.

    Raises:
        MassiveLensError: for another form or a variant outside ``SUPPORTED``.
    """
    parts = name.split("-")
    ok = len(parts) in (2, 3) and parts[0] in SUPPORTED and parts[1] in ("kept", "removed")
    if not ok or (len(parts) == 3 and (parts[2] != "held" or parts[1] != "removed")):
        raise MassiveLensError(f"bad retrofit setting {name!r}: write '<variant>-kept', '<variant>-removed' or "
                               f"'<variant>-removed-held' with a variant from {', '.join(SUPPORTED)}")
    return Setting(name, parts[0], parts[1] == "removed", len(parts) == 3)


def find_super_weights(bridge: Any, tokens: Int[Tensor, "1 pos"]) -> tuple[pd.DataFrame, list[int]]:
    """The super weights and massive dims :func:`~massive_lens.trace_origin` finds on ``tokens``.

    Returns:
        ``(super_weights, dims)``: the trace's super-weight table (``layer``, ``neuron``,
        ``dim``, ``value``, ``hf_param``, ``hf_row``, ``hf_col``, one row per entry) and the
        massive dims it traced.

    Raises:
        MassiveLensError: if nothing is massive or no birth neuron is named (nothing to remove).
    """
    trace = trace_origin(bridge, tokens)
    supers = trace.super_weights.drop_duplicates(["hf_param", "hf_row", "hf_col"]).reset_index(drop=True)
    if supers.empty:
        raise MassiveLensError(f"trace_origin names no super weights in {trace.model_name} on these tokens: "
                               "its massive activations are not born in an MLP, so there is nothing to remove")
    dims = sorted({int(d) for d in trace.targets.loc[trace.targets.massive, "dim"]})
    return supers, dims


def zero_super_weights(hf_model: nn.Module, supers: pd.DataFrame) -> None:
    """Zero each ``hf_param[hf_row, hf_col]`` of ``supers`` in ``hf_model`` (in place).

    Raises:
        MassiveLensError: if a named parameter is not in ``hf_model``.
    """
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for row in supers.itertuples():
            if row.hf_param not in params:
                raise MassiveLensError(f"{type(hf_model).__name__} has no parameter {row.hf_param!r}")
            params[row.hf_param][row.hf_row, row.hf_col] = 0.0


def sink_keys_values(bridge: Any, tokens: Int[Tensor, "batch pos"]) -> tuple[Tensor, Tensor]:
    """Mean post-RoPE key and value at the first token, ``[layer, kv_head, d_head]`` each:
    bias surgery's initialisation of the slot (its sink is the first token)."""
    n = bridge.cfg.n_layers
    found: dict[str, Tensor] = {}

    def grab(x: Tensor, hook: Any, name: str) -> None:
        found[name] = x[:, 0].mean(0).float()  # [kv_head, d_head] at the first token

    names = [ModelView.block_hook(layer, f"attn.hook_{kind}") for layer in range(n) for kind in ("rot_k", "v")]
    hooks = [(name, partial(grab, name=name)) for name in names]
    with torch.no_grad(), bridge.hooks(fwd_hooks=hooks):  # (run_with_cache leaves hooks on a bridge)
        bridge(tokens)
    keys = torch.stack([found[ModelView.block_hook(layer, "attn.hook_rot_k")] for layer in range(n)])
    values = torch.stack([found[ModelView.block_hook(layer, "attn.hook_v")] for layer in range(n)])
    return keys, values


def decoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (``model.layers``)."""
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if layers is None:
        raise MassiveLensError(f"{type(hf_model).__name__} has no model.layers; retrofit supports "
                               "Llama/Qwen/Mistral-style Hugging Face models")
    return layers


def _hidden(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def hold_dims(hf_model: nn.Module, dims: list[int], start: int) -> list[Any]:
    """Forward hooks that zero ``dims`` (every position) in the output of every layer from ``start`` on.

    Returns:
        The hook handles (``handle.remove()`` to undo).
    """
    def zero(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = _hidden(output).clone()
        hidden[..., dims] = 0.0
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return [layer.register_forward_hook(zero) for layer in list(decoder_layers(hf_model))[start:]]


@contextlib.contextmanager
def tapped(hf_model: nn.Module) -> Iterator[list[Any]]:
    """Record attention mass in every swapped attention module while inside."""
    taps = [m.ml_tap for m in attention_modules(hf_model)]
    for tap in taps:
        tap.on = True
    try:
        yield taps
    finally:
        for tap in taps:
            tap.on = False


def tracked_eval(hf_model: nn.Module, tokens: Int[Tensor, "batch pos"], dims: list[int],
                 loss_fn: Any) -> tuple[float, list[dict[str, Any]]]:
    """Held-out loss and per-layer rows: ``layer``, ``dims_max`` (largest ``|value|`` of
    ``dims``), ``first_max`` (the same at the first token), ``top1``, ``median`` and ``ratio``
    (top-1 / median) of ``|residual|``, each taken per sequence (the median from
    :func:`~massive_lens.core.criterion.median_scale`, as the massive criterion takes it) and
    averaged over sequences, as in :func:`~massive_lens.measure_outliers`; ``first_mass`` and
    ``slot_mass`` (mean attention on the first token and on the slot, queries ``>= 1``)."""
    rows: list[dict[str, Any]] = []

    def stats(module: nn.Module, args: Any, output: Any) -> None:
        mag = _hidden(output).detach().float().abs()
        top1, median = mag.flatten(1).amax(1), median_scale(mag, Criterion())[1]
        rows.append(dict(layer=len(rows), dims_max=float(mag[..., dims].max()) if dims else float("nan"),
                         first_max=float(mag[:, 0, dims].max()) if dims else float("nan"),
                         top1=float(top1.mean()), median=float(median.mean()),
                         ratio=float((top1 / median.clamp(min=1e-12)).mean())))

    handles = [layer.register_forward_hook(stats) for layer in decoder_layers(hf_model)]
    was_training = hf_model.training
    hf_model.eval()
    try:
        with torch.no_grad(), tapped(hf_model) as taps:
            loss = float(loss_fn(hf_model(tokens, use_cache=False).logits, tokens))
    finally:
        for h in handles:
            h.remove()
        hf_model.train(was_training)
    for row, tap in zip(rows, taps, strict=True):
        row.update(first_mass=tap.first, slot_mass=tap.slot)
    return loss, rows


def analysis_bridge(hf_model: nn.Module, tokenizer: Any, *, hold: tuple[list[int], int] | None = None,
                    name: str = "retrofit") -> Any:
    """A TransformerBridge over a copy of a fine-tuned model that computes its swapped attention.

    The slot hooks of :func:`~massive_lens.train.hf_attention.bridge_hooks` (and, with
    ``hold=(dims, start)``, hooks zeroing ``dims`` from layer ``start`` on) are added as
    *permanent* hooks, so every massive_lens analysis run on the returned
    bridge (``find_massive``, ``trace_origin``, ``measure_outliers``...) sees the variant.
    """
    clone = copy.deepcopy(hf_model)
    for module in attention_modules(clone):  # the bridge runs its own softmax; the hooks add the slots
        del module.ml_variant, module.ml_tap
    clone.config._attn_implementation = "eager"
    bridge = wrap_hf_model(clone, tokenizer, name=name)
    hooks = bridge_hooks(bridge, hf_model)
    if hold is not None:
        dims, start = hold
        hooks += [(ModelView.block_hook(layer, "resid_post"), partial(_zero_dims, dims=dims))
                  for layer in range(start, bridge.cfg.n_layers)]
    for hook_name, fn in hooks:
        bridge.add_hook(hook_name, fn, is_permanent=True)
    return bridge


def _zero_dims(resid: Tensor, hook: Any, *, dims: list[int]) -> Tensor:
    resid = resid.clone()
    resid[..., dims] = 0.0
    return resid


SLOT_NOISE = 0.02
"""Standard deviation of the seeded Gaussian noise added to every slot parameter at the start
(``kv_bias``/``k_bias`` keys and values, ``learned_sink`` logits), so that a seed changes the
slot initialisation as well as the batch order."""


def seed_slots(hf_model: nn.Module, seed: int, scale: float = SLOT_NOISE) -> None:
    """Add ``N(0, scale^2)`` noise, drawn from a generator seeded by ``seed``, to every slot
    parameter of a swapped model (in place; a variant without parameters is left as it is)."""
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    with torch.no_grad():
        for module in attention_modules(hf_model):
            for p in module.ml_variant.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * scale)


def save_retrofitted(hf_model: nn.Module, path: str | os.PathLike, meta: dict[str, Any], tokenizer: Any = None
                     ) -> Path:
    """Save a fine-tuned, swapped model to the folder ``path``: ``model.safetensors`` (weights and
    slots), ``config.json``, the tokenizer's files (if given) and ``retrofit.json`` (``meta``:
    setting, seed, held dims...), written last. Safetensors and JSON only: no pickle.
    :func:`load_retrofitted` reads it back."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    save_model(hf_model, str(out / "model.safetensors"))
    hf_model.config.to_json_file(out / "config.json")
    (out / "retrofit.json").write_text(json.dumps(dict(meta, variant=variant_of(hf_model)), indent=1) + "\n")
    return out


def load_retrofitted(path: str | os.PathLike) -> tuple[nn.Module, Any, dict[str, Any]]:
    """A model saved by :func:`save_retrofitted`, swapped to its variant, its tokenizer (None if
    none was saved) and its ``meta``.

    Raises:
        MassiveLensError: if the folder lacks one of the three files.
    """
    folder = Path(path)
    files = [folder / n for n in ("model.safetensors", "config.json", "retrofit.json")]
    if not all(f.is_file() for f in files):
        raise MassiveLensError(f"{folder} is not a folder written by save_retrofitted (needs "
                               "model.safetensors, config.json and retrofit.json)")
    meta = json.loads(files[2].read_text())
    config = AutoConfig.from_pretrained(folder)
    config._attn_implementation = "eager"
    hf = swap_attention(AutoModelForCausalLM.from_config(config), meta["variant"])
    load_model(hf, str(files[0]))
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    return hf.eval(), tokenizer, meta
