"""Loading saved results back, without the model (the folder format: :mod:`massive_lens.core.store`).

:func:`load` finds the result class by the name in the manifest among the classes registered
by :class:`~massive_lens.core.results.Result`, and nested dataclasses among the
``massive_lens`` modules already imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file

from massive_lens.core.store import _TYPES, FORMAT, FORMAT_VERSION, MANIFEST, TENSORS, _library_version, build
from massive_lens.errors import MassiveLensError


def _attr(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _find_class(module: str, qualname: str, what: str, registered: bool = False) -> type:
    """A registered result class (or, unless ``registered``, a dataclass of a loaded
    massive_lens module) by module and name; by name alone when the module has moved."""
    found = _TYPES.get(f"{module}.{qualname}")
    if found is None and registered:
        unique = {c for c in _TYPES.values() if c.__qualname__ == qualname and c.__module__.startswith("massive_lens.")}
        found = unique.pop() if len(unique) == 1 else None
    elif found is None:
        candidates = [c for c in _TYPES.values() if c.__qualname__ == qualname]
        if module.startswith("massive_lens.") or module == "massive_lens":
            candidates += [_attr(sys.modules.get(module), qualname)]
        candidates += [_attr(m, qualname) for name, m in list(sys.modules.items())
                       if name.startswith("massive_lens.") and name != module]
        unique = {c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)
                  and c.__module__.startswith("massive_lens.")}
        found = unique.pop() if len(unique) == 1 else None
    if found is None:
        raise MassiveLensError(
            f"unknown {what} {module}.{qualname} in the saved result; it was saved by a massive_lens "
            "that has this type: load it with that version (or import the module defining it first)"
        )
    return found


class _Reader:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._tensors: dict[str, torch.Tensor] | None = None

    def tensor(self, key: str) -> torch.Tensor:
        if self._tensors is None:
            path = self.folder / TENSORS
            if not path.is_file():
                raise MassiveLensError(f"{path} is missing: the saved result in {self.folder} is incomplete")
            self._tensors = load_file(str(path))
        if key not in self._tensors:
            raise MassiveLensError(f"{self.folder / TENSORS} has no tensor {key!r}: the saved result is damaged")
        return self._tensors[key]

    def frame(self, name: str) -> pd.DataFrame:
        path = self.folder / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise MassiveLensError(f"the manifest in {self.folder} names a table outside its folder: {name!r}")
        if not path.is_file():
            raise MassiveLensError(f"{path} is missing: the saved result in {self.folder} is incomplete")
        return pd.read_parquet(path)


def _decode(value: Any, reader: _Reader) -> Any:
    if isinstance(value, list):
        return [_decode(v, reader) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return reader.tensor(value["$tensor"])
    if "$ndarray" in value:
        return reader.tensor(value["$ndarray"]).numpy()
    if "$frame" in value:
        return reader.frame(value["$frame"])
    if "$series" in value:
        return reader.frame(value["$series"])["value"].rename(_decode(value.get("name"), reader))
    if "$float" in value:
        return float(value["$float"])
    if "$dtype" in value:
        return getattr(torch, value["$dtype"])
    if "$path" in value:
        return Path(value["$path"])
    if "$tuple" in value:
        return tuple(_decode(v, reader) for v in value["$tuple"])
    if "$dict" in value:
        return {_hashable(_decode(k, reader)): _decode(v, reader) for k, v in value["$dict"]}
    if "$dataclass" in value:
        module, _, qualname = value["$dataclass"].partition(":")
        cls = _find_class(module, qualname, "dataclass")
        return build(cls, {k: _decode(v, reader) for k, v in value["fields"].items()})
    return {k: _decode(v, reader) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of the saved result in the folder ``path``.

    Args:
        path: a folder written by ``result.save(path)``.

    Returns:
        The manifest, as a dict (``type``, ``library_version``, ``summary``, ``fields``, ...).

    Raises:
        MassiveLensError: if ``path`` holds no saved result or one in a newer format.
    """
    folder = Path(path)
    file = folder / MANIFEST
    if not file.is_file():
        what = "does not exist" if not folder.exists() else f"holds no saved result (no {MANIFEST})"
        raise MassiveLensError(f"{folder} {what}; save a result with result.save(path) and load that folder")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise MassiveLensError(f"{file} is not valid JSON ({err}): the saved result is damaged") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise MassiveLensError(f"{file} is not the manifest of a saved massive_lens result")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise MassiveLensError(f"{file} has no valid format_version: the saved result is damaged")
    if version > FORMAT_VERSION:
        raise MassiveLensError(
            f"{folder} was saved in format version {version} by massive_lens "
            f"{manifest.get('library_version', '?')}; this massive_lens ({_library_version()}) reads up "
            f"to version {FORMAT_VERSION}: upgrade massive_lens to load it"
        )
    if not isinstance(manifest.get("type"), str) or not isinstance(manifest.get("fields"), dict):
        raise MassiveLensError(f"{file} names no result type or fields: the saved result is damaged")
    return manifest


def load(path: str | os.PathLike) -> Any:
    """Load a result saved with ``result.save(path)``; no model is needed.

    The loaded result has the same ``summary()``, ``to_frame()`` and ``plot()`` as the one
    saved; its tensors are on the CPU. The format is described in ``docs/results.md``.

    Args:
        path: the folder written by ``result.save(path)``.

    Returns:
        The result, of the type it was saved as (``MassiveActivations``, ``OriginTrace``, ...).

    Raises:
        MassiveLensError: if ``path`` holds no saved result, a damaged one, one of a type this
            version does not know, or one written in a newer format version.

    >>> import tempfile
    >>> from massive_lens import find_massive, load, tiny_model
    >>> found = find_massive(tiny_model("llama"), "Hello, world.")
    >>> folder = found.save(tempfile.mkdtemp() + "/found")
    >>> again = load(folder)
    >>> again.summary() == found.summary(), again.to_frame().equals(found.to_frame())
    (True, True)
    """
    folder = Path(path)
    manifest = read_manifest(folder)
    module, qualname = manifest.get("module", ""), manifest["type"]
    cls = _find_class(module, qualname, "result type", registered=True)
    reader = _Reader(folder)
    return build(cls, {k: _decode(v, reader) for k, v in manifest["fields"].items()})
