"""Imports what ``massive_lens``'s modules import at their top (torch, transformers, pandas, ...) before
``massive_lens`` itself, so that those libraries load from their compiled bytecode.

The test run checks ``massive_lens``'s annotations through jaxtyping's import hook
(``--jaxtyping-packages`` in pyproject.toml). While the hook runs one of the package's modules, it points
``cache_from_source`` at bytecode files of its own name, and every library that module imports for the
first time misses its ``.pyc`` and is compiled from source (about 1,900 modules: sympy, torch, pandas,
matplotlib, transformers; 17 s of each test process's start, measured under load; with
``PYTHONDONTWRITEBYTECODE`` set, as on these machines, on every run). Loaded here first, outside the hook,
they are only looked up there. The package's own modules are still loaded, and checked, through the hook.
tests/conftest.py calls :func:`load` in each process that runs tests.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "massive_lens"


def _top_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (not in functions, classes or
    ``if TYPE_CHECKING:``)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody
                                  + [n for h in node.handlers for n in h.body])
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def dependencies(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: names taken from it}`` for each module outside ``package`` that its modules import at
    their top."""
    found: dict[str, set[str]] = {}
    for file in sorted(package.rglob("*.py")):
        for node in _top_level(ast.parse(file.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif node.level == 0 and node.module and node.module != "__future__":
                pairs = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in pairs:
                if module.split(".")[0] != package.name:
                    found.setdefault(module, set()).update({name} - {None, "*"})
    return found


def load(package: Path = PACKAGE) -> None:
    """Import each of :func:`dependencies` and the names taken from it (a lazy module, such as
    transformers', loads a name's module only when it is read). One that fails is left for the
    package's own import to report."""
    for module, names in sorted(dependencies(package).items()):
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        for name in sorted(names):
            try:
                getattr(loaded, name)
            except AttributeError:  # a submodule not loaded yet
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    continue
            except ImportError:
                continue
