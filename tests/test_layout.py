"""The package's layout keeps its rules: every internal import takes a name from the module that
defines it (only a package's ``__init__`` re-exports), and the check itself can fail."""

from __future__ import annotations

import ast
from pathlib import Path

import massive_lens

PACKAGE = Path(massive_lens.__file__).parent


def _module_file(root: Path, module: str) -> tuple[Path | None, bool]:
    """``(file, is_package)`` of a dotted module under ``root``'s parent."""
    path = root.parent.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py", True
    return (path.with_suffix(".py"), False) if path.with_suffix(".py").is_file() else (None, False)


def _defined(file: Path) -> set[str]:
    """The names a module binds itself at top level (functions, classes, assignments), not imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def passed_on(root: Path) -> list[str]:
    """``file:line name from module`` for each import that takes ``name`` through a plain
    module that does not define it."""
    found = []
    for file in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == root.name):
                continue
            source, is_package = _module_file(root, node.module)
            if source is None or is_package:
                continue
            for alias in node.names:
                if _module_file(root, f"{node.module}.{alias.name}")[0] is None and alias.name not in _defined(source):
                    found.append(f"{file.relative_to(root.parent)}:{node.lineno} {alias.name} from {node.module}")
    return found


def test_every_name_is_imported_from_where_it_is_defined():
    assert not passed_on(PACKAGE), passed_on(PACKAGE)


def test_the_check_finds_a_name_passed_on(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    pass\n")
    (pkg / "b.py").write_text("from pkg.a import f\n")
    (pkg / "c.py").write_text("from pkg.b import f\nfrom pkg.a import f as g\n")
    assert passed_on(pkg) == ["pkg/c.py:1 f from pkg.b"]


def imports_in_functions(root: Path) -> list[str]:
    """``file:line module`` for each import of the package's own modules inside a function."""
    found = []
    for file in sorted(root.rglob("*.py")):
        for func in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                found += [f"{file.relative_to(root.parent)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] == root.name]
    return found


def test_no_internal_import_inside_a_function(tmp_path):
    assert not imports_in_functions(PACKAGE), imports_in_functions(PACKAGE)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n    return g\n")
    assert imports_in_functions(pkg) == ["pkg/a.py:2 pkg.b"]


def test_the_standalone_gpu_script_uses_the_criterion_defaults():
    """scripts/gpu_scratch.py runs without massive_lens, so it repeats Criterion's thresholds: equal."""
    tree = ast.parse((PACKAGE.parent / "scripts" / "gpu_scratch.py").read_text(encoding="utf-8"))
    found = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "(ABS, RATIO)")
    default = massive_lens.Criterion()
    assert found == (default.abs_threshold, default.ratio_threshold)
