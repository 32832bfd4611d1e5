"""The documentation site builds with ``mkdocs build --strict`` (broken links, missing pages,
unresolvable API references all fail it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_doctest_fences():
    sys.path.insert(0, str(ROOT / "docs"))
    pytest.importorskip("griffe")
    from griffe_doctests import fence_doctests

    assert fence_doctests("Intro.\n\n>>> 1 + 1\n2\n\nAfter.") == "Intro.\n\n```python\n>>> 1 + 1\n2\n```\n\nAfter."


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").is_file()
