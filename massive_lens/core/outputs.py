"""Output paths, checked before the work starts.

An analysis that runs for minutes and then cannot write its result wastes the minutes, so
every entry point that writes (a report folder, a training run's folder, a CSV file) checks
its output path first: a folder must be, or become, a writable folder; a file must lie in a
folder that exists and must not be a folder itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from massive_lens.errors import MassiveLensError


def check_out_dir(out: str | os.PathLike | None, what: str = "out_dir") -> Path | None:
    """Create ``out`` if missing and prove it writable, before any work.

    Args:
        out: the folder (None: nothing is written, nothing to check).
        what: the argument's name, for the message.

    Returns:
        ``out`` as a Path (None for None).

    Raises:
        MassiveLensError: if ``out`` is a file, lies under a file, or cannot be written.

    >>> import tempfile
    >>> check_out_dir(Path(tempfile.mkdtemp()) / "new" / "run").is_dir()
    True
    """
    if out is None:
        return None
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MassiveLensError(f"{what} {str(out)!r} is a file, not a folder; give a folder path")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise MassiveLensError(f"{what} {str(out)!r} lies under the file {str(existing)!r}; give a folder path")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".massive_lens-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise MassiveLensError(f"cannot write to {what} {str(out)!r} ({exc.strerror or exc}); "
                               "give a folder you can write to") from exc
    return out


def check_out_file(path: str | os.PathLike, what: str = "the output file") -> Path:
    """Check that ``path`` can be written as a file, before any work (nothing is created).

    Args:
        path: the file to be written (an existing file is overwritten later).
        what: what the file is, for the message.

    Returns:
        ``path`` as a Path.

    Raises:
        MassiveLensError: if ``path`` is a folder, or its folder is missing, a file, or not
            writable.

    >>> import tempfile
    >>> check_out_file(Path(tempfile.mkdtemp()) / "freq.csv").name
    'freq.csv'
    """
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise MassiveLensError(f"{what} {str(path)!r} is a folder; give a file name")
    if not folder.is_dir():
        state = "is a file" if folder.exists() else "does not exist"
        raise MassiveLensError(f"the folder of {what} {str(path)!r} {state}; create it first or give another path")
    if not os.access(folder, os.W_OK):
        raise MassiveLensError(f"cannot write {what} {str(path)!r}: its folder is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise MassiveLensError(f"cannot overwrite {what} {str(path)!r}: it is read-only")
    return path
