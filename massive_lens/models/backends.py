"""The two kinds of TransformerLens model that :func:`~massive_lens.load_model` builds.

- ``"bridge"``: a ``TransformerBridge`` (TransformerLens 3.x and 4.x) wraps the Hugging Face
  model itself: its weights are used as they are.
- ``"hooked"``: a ``HookedTransformer`` (TransformerLens 3.x only; 4.x removed it) holds its
  own copy of the weights, converted by TransformerLens's conversion functions, with **no
  weight processing** (``fold_ln``, ``center_writing_weights``, ``center_unembed`` and
  ``fold_value_biases`` are off: centring changes the residual stream, which is what
  massive_lens measures). A model TransformerLens lists by name is built with
  ``HookedTransformer.from_pretrained_no_processing(name, hf_model=...)``; any other model
  of an architecture it converts (such as SmolLM2, a Llama) gets its ``HookedTransformerConfig``
  from TransformerLens's own reading of the Hugging Face config, then the converted weights.

Both give the same hook names and the same numbers (to float32 rounding) in every analysis.

- ``"nnsight"``: an nnsight ``TransformersModel`` over the Hugging Face model (its weights as
  they are). The residual-stream analyses run on it through
  :class:`~massive_lens.core.nnsight_view.NnsightView`, with the bridge's numbers; what needs
  TransformerLens's own modules is a clear error there (see ``docs/nnsight.md``).
:func:`default_backend` is ``"hooked"`` where TransformerLens 3.x offers it, else ``"bridge"``.

>>> default_backend() in BACKENDS
True
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import tempfile
import warnings
from typing import Any

import torch
from huggingface_hub import constants as hf_constants

from massive_lens.core.model_name import readable_name
from massive_lens.core.model_view import ModelView
from massive_lens.core.nnsight_view import NnsightView, serves_nnsight
from massive_lens.errors import MassiveLensError

log = logging.getLogger(__name__)

BACKENDS = ("bridge", "hooked", "nnsight")
ModelView.register_view(serves_nnsight, NnsightView)  # ModelView(lm) on an nnsight model builds an NnsightView
NNSIGHT_VERSION = "0.8.1"  # the version the nnsight backend is tested with (pyproject.toml pins it)


def hooked_class() -> Any:
    """TransformerLens's ``HookedTransformer`` class, or None where the installed
    TransformerLens (4.x) has none."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from transformer_lens import HookedTransformer
    except ImportError:
        return None
    return HookedTransformer


def default_backend() -> str:
    """``"hooked"`` where the installed TransformerLens has ``HookedTransformer`` (3.x),
    ``"bridge"`` otherwise (4.x)."""
    return "hooked" if hooked_class() is not None else "bridge"


def check_backend(backend: str | None) -> str:
    """``backend`` checked (None: :func:`default_backend`); ``"hooked"`` on TransformerLens
    4.x is a :class:`MassiveLensError` saying what to install."""
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise MassiveLensError(f"unknown backend {backend!r}; choose 'bridge' (TransformerBridge), 'hooked' "
                               "(HookedTransformer, TransformerLens 3.x) or 'nnsight' (an nnsight TransformersModel)")
    if backend == "nnsight" and importlib.util.find_spec("nnsight") is None:
        raise MassiveLensError(f"backend='nnsight' needs nnsight: pip install nnsight=={NNSIGHT_VERSION}")
    if backend == "hooked" and hooked_class() is None:
        import transformer_lens

        version = getattr(transformer_lens, "__version__", "4.x")
        raise MassiveLensError(
            f"backend='hooked' needs TransformerLens 3.x (HookedTransformer); the installed TransformerLens "
            f"{version} removed it. Use backend='bridge' (the same numbers), or install "
            "'transformer-lens>=3,<4' (what SAELens 6.x requires)")
    return backend


def hooked_from_hf(hf_model: Any, tokenizer: Any, name: str, *, device: Any = None,
                   dtype: torch.dtype = torch.float32) -> Any:
    """A ``HookedTransformer`` with the weights of ``hf_model`` and no weight processing.

    Args:
        hf_model: a loaded Hugging Face causal LM (read, not changed).
        tokenizer: its tokenizer, used as it is.
        name: the model's name: a TransformerLens name (``"gpt2"``) takes
            ``from_pretrained_no_processing``; any other is converted by its architecture.
        device: where the HookedTransformer goes; None: where ``hf_model`` is.
        dtype: its floating dtype.

    Returns:
        A ``HookedTransformer`` in eval mode, ``cfg.model_name`` set to ``name``.

    Raises:
        MassiveLensError: on TransformerLens 4.x, or for an architecture that TransformerLens
            cannot convert into a ``HookedTransformer``.
    """
    cls = hooked_class()
    if cls is None:
        check_backend("hooked")
    from transformer_lens import loading_from_pretrained as loading

    if device is None:
        device = next(hf_model.parameters()).device
    official = _official_name(loading, name)
    architecture = (getattr(hf_model.config, "architectures", None) or [type(hf_model).__name__])[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TL 3.x: "HookedTransformer is deprecated"
            if official is not None:
                model = cls.from_pretrained_no_processing(official, hf_model=hf_model, tokenizer=tokenizer,
                                                          device=str(device), dtype=dtype)
            else:
                model = _convert(cls, loading, hf_model, tokenizer, device, dtype)
    except (ValueError, KeyError, NotImplementedError, AttributeError, AssertionError) as exc:
        raise MassiveLensError(
            f"TransformerLens cannot build a HookedTransformer for {name!r} (architecture {architecture}): "
            f"{type(exc).__name__}: {exc}. Use backend='bridge', which wraps the Hugging Face model itself"
        ) from exc
    except OSError as exc:
        raise MassiveLensError(f"could not build a HookedTransformer for {name!r}: {exc} (TransformerLens reads the "
                               "config of the models it lists by name from the hub: no network?); use "
                               "backend='bridge'") from exc
    model.cfg.model_name = readable_name(name)
    model.cfg.tokenizer_name = readable_name(name)
    return model.eval()


def nnsight_from_hf(hf_model: Any, tokenizer: Any, name: str, *, device: Any = None,
                    dtype: torch.dtype = torch.float32) -> Any:
    """An nnsight ``TransformersModel`` (text generation) over ``hf_model``, whose weights it uses
    as they are: the analyses read it through :class:`~massive_lens.core.nnsight_view.NnsightView`.

    Args:
        hf_model: a loaded Hugging Face causal LM (moved to ``device`` and ``dtype``, put in eval
            mode, its ``config.name_or_path`` set to ``name``).
        tokenizer: its tokenizer (nnsight pads on the left; massive_lens tokenizes for itself,
            on the right, so positions are never shifted).
        name: the model's name in results.
        device: where it goes; None: where it is.
        dtype: its floating dtype.

    Returns:
        The nnsight model.

    Raises:
        MassiveLensError: when nnsight is not installed or the model has no tokenizer.
    """
    check_backend("nnsight")
    if tokenizer is None:
        raise MassiveLensError(f"backend='nnsight' needs a tokenizer for {name!r}; pass tokenizer= to load_model")
    import nnsight

    hf_model = hf_model.to(dtype) if dtype != next(hf_model.parameters()).dtype else hf_model
    if device is not None:
        hf_model = hf_model.to(device)
    hf_model.config.name_or_path = name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nnsight.NNsightDeprecationWarning)
        return nnsight.TransformersModel(hf_model.eval(), task="text-generation", tokenizer=tokenizer)


def nnsight_as_found(model: Any, backend: str | None, device: Any, dtype: torch.dtype | None, device_map: Any) -> Any:
    """A user's own nnsight model, returned as it is after :func:`as_found`'s checks on the torch
    module inside it; an explicit other ``backend`` is an error."""
    if backend not in (None, "nnsight"):
        raise MassiveLensError(f"this model is an nnsight {type(model).__name__} and load_model does not convert a "
                               f"model it is given, so backend={backend!r} would be ignored; drop backend=")
    as_found(ModelView(model).hf, device, dtype, device_map)
    return model


def _official_name(loading: Any, name: str) -> str | None:
    try:
        return loading.get_official_model_name(name)
    except ValueError:
        return None


def _convert(cls: Any, loading: Any, hf_model: Any, tokenizer: Any, device: Any, dtype: torch.dtype) -> Any:
    """TransformerLens's config reading and weight conversion for a model it does not list by
    name: both read a local folder, so the config (JSON only) is written to a temporary one."""
    hf_cfg = {k: v for k, v in hf_model.config.to_dict().items() if v is not None}
    with tempfile.TemporaryDirectory(prefix="massive_lens_hf_config_") as folder:
        # TransformerLens picks some configs by substrings of the path ("llama", "gemma"): a neutral name
        folder = os.path.join(folder, "config")
        config = copy.deepcopy(hf_model.config)  # the user's config stays as it is
        config.architectures = config.architectures or [type(hf_model).__name__]
        if hasattr(config, "n_positions") and "n_ctx" not in config.to_dict():  # TL 3.x reads GPT-2's old n_ctx
            config.n_ctx = config.n_positions
        config.save_pretrained(folder)
        with hub_offline():
            cfg = loading.get_pretrained_model_config(folder, hf_cfg=hf_cfg, fold_ln=False, device=str(device),
                                                      dtype=dtype)
            state_dict = loading.get_pretrained_state_dict(folder, cfg, hf_model=hf_model, dtype=dtype)
    model = cls(cfg, tokenizer=tokenizer, move_to_device=True)
    model.load_and_process_state_dict(state_dict, fold_ln=False, center_writing_weights=False, center_unembed=False,
                                      fold_value_biases=False, refactor_factored_attn_matrices=False)
    return model


@contextlib.contextmanager
def hub_offline():
    """Hugging Face hub calls off (``HF_HUB_OFFLINE=1``) inside the block; restored after.
    huggingface_hub reads the variable once, at import: its flag is switched too."""
    saved, flag = os.environ.get("HF_HUB_OFFLINE"), hf_constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hf_constants.HF_HUB_OFFLINE = flag
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


def unsupported(name: str, architecture: str | None, exc: Exception) -> MassiveLensError:
    try:
        from transformer_lens.model_bridge.supported_architectures import __all__ as known

        available = ", ".join(sorted(a.replace("ArchitectureAdapter", "") for a in known)[:60])
    except ImportError:  # pragma: no cover
        available = "see TransformerLens's supported architectures"
    return MassiveLensError(
        f"TransformerLens could not wrap {name!r} (architecture {architecture or 'unknown'}): "
        f"{type(exc).__name__}: {exc}. Supported architecture adapters: {available}"
    )


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise MassiveLensError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved


def check_device(device: Any) -> None:
    """Refuse a ``device`` torch cannot parse, before anything is loaded."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise MassiveLensError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:1'") from exc
    if (kind == "cuda" and not torch.cuda.is_available()) or (kind == "mps" and not torch.backends.mps.is_available()):
        raise MassiveLensError(f"device {device!r}: this torch ({torch.__version__}) sees no {kind} device; use "
                               f"device='cpu', or install a torch build for {kind}")


def as_found(model: Any, device: Any, dtype: torch.dtype | None, device_map: Any) -> Any:
    """A model passed in is used where and as it is: refuse ``device``/``dtype``/``device_map``
    that would need it converted, rather than ignore them."""
    param = next(iter(model.parameters()), None)
    kind = type(model).__name__
    if device_map is not None:
        raise MassiveLensError(f"device_map applies to models loaded by name; this {kind} is already loaded. "
                               "Dispatch it yourself, or load it by name with device_map=")
    if dtype is not None and param is not None and param.dtype != dtype:
        raise MassiveLensError(
            f"this {kind} is in {param.dtype} and load_model does not convert a model it is given, so "
            f"dtype={dtype} would be ignored; convert it yourself (model.to({dtype}), which changes it for "
            "everyone holding it) or load it by name with dtype="
        )
    if device is not None and param is not None:
        try:
            want = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise MassiveLensError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:1'") from exc
        if want.type != param.device.type or want.index not in (None, param.device.index):
            raise MassiveLensError(
                f"this {kind} is on {param.device} and load_model does not move a model it is given, so "
                f"device={device!r} would be ignored; move it yourself (model.to({str(want)!r})) or load it "
                "by name with device="
            )
    return model
