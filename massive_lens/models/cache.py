"""The verified cache of converted weights: a folder under :func:`cache_dir` written beside its
final place and renamed into it, with a manifest of sizes and SHA-256 digests written last, so a
folder that does not match its manifest is rebuilt (:func:`cache_is_valid`, :func:`write_cache`);
:func:`file_lock` serialises the processes that convert or publish one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from massive_lens.errors import MassiveLensError

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def cache_dir() -> Path:
    """Where massive_lens caches converted weights (``$MASSIVE_LENS_CACHE`` moves it); a
    :class:`MassiveLensError` when that path is a file (or lies under one)."""
    root = os.environ.get("MASSIVE_LENS_CACHE")
    if root:
        folder = Path(root).expanduser()
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "massive_lens"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "MASSIVE_LENS_CACHE" if root else "the cache folder"
        raise MassiveLensError(f"{where} {str(folder)!r} is {'' if existing == folder else 'under '}a file "
                               f"({str(existing)!r}), not a folder; point MASSIVE_LENS_CACHE at a folder")
    return folder


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    entries = {}
    for file in sorted(folder.iterdir()):
        if file.name == "manifest.json" or not file.is_file():
            continue
        digest = hashlib.sha256()
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        entries[file.name] = {"size": file.stat().st_size, "sha256": digest.hexdigest()}
    return entries


def cache_is_valid(folder: Path) -> bool:
    """Whether ``folder`` holds a complete cache matching its manifest (sizes, then SHA-256)."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        expected = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    files = expected.get("files") if isinstance(expected, dict) else None  # anything odd: rebuild
    if not isinstance(files, dict) or expected.get("version") != CACHE_VERSION \
            or not any(n.endswith(".safetensors") for n in files):
        return False
    for name, meta in files.items():  # cheap size check first, then hashes
        file = folder / name
        size = meta.get("size") if isinstance(meta, dict) else None
        if not isinstance(size, int) or not file.is_file() or file.stat().st_size != size:
            log.warning("cache %s is incomplete (%s); rebuilding it", folder, name)
            return False
    if _manifest(folder) != files:
        log.warning("cache %s does not match its manifest; rebuilding it", folder)
        return False
    return True


def write_cache(folder: Path, hf: Any, tok: Any) -> bool:
    """Write to a temporary folder, add the manifest last, then rename into place; False (and
    a warning) when the disk refuses (read-only, full, missing permissions).

    Publishing holds a lock file beside the cache, so a folder another process has just
    renamed into place is kept (it is the same conversion), never removed; only a damaged one
    is moved aside and deleted.
    """
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp", dir=folder.parent))
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        manifest = {"version": CACHE_VERSION, "files": _manifest(tmp)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        with file_lock(folder, ".lock"):
            if cache_is_valid(folder):  # another process published it while we converted
                return True
            if folder.exists():  # damaged: out of the way in one rename, then deleted
                stale = Path(tempfile.mkdtemp(prefix=folder.name + ".stale", dir=folder.parent))
                folder.rename(stale / folder.name)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(folder)
        return True
    except OSError as exc:
        log.warning("could not write the model cache at %s (%s); using the converted model from memory", folder, exc)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(folder: Path, suffix: str) -> Iterator[None]:
    """An exclusive lock (``fcntl.flock``) on ``<folder><suffix>``; none where fcntl is missing."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + suffix), "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
