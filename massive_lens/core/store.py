"""Saving results to a folder (loading them back, without the model: :mod:`massive_lens.core.restore`).

A saved result is a folder (see ``docs/results.md``) holding

- ``manifest.json``: the format name and version, the result type, the library version, the
  summary, and every field: scalars, strings, lists and dicts as JSON; nested dataclasses
  (``Criterion``, ``SinkSet``, ...) as ``{"$dataclass": "module:Class", "fields": {...}}``;
  the other values as small tagged objects (``{"$tensor": key}``, ``{"$frame": file}``,
  ``{"$tuple": [...]}``, ``{"$float": "nan"}``, ...);
- ``frames/<field>.parquet``: one Parquet file per DataFrame;
- ``tensors.safetensors``: every tensor, under keys that follow the field path (``sink_z``,
  ``dims.5``, ``sinks.mask``, ``model.state.blocks.0.attn.W_Q``).

The folder is written under a temporary name beside the target and renamed into place, so a
crash leaves either the whole result or nothing. :func:`load` finds the result class by the
name in the manifest, among the classes registered by :class:`~massive_lens.core.results.Result`
(every subclass registers itself), and nested dataclasses among the ``massive_lens`` modules
already imported (``import massive_lens`` imports them all); ``core`` imports no analysis.

A class whose fields are not all storable (``TrainRun`` holds a model) overrides
``_stored_fields`` and ``_from_stored``, the two hooks this module calls.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import re
import shutil
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import save_file

from massive_lens.errors import MassiveLensError

FORMAT = "massive_lens.result"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
FRAMES = "frames"

RESULT_CLASSES: dict[str, type] = {}  # "module.Qualname" -> result class, filled by Result.__init_subclass__


def inside(folder: Path, name: str) -> Path:
    """``folder / name`` when it lies inside ``folder``, links followed (a saved result's own file).

    Raises:
        MassiveLensError: for an absolute name, a ``..`` in it, or a link that leads out of ``folder``.
    """
    path = folder / name
    if ".." in Path(name).parts or Path(name).is_absolute() or \
            not path.resolve().is_relative_to(folder.resolve()):
        raise MassiveLensError(f"the saved result in {folder} names a file outside its folder ({name!r}"
                               f"{', a link to ' + str(path.resolve()) if path.is_symlink() else ''}); it is not "
                               "read: load only results saved by massive_lens, or save the result again")
    return path


def read_json(path: str | os.PathLike, *, max_bytes: int, what: str, fix: str) -> Any:
    """The JSON value in the file ``path``, read only if it is a regular file of at most ``max_bytes``.

    Args:
        path: the file.
        max_bytes: the largest file read (checked before reading: a device or a huge file is refused).
        what: what the file should be, for messages (``"a massive dims file"``).
        fix: what to do instead, for messages.

    Raises:
        MassiveLensError: for a missing file, a folder or device, a larger file, text that is not
            UTF-8 JSON, or JSON nested too deeply to read.
    """
    path = Path(path)
    if not path.is_file():
        state = "does not exist" if not path.exists() else "is a folder" if path.is_dir() else "is not a regular file"
        raise MassiveLensError(f"cannot read {path} as {what}: it {state}; {fix}")
    size = path.stat().st_size
    if size > max_bytes:
        raise MassiveLensError(f"cannot read {path} as {what}: {size:,} bytes, more than the {max_bytes:,} such a "
                               f"file can hold; {fix}")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise MassiveLensError(f"cannot read {path} as {what}: it grew past {max_bytes:,} bytes; {fix}")
        return json.loads(raw.decode("utf-8"))
    except RecursionError as err:
        raise MassiveLensError(f"cannot read {path} as {what}: its JSON is nested too deeply; {fix}") from err
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MassiveLensError(f"cannot read {path} as {what} ({type(err).__name__}: {str(err)[:120]}); "
                               f"{fix}") from err


def register(cls: type) -> None:
    """Make ``cls`` loadable by name (called for every subclass of ``Result``).

    Args:
        cls: the result class.

    Returns:
        None.
    """
    RESULT_CLASSES[f"{cls.__module__}.{cls.__qualname__}"] = cls


def stored_fields(obj: Any) -> dict[str, Any]:
    """The values a dataclass is saved as: its ``__init__`` fields, or what its
    ``_stored_fields()`` hook returns.

    Args:
        obj: a dataclass instance.

    Returns:
        Field name -> value.
    """
    hook = getattr(obj, "_stored_fields", None)
    if hook is not None:
        return hook()
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def build(cls: type, values: dict[str, Any]) -> Any:
    """A dataclass rebuilt from saved field values (its ``_from_stored`` hook when it has one).

    Fields saved by another version and unknown to ``cls`` are dropped with a warning;
    fields missing from ``values`` take their defaults.

    Args:
        cls: the dataclass.
        values: field name -> decoded value.

    Returns:
        The instance.

    Raises:
        MassiveLensError: if a required field is missing or the class rejects a value.
    """
    hook = getattr(cls, "_from_stored", None)
    if hook is not None:
        return hook(values)
    return build_dataclass(cls, values)


def build_dataclass(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` for the fields ``cls`` knows: :func:`build` without the class's
    ``_from_stored`` hook (which calls this); same arguments and errors."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        warnings.warn(f"{cls.__name__}: ignoring saved fields this version does not have: {unknown}", stacklevel=3)
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.init and f.name not in values
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise MassiveLensError(f"the saved {cls.__name__} lacks the fields {missing}; was it saved by an "
                               "older massive_lens? Recompute the result")
    try:
        return cls(**{k: v for k, v in values.items() if k in known})
    except (TypeError, ValueError) as err:
        raise MassiveLensError(f"cannot rebuild the saved {cls.__name__}: {err}") from err


# --------------------------------------------------------------------------------- saving


class _Writer:
    """Collects the tensors and frames met while encoding the fields."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.frames: dict[str, pd.DataFrame] = {}
        self._storages: set[int] = set()
        self._frame_stems: dict[str, None] = {}

    def tensor(self, key: str, value: torch.Tensor) -> str:
        key = _unique(key, self.tensors)
        t = value.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        if storage in self._storages or t.numel() == 0:  # safetensors refuses tensors sharing memory
            t = t.clone()
        self._storages.add(storage)
        self.tensors[key] = t
        return key

    def frame(self, key: str, value: pd.DataFrame) -> str:
        stem = _unique(re.sub(r"[^A-Za-z0-9_.-]", "_", key), self._frame_stems)
        self._frame_stems[stem] = None
        name = f"{FRAMES}/{stem}.parquet"
        self.frames[name] = value
        return name


def _unique(key: str, taken: dict[str, Any]) -> str:
    out, n = key, 1
    while out in taken:
        n += 1
        out = f"{key}~{n}"
    return out


def _encode(value: Any, key: str, writer: _Writer) -> Any:
    """``value`` as JSON, its tensors and frames handed to ``writer`` under ``key``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, np.generic):
        return _encode(value.item(), key, writer)
    if isinstance(value, torch.Tensor):
        return {"$tensor": writer.tensor(key, value)}
    if isinstance(value, np.ndarray) and value.dtype != object:
        return {"$ndarray": writer.tensor(key, torch.from_numpy(np.ascontiguousarray(value)))}
    if isinstance(value, pd.DataFrame):  # its columns kept beside it: a table swapped for another is refused at load
        return {"$frame": writer.frame(key, value), "columns": [str(c) for c in value.columns]}
    if isinstance(value, pd.Series):
        name = value.name
        return {"$series": writer.frame(key, value.to_frame("value")), "name": _encode(name, key + ".name", writer)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, PurePath):
        return {"$path": str(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {name: _encode(v, f"{key}.{name}" if key else name, writer)
                  for name, v in stored_fields(value).items()}
        return {"$dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, f"{key}.{i}", writer) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}.{i}", writer) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, f"{key}.{k}", writer) for k, v in value.items()}
        return {"$dict": [[_encode(k, f"{key}.{k}", writer), _encode(v, f"{key}.{k}", writer)]
                          for k, v in value.items()]}
    raise MassiveLensError(
        f"cannot save the field {key!r}: a {type(value).__name__} is not a tensor, DataFrame, "
        "dataclass, number, string or container of those"
    )


def library_version() -> str:
    """The installed massive_lens version (``"unknown"`` in a source checkout not installed)."""
    try:
        return importlib.metadata.version("massive_lens")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout not installed
        return "unknown"


def _is_saved_result(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_target(target: Path, overwrite: bool) -> None:
    if target.is_file() or target.is_symlink():
        raise MassiveLensError(f"{target} is a file; save a result to a folder path (it is created)")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not overwrite:
        raise MassiveLensError(f"{target} exists and is not empty; choose a new folder or pass overwrite=True")
    if not _is_saved_result(target):
        raise MassiveLensError(
            f"{target} holds files that are not a saved result; overwrite=True only replaces a saved "
            "result, so remove the folder yourself or choose another path"
        )


def _sync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write(result: Any, folder: Path) -> None:
    writer = _Writer()
    cls = type(result)
    fields = {name: _encode(v, name, writer) for name, v in stored_fields(result).items()}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "type": cls.__qualname__,
        "module": cls.__module__,
        "library_version": library_version(),
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "summary": result.summary(),
        "files": {"tensors": TENSORS if writer.tensors else None, "frames": sorted(writer.frames)},
        "fields": fields,
    }
    if writer.frames:
        (folder / FRAMES).mkdir()
    for name, frame in writer.frames.items():
        try:
            frame.to_parquet(folder / name)
        except (ValueError, TypeError, ImportError) as err:  # pyarrow errors derive from these
            raise MassiveLensError(f"cannot write the table {name} as Parquet: {err}") from err
        _sync(folder / name)
    if writer.tensors:
        save_file(writer.tensors, str(folder / TENSORS), metadata={"format": FORMAT})
        _sync(folder / TENSORS)
    text = json.dumps(manifest, indent=1, allow_nan=False, ensure_ascii=False)
    (folder / MANIFEST).write_text(text + "\n", encoding="utf-8")
    _sync(folder / MANIFEST)


def _fresh(target: Path, what: str) -> Path:
    """A new hidden folder beside ``target`` (same file system, so renames are atomic)."""
    folder = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.{what}"
    folder.mkdir()
    return folder


def save_result(result: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save a result to the folder ``path`` (the format is in the module docstring).

    Args:
        result: a result (a dataclass; ``Result.save`` calls this).
        path: the folder to create; missing parents are created.
        overwrite: replace ``path`` when it already holds a saved result.

    Returns:
        The folder, as a ``Path``.

    Raises:
        MassiveLensError: if ``path`` is a file, a non-empty folder (without ``overwrite``),
            a folder holding something other than a saved result, or a field cannot be saved.
    """
    target = Path(path)
    _check_target(target, overwrite)
    try:  # a folder that cannot be created or written (/proc, read-only, a file on the way): said as such
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _fresh(target, "saving")
    except OSError as exc:
        raise MassiveLensError(f"cannot save to {target}: {exc.strerror or exc}; choose a folder you can "
                               "write") from None
    old = None
    try:
        _write(result, tmp)
        if target.is_dir():
            if any(target.iterdir()):  # a saved result, checked above: move it aside, then drop it
                old = _fresh(target, "old")
                os.replace(target, old / "result")
            else:
                target.rmdir()
        os.replace(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():
            os.replace(old / "result", target)
        if isinstance(exc, OSError):  # a full disk, a folder made read-only meanwhile
            raise MassiveLensError(f"cannot save to {target}: {exc.strerror or exc}; nothing was left "
                                   "half-written; choose a folder you can write") from None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target
