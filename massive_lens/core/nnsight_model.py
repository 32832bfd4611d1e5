"""An nnsight model as the rest of massive_lens reads a model (:class:`NnsightModel`: ``cfg``, the
tokenizer, the parameters, the Hugging Face model inside), built once per nnsight model from its
Hugging Face config; the keyword arguments every trace passes on (:func:`trace_options`). The view
that serves TransformerLens's hook names on it is :mod:`massive_lens.core.nnsight_view`.

>>> is_nnsight_model(object())
False
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.model_name import readable_name
from massive_lens.errors import MassiveLensError

__all__ = ["NnsightModel", "is_nnsight_model", "nnsight_model", "trace_options"]

_OPTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nnsight model -> trace keyword arguments
_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nnsight model -> its NnsightModel


def is_nnsight_model(model: Any) -> bool:
    """Whether ``model`` is an nnsight model (``nnsight.NNsight``, ``LanguageModel``, ...),
    checked without importing nnsight."""
    return any(c.__module__.split(".")[0] == "nnsight" for c in type(model).__mro__)


def trace_options(model: Any, **options: Any) -> dict[str, Any]:
    """Keyword arguments every ``model.trace(...)`` of massive_lens passes on as they are (for
    NDIF: ``remote=True``, which needs an NDIF API key and a model NDIF hosts); returns them.
    Called with none, returns the current ones.

    >>> trace_options(object.__new__(type("Envoy", (), {})))
    {}
    """
    if options:
        _OPTIONS[model] = {**_OPTIONS.get(model, {}), **options}
    return dict(_OPTIONS.get(model, {}))


@dataclass
class _Config:
    """The few TransformerLens config fields the analyses read, from the Hugging Face config."""

    n_layers: int
    d_model: int
    n_ctx: int | None
    d_vocab: int | None
    model_name: str
    default_prepend_bos: bool = True  # TransformerLens's usual default; it turns it off for a few architectures
    n_heads: int | None = None
    d_head: int | None = None
    n_key_value_heads: int | None = None


class NnsightModel:
    """An nnsight model as the rest of massive_lens reads a model: ``cfg``, ``tokenizer``, the
    parameters and the Hugging Face model (``original_model``, as a bridge has it). One per nnsight
    model (so :func:`~massive_lens.core.model_lock.model_lock` is the same); ``ModelView`` of it is its
    :class:`~massive_lens.core.nnsight_view.NnsightView`."""

    def __init__(self, lm: Any, hf: torch.nn.Module, cfg: _Config, layers_path: str):
        self._lm = weakref.ref(lm)  # _ADAPTERS maps lm to this: a strong reference would keep lm alive
        self.original_model, self.cfg, self.layers_path = hf, cfg, layers_path

    @property
    def lm(self) -> Any:
        """The nnsight model."""
        return self._lm()

    @property
    def tokenizer(self) -> Any:
        return getattr(self.lm, "tokenizer", None)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.original_model.parameters(recurse)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        return self.original_model.buffers(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.original_model.named_parameters(*args, **kwargs)

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.original_model.modules()


def nnsight_model(model: Any) -> NnsightModel:
    """The one :class:`NnsightModel` of the nnsight model ``model``: built from its Hugging Face
    model and config the first time, then the same one (so
    :func:`~massive_lens.core.model_lock.model_lock` is the same)."""
    adapter = _ADAPTERS.get(model)
    if adapter is not None:
        return adapter
    hf = getattr(getattr(model, "pipeline", None), "model", None) or getattr(model, "_module", None)
    if not isinstance(hf, torch.nn.Module):
        raise MassiveLensError(f"{type(model).__name__}: an nnsight model with no torch module inside")
    config = getattr(hf, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(text, "num_hidden_layers", None)
    layers_path = _layers_path(hf, n_layers)
    if text is None or layers_path is None:
        raise MassiveLensError(f"{type(hf).__name__} is not a Hugging Face decoder the nnsight backend reads: it "
                               "needs a config with num_hidden_layers and a list of that many decoder layers")
    name = getattr(config, "_name_or_path", None) or type(hf).__name__
    heads = getattr(text, "num_attention_heads", None)
    d_head = getattr(text, "head_dim", None) or (int(text.hidden_size) // heads if heads else None)
    cfg = _Config(int(n_layers), int(text.hidden_size), getattr(text, "max_position_embeddings", None),
                  getattr(text, "vocab_size", None), readable_name(str(name)), n_heads=heads, d_head=d_head,
                  n_key_value_heads=getattr(text, "num_key_value_heads", None))
    _ADAPTERS[model] = adapter = NnsightModel(model, hf, cfg, layers_path)
    return adapter


def _layers_path(hf: torch.nn.Module, n_layers: Any) -> str | None:
    if not isinstance(n_layers, int):
        return None
    return next((name for name, m in hf.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers and name), None)
