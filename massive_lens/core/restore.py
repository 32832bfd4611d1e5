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

from massive_lens.core.store import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    RESULT_CLASSES,
    TENSORS,
    build,
    inside,
    library_version,
)
from massive_lens.errors import MassiveLensError


def _attr(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _find_class(module: str, qualname: str, what: str, registered: bool = False) -> type:
    """A registered result class (or, unless ``registered``, a dataclass of a loaded
    massive_lens module) by module and name; by name alone when the module has moved."""
    found = RESULT_CLASSES.get(f"{module}.{qualname}")
    if found is None and registered:
        unique = {c for c in RESULT_CLASSES.values()
                  if c.__qualname__ == qualname and c.__module__.startswith("massive_lens.")}
        found = unique.pop() if len(unique) == 1 else None
    elif found is None:
        candidates = [c for c in RESULT_CLASSES.values() if c.__qualname__ == qualname]
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
            path = inside(self.folder, TENSORS)
            if not path.is_file():
                raise MassiveLensError(f"{path} is missing: the saved result in {self.folder} is incomplete")
            try:
                self._tensors = load_file(str(path))
            except Exception as err:  # noqa: BLE001 - safetensors' own error, OSError, ...
                raise MassiveLensError(f"{path} is not a readable safetensors file ({type(err).__name__}: "
                                       f"{str(err)[:120]}): the saved result is damaged") from err
        if key not in self._tensors:
            raise MassiveLensError(f"{self.folder / TENSORS} has no tensor {key!r}: the saved result is damaged")
        return self._tensors[key]

    def frame(self, name: str) -> pd.DataFrame:
        path = inside(self.folder, name)
        if not path.is_file():
            raise MassiveLensError(f"{path} is missing: the saved result in {self.folder} is incomplete")
        try:
            return pd.read_parquet(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises many kinds for a damaged or foreign file
            raise MassiveLensError(f"{path} is not a readable Parquet table ({type(err).__name__}: "
                                   f"{str(err)[:120]}): the saved result is damaged") from err


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
        frame = reader.frame(value["$frame"])
        want = value.get("columns")  # absent in a result saved before they were kept
        if want is not None and [str(c) for c in frame.columns] != want:
            raise MassiveLensError(f"{reader.folder / str(value['$frame'])} has the columns {list(frame.columns)}, not "
                                   f"{want} as saved: another table is in its place; the saved result is damaged")
        return frame
    if "$series" in value:
        return reader.frame(value["$series"])["value"].rename(_decode(value.get("name"), reader))
    if "$float" in value:
        return float(value["$float"])
    if "$dtype" in value:
        dtype = getattr(torch, str(value["$dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise MassiveLensError(f"the saved result in {reader.folder} names {value['$dtype']!r} as a dtype, which "
                                   "is not a torch dtype: the saved result is damaged")
        return dtype
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
    except RecursionError as err:
        raise MassiveLensError(f"{file} is nested too deeply to be a manifest: the saved result is damaged") from err
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
            f"{manifest.get('library_version', '?')}; this massive_lens ({library_version()}) reads up "
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
    try:
        fields = {k: _decode(v, reader) for k, v in manifest["fields"].items()}
    except RecursionError as err:
        raise MassiveLensError(f"{folder / MANIFEST} is nested too deeply: the saved result is damaged") from err
    check_field_types(cls, fields, folder)
    return build(cls, fields)


_CHECKED = {"DataFrame": pd.DataFrame, "Tensor": torch.Tensor, "str": str, "int": int, "float": (int, float),
            "bool": bool, "list": list, "dict": dict, "tuple": tuple}


def check_field_types(cls: type, fields: dict[str, Any], folder: Path) -> None:
    """Each field whose annotation is a plain type (a frame, a tensor, a number, a string, a
    container, optionally ``| None``) holds a value of that type, so a damaged manifest fails
    here rather than in a later ``summary()``."""
    annotations = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for name, value in fields.items():
        kinds = [k.strip() for k in annotations.get(name, "Any").split("|")]
        if value is None and "None" in kinds:
            continue
        wanted = [_CHECKED.get(k.split("[")[0].split(".")[-1]) for k in kinds if k != "None"]
        if not wanted or None in wanted:
            continue  # an annotation this check does not read: the class checks it
        if not isinstance(value, tuple(t for w in wanted for t in (w if isinstance(w, tuple) else (w,)))) \
                or (isinstance(value, bool) and bool not in wanted and "bool" not in kinds):
            raise MassiveLensError(f"the saved {cls.__name__} in {folder} has {type(value).__name__} for its field "
                                   f"{name!r} ({annotations[name]}): the saved result is damaged")
