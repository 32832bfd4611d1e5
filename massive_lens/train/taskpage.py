"""The sink-task answer page (being written)."""

from __future__ import annotations

from pathlib import Path


def write_page(root: str | Path, page: str | Path, check: bool = False) -> int:
    raise NotImplementedError
