"""The model-lock rule, read from the package's source (used by ``test_model_lock_rule.py``).

Every statement that edits a model for longer than one operation (swaps a parameter's
``.data``, replaces a buffer, parameter or module in ``_buffers``/``_parameters``/``_modules``,
writes into a weight by index, loads a state dict, casts with ``.half()``/``.bfloat16()``,
edits a tensor in place under ``torch.no_grad()``, or ``setattr`` on another object) must run
while the model's lock is held: inside ``with model_lock(...)`` (or after it in the same
``with``), in a function that acquires the lock itself, or in a function every caller of which
is, transitively, in one of those places. A function with no caller in the package (a public
entry point) that edits without the lock breaks the rule.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import syntax

IN_PLACE = {"copy_", "add_", "sub_", "mul_", "div_", "zero_", "fill_", "clamp_", "normal_", "uniform_",
            "masked_fill_", "index_fill_", "index_copy_", "requires_grad_"}
SLOTS = {"_buffers", "_parameters", "_modules"}


@dataclass
class Function:
    module: str  # dotted module name
    qualname: str  # Class.method or outer.<locals>.inner
    node: ast.AST
    parent: Function | None  # the enclosing function of a nested one
    is_method: bool
    edits: list[tuple[int, str, bool]] = field(default_factory=list)  # (line, what, locked here)
    refs: list[tuple[str, str, bool]] = field(default_factory=list)  # (kind: name/attr, name, locked here)
    acquires: bool = False

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def _is_lock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return ((isinstance(f, ast.Name) and f.id == "model_lock")
            or (isinstance(f, ast.Attribute) and f.attr == "model_lock"))


def _is_no_grad(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "no_grad"


def _target_edit(target: ast.AST, no_grad: bool) -> str | None:
    if isinstance(target, ast.Attribute) and target.attr == "data":
        return "swaps a tensor's .data"
    if isinstance(target, ast.Subscript):
        base = target.value
        if isinstance(base, ast.Attribute) and base.attr in SLOTS:
            return f"replaces an entry of {base.attr}"
        if no_grad:  # a parameter is written by index only where autograd is off
            return "writes into a tensor by index"
    return None


def _call_edit(call: ast.Call, no_grad: bool) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and f.id == "setattr" and call.args and not (
            isinstance(call.args[0], ast.Name) and call.args[0].id == "self"):
        return "setattr on another object"
    if not isinstance(f, ast.Attribute):
        return None
    if f.attr == "load_state_dict":
        return "loads a state dict"
    if f.attr in ("half", "bfloat16") and not call.args:
        return f"casts with .{f.attr}()"
    if f.attr in IN_PLACE and no_grad:
        return f"edits a tensor in place (.{f.attr}) under no_grad"
    return None


class _Reader(ast.NodeVisitor):
    """One module's functions, their edits and their references to names."""

    def __init__(self, module: str):
        self.module = module
        self.functions: list[Function] = []
        self.top_refs: list[tuple[str, str, bool]] = []  # references at module or class level
        self.imports: dict[str, str] = {}  # local name -> dotted "module:name" or "module"
        self._stack: list[Function] = []
        self._classes: list[str] = []
        self._locked = 0
        self._no_grad = 0

    # --- scopes
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        parent = self._stack[-1] if self._stack else None
        prefix = f"{parent.qualname}.<locals>." if parent else (".".join(self._classes) + "." if self._classes else "")
        fn = Function(self.module, prefix + node.name, node, parent, bool(self._classes) and parent is None)
        if parent is not None:  # the enclosing function refers to (defines, hands out) its nested one
            parent.refs.append(("name", node.name, self._locked > 0))
        self.functions.append(fn)
        self._stack.append(fn)
        saved, self._locked, self._no_grad = (self._locked, self._no_grad), 0, 0
        for child in node.body:
            self.visit(child)
        self._locked, self._no_grad = saved
        self._stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node.name)
        self.generic_visit(node)
        self._classes.pop()

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.generic_visit(node)

    # --- imports
    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.imports[alias.asname or alias.name] = f"{node.module}:{alias.name}"

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports[alias.asname or alias.name.split(".")[0]] = alias.name

    # --- with blocks
    def _with(self, node: ast.With | ast.AsyncWith) -> None:
        locked_from = next((i for i, item in enumerate(node.items) if _is_lock_call(item.context_expr)), None)
        no_grad = any(_is_no_grad(item.context_expr) for item in node.items)
        for i, item in enumerate(node.items):
            bump = locked_from is not None and i > locked_from
            self._locked += bump
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.visit(item.optional_vars)
            self._locked -= bump
        self._locked += locked_from is not None
        self._no_grad += no_grad
        for child in node.body:
            self.visit(child)
        self._locked -= locked_from is not None
        self._no_grad -= no_grad

    visit_With = visit_AsyncWith = _with

    # --- edits and references
    def _edit(self, line: int, what: str) -> None:
        if self._stack:
            self._stack[-1].edits.append((line, what, self._locked > 0))
        else:
            raise AssertionError(f"{self.module}:{line}: a model edit at module level ({what})")

    def _ref(self, kind: str, name: str) -> None:
        (self._stack[-1].refs if self._stack else self.top_refs).append((kind, name, self._locked > 0))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            for t in ast.walk(target):
                what = _target_edit(t, self._no_grad > 0)
                if what:
                    self._edit(node.lineno, what)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        what = _target_edit(node.target, self._no_grad > 0)
        if what:
            self._edit(node.lineno, what)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        what = _call_edit(node, self._no_grad > 0)
        if what:
            self._edit(node.lineno, what)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "acquire" and self._stack:
            self._stack[-1].acquires = True
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._ref("name", node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            self._ref("attr", node.attr)
        self.generic_visit(node)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _read(module: str, source: str) -> _Reader:
    reader = _Reader(module)
    reader.visit(syntax.parse(source))
    return reader


def read_sources(sources: dict[str, str]) -> list[_Reader]:
    """``{dotted module name: source}`` to one reader per module (the readers are not changed later)."""
    return [_read(module, source) for module, source in sources.items()]


def package_sources(root: Path) -> dict[str, str]:
    return {_module_name(root, p): p.read_text() for p in sorted(root.rglob("*.py"))}


def _holds_lock(fn: Function) -> bool:
    """The function takes the lock itself (``lock = model_lock(m); lock.acquire()``)."""
    calls_lock = any(_is_lock_call(n) for n in ast.walk(fn.node))
    return calls_lock and fn.acquires


Refs = dict[str, list[tuple[_Reader, Function | None, str, bool]]]


def _index(readers: list[_Reader]) -> Refs:
    """Every reference by the name it refers to: (module, the function it is in, kind, locked)."""
    out: Refs = {}
    for reader in readers:
        for owner, refs in [(None, reader.top_refs), *((f, f.refs) for f in reader.functions)]:
            for kind, name, locked in refs:
                out.setdefault(name, []).append((reader, owner, kind, locked))
    return out


def _callers(fn: Function, refs: Refs) -> Iterator[tuple[Function | None, bool]]:
    """(caller, whether the reference is under the lock there) for every reference to ``fn``;
    a caller of None is a reference at module or class level (a registry, an alias)."""
    for reader, owner, kind, locked in refs.get(fn.name, []):
        if owner is fn:
            continue
        same = reader.module == fn.module
        source, _, imported_name = reader.imports.get(fn.name, "").partition(":")
        imported = imported_name == fn.name and (fn.module + ".").startswith(source + ".")  # re-exports too
        module_imported = any(v == fn.module or v.replace(":", ".") == fn.module for v in reader.imports.values())
        if fn.parent is not None:  # a nested function is reached through its enclosing one
            if owner is fn.parent or (owner is not None and owner.parent is fn.parent):
                yield owner, locked
        elif kind == "name" and (same or imported):
            yield owner, locked
        elif kind == "attr" and (fn.is_method or module_imported or same):
            yield owner, locked


def violations(readers: list[_Reader], allowed: dict[str, str] = {}) -> list[str]:  # noqa: B006 - read only
    """Every edit that can run without the model's lock, with the unlocked path that reaches it."""
    functions = [f for r in readers for f in r.functions]
    refs = _index(readers)

    def unlocked_path(fn: Function, visiting: frozenset[str]) -> list[str] | None:
        """None if every way into ``fn`` holds the lock; else one chain of callers without it."""
        if fn.key in allowed or _holds_lock(fn):
            return None
        visiting = visiting | {fn.key}  # a caller on the chain already (recursion, super()) is no way in
        callers = [(c, locked) for c, locked in _callers(fn, refs) if c is None or c.key not in visiting]
        if not callers:
            return [fn.key + " (no caller in the package: an entry point)"]
        for caller, locked in callers:
            if locked:
                continue
            if caller is None:
                return [fn.key + " (referenced at module level)"]
            path = unlocked_path(caller, visiting)
            if path is not None:
                return [fn.key, *path]
        return None

    out = []
    for fn in functions:
        for line, what, locked in fn.edits:
            if locked:
                continue
            path = unlocked_path(fn, frozenset())
            if path is not None:
                out.append(f"{fn.module}:{line} {what}, reached without model_lock: " + " <- ".join(path))
    return out


def editing_functions(readers: list[_Reader]) -> set[str]:
    return {f.key for r in readers for f in r.functions if f.edits}
