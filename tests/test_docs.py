"""The documentation site builds with ``mkdocs build --strict`` (broken links, missing pages,
unresolvable API references all fail it), and the code examples in ``docs/`` and ``README.md``
import only the public API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

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


# ----------------------------------------------------------------- public imports in examples

# the namespaces with an __all__ (docs/architecture.md)
PUBLIC = ("massive_lens", "massive_lens.models", "massive_lens.detect", "massive_lens.attention", "massive_lens.origin",
          "massive_lens.quant", "massive_lens.interventions", "massive_lens.train",
          "massive_lens.viz", "massive_lens.report", "massive_lens.handover", "massive_lens.effects")
PYTHON_FENCES = ("python", "py", "python3", "pycon")
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[\w+-]*)")
_FROM = re.compile(r"^\s*(?:>>>\s*|\.\.\.\s*)?from\s+(?P<module>massive_lens[\w.]*)\s+import\s+(?P<names>.*)$")
_IMPORT = re.compile(r"^\s*(?:>>>\s*|\.\.\.\s*)?import\s+(?P<modules>massive_lens[\w.]*(?:\s+as\s+\w+)?"
                     r"(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*)")


def doc_files() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def python_blocks(text: str) -> list[tuple[int, list[str]]]:
    """The fenced Python code blocks of a Markdown text: (line number of the first code line, lines)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, start, body = opening["fence"], i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if opening["info"].lower() in PYTHON_FENCES:
            blocks.append((start + 1, body))
    return blocks


def massive_lens_imports(lines: list[str], first_line: int = 1) -> list[tuple[int, str, str | None]]:
    """Every ``from massive_lens... import a, b`` (one row per name) and ``import massive_lens...``
    (name None) in the code lines, with its line number; parenthesised names may span lines."""
    found, i = [], 0
    while i < len(lines):
        line_no, line = first_line + i, lines[i].split("#", 1)[0]
        if m := _FROM.match(line):
            names = m["names"]
            if names.strip().startswith("(") and ")" not in names:
                while ")" not in names and i + 1 < len(lines):
                    i += 1
                    names += " " + lines[i].split("#", 1)[0]
            for name in names.replace("(", " ").replace(")", " ").replace("\\", " ").split(","):
                if name.strip():
                    found.append((line_no, m["module"], name.split()[0]))
        elif m := _IMPORT.match(line):
            for part in m["modules"].split(","):
                found.append((line_no, part.split()[0], None))
        i += 1
    return found


def import_problem(module: str, name: str | None) -> str | None:
    """Why importing ``name`` from ``module`` (or ``module`` itself) breaks the public-API rule."""
    import importlib
    import types

    if module not in PUBLIC:
        return f"{module} is not public (import from {', '.join(PUBLIC)})"
    if name is None:
        return None
    if name == "*" or name.startswith("_"):
        return f"{name!r} is not a public name"
    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        return f"{module} has no {name!r}"
    if isinstance(obj, types.ModuleType) and obj.__name__ not in PUBLIC:
        return f"{obj.__name__} is not public"
    return None


def test_import_scanner_sees_every_form():
    text = ("Prose: from massive_lens.core import x\n\n```python\nfrom massive_lens import find_massive, load_model\n"
            "from massive_lens.train import (\n    MassiveLM,\n    _private,\n)\nimport massive_lens.core.fmt as fmt\n"
            ">>> from massive_lens.core.fmt import num  # doctest form\n```\n\n```bash\n"
            "python -c 'from massive_lens.core import fmt'\n```\n")
    (start, lines), = python_blocks(text)
    assert start == 4
    found = massive_lens_imports(lines, start)
    assert [(m, n) for _, m, n in found] == [
        ("massive_lens", "find_massive"), ("massive_lens", "load_model"), ("massive_lens.train", "MassiveLM"),
        ("massive_lens.train", "_private"), ("massive_lens.core.fmt", None), ("massive_lens.core.fmt", "num")]
    assert [import_problem(m, n) is None for _, m, n in found] == [True, True, True, False, False, False]
    assert import_problem("massive_lens", "core") == "massive_lens.core is not public"


def test_docs_examples_import_only_the_public_api():
    """Code blocks in docs/ and README.md import only from ``massive_lens`` and its public
    subpackages, only names that exist there, and nothing private."""
    problems, seen = [], 0
    for path in doc_files():
        for start, lines in python_blocks(path.read_text()):
            for line_no, module, name in massive_lens_imports(lines, start):
                seen += 1
                if why := import_problem(module, name):
                    problems.append(f"{path.relative_to(ROOT)}:{line_no}: {why}")
    assert seen > 20, f"the scanner found only {seen} imports; is it still reading the code blocks?"
    assert not problems, "\n".join(problems)
