"""A Hugging Face model and tokenizer read from a hub id or a local folder (safetensors only, every
tensor checked against ``config.json``), under the process-wide
:data:`~massive_lens.models.offline.LOADING` lock; and the errors of a name that does not load.
:func:`~massive_lens.models.load.load_model` turns them into a TransformerLens model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from massive_lens.errors import MassiveLensError
from massive_lens.models.backends import hub_offline
from massive_lens.models.offline import LOADING, offline_names


def load_hf(name: str, local: bool, dtype: torch.dtype, device_map: Any = None) -> tuple[Any, Any]:
    """The Hugging Face model and tokenizer of a hub id or local folder. A local folder is read
    from safetensors only (a ``*.bin`` file is a pickle, which can run code), and a tensor
    missing from it, left over, or of another shape than its ``config.json`` says is an error
    (transformers would otherwise fill a missing one with random weights)."""
    if local and not (Path(name) / "config.json").is_file():
        raise MassiveLensError(f"{name} is not a model folder: it has no config.json (save one with "
                               "model.save_pretrained(folder) and tokenizer.save_pretrained(folder))")
    kwargs: dict[str, Any] = dict(dtype=dtype, output_loading_info=True)
    if local:
        kwargs.update(local_files_only=True, use_safetensors=True)
    if device_map is not None:
        kwargs["device_map"] = checked_device_map(device_map)
    try:
        with LOADING, hub_offline() if local else contextlib.nullcontext():
            hf, info = model_class(name, local).from_pretrained(name, **kwargs)
            images = getattr(hf, "main_input_name", None) == "pixel_values"  # a ViT: no tokenizer
            tok = None if images else AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        if local:
            raise MassiveLensError(f"could not read the model in {name}: {type(exc).__name__}: {str(exc)[:300]} (a "
                                   "folder needs a valid config.json, *.safetensors weights and a tokenizer)") from exc
        raise not_loaded(name, exc) from exc
    except Exception as exc:  # noqa: BLE001 - safetensors' and torch's errors for damaged or mis-sized files
        raise MassiveLensError(f"the weights in {name} are damaged or do not fit its config.json: "
                               f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    problems = {k: v for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if (v := list(info.get(k) or []))}
    if problems:
        listed = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, v[:6]))}{' ...' if len(v) > 6 else ''}"
                           for k, v in problems.items())
        raise MassiveLensError(f"the weights in {name} do not match its config.json ({listed}); a missing tensor "
                               "would be random weights: save the model again with save_pretrained")
    return hf.eval(), tok


def model_class(name: str, local: bool) -> Any:
    """The class a local folder's ``config.json`` names (a causal LM, or a ViT's class), else
    ``AutoModelForCausalLM``."""
    if local:
        architectures = getattr(AutoConfig.from_pretrained(name, local_files_only=True), "architectures", None) or []
        found = getattr(transformers, architectures[0], None) if architectures else None
        if isinstance(found, type) and issubclass(found, PreTrainedModel):
            return found
    return AutoModelForCausalLM


def checked_device_map(device_map: Any) -> Any:
    """``device_map`` as given, once accelerate (which places the weights) is found installed."""
    if importlib.util.find_spec("accelerate") is None:
        raise MassiveLensError("device_map needs accelerate: pip install accelerate")
    return device_map


def looks_local(name: str) -> bool:
    """A path rather than a hub id ``owner/name``: absolute, relative (``./``, ``~``), or deeper."""
    return name.startswith((".", "~", os.sep)) or name.count("/") > 1 or "\\" in name


def not_loaded(name: str, exc: Exception) -> MassiveLensError:
    """The error for a name that did not load: what ``load_model`` takes instead."""
    return MassiveLensError(
        f"could not load {name!r}: {exc}. Pass a local folder saved with "
        "save_pretrained, a .gguf file, nothing for the offline default, or the name of an "
        f"offline model ({offline_names()}); hub ids need network access"
    )


def local_tokenizer(name: str) -> Any:
    """The tokenizer saved with ``name`` (a folder or a cached hub id), read without the network."""
    try:
        with hub_offline():
            return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise MassiveLensError(
            f"no tokenizer found for {name!r} offline; pass tokenizer= to load_model"
        ) from exc
