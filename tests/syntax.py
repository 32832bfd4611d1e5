"""The package's source parsed once per test process: the static checks (tests/test_layout.py, test_rules.py,
test_safe_reading.py, lock_rule.py) each read every module's syntax tree; parsed and walked anew by each check,
that was ~13 parses of the package in one process. Keyed by the text itself, so a file planted or changed by a
test is parsed afresh. The trees are shared: callers only read them."""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def parse(text: str) -> ast.Module:
    """``ast.parse(text)``, once per text."""
    return ast.parse(text)


@functools.cache
def _walked(text: str) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(parse(text)))


def tree(file: Path) -> ast.Module:
    """The syntax tree of ``file`` (UTF-8)."""
    return parse(file.read_text(encoding="utf-8"))


def nodes(file: Path) -> tuple[ast.AST, ...]:
    """``ast.walk`` of :func:`tree`, in its order."""
    return _walked(file.read_text(encoding="utf-8"))


@functools.cache
def walk(module: ast.Module) -> tuple[ast.AST, ...]:
    """``ast.walk`` of a module's tree from :func:`tree`, once per tree (only for those: it keeps what it walked)."""
    return tuple(ast.walk(module))
