"""House rules that slipped through the tests (issue 50), each a check shown failing on a planted
break: absolute imports only (ruff ``TID252``, enabled in ``pyproject.toml``), no layer number
parsed back out of a hook name outside ``core/``, each namespace row of ``docs/architecture.md``
naming every function of its ``__all__`` (and nothing that is not exported), ``capture`` staying a
short driver over its pass, and the nnsight view registered from ``models/``, not by importing
``core``; and no command defaults to writing into ``docs/`` (the sink-task grid's root is
``runs/sinktasks``). (``import matplotlib`` then ``matplotlib.pyplot`` is caught with the other pyplot users
in ``tests/test_layout.py``.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import syntax
import tomllib

import massive_lens
from massive_lens.core.model_view import ModelView
from massive_lens.core.nnsight_view import NnsightView
from massive_lens.train.taskcli import main as taskcli

PACKAGE = Path(massive_lens.__file__).parent
ROOT = PACKAGE.parent
PYPROJECT = ROOT / "pyproject.toml"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


# ----------------------------------------------------------------- absolute imports only

def ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    assert Path(found).is_file(), "ruff is missing: pip install -e '.[test]' (it checks TID252 here)"
    return found


def relative_imports(*paths: Path, config: Path = PYPROJECT) -> list[str]:
    """``file:line`` of each relative import ruff reports (TID252) under ``config``'s settings."""
    out = subprocess.run([ruff(), "check", "--no-cache", "--config", str(config), "--select", "TID252",
                          "--output-format", "concise", *map(str, paths)], capture_output=True, text=True, timeout=60)
    return [line.split(":", 1)[0].rsplit("/", 1)[-1] + ":" + line.split(":")[1]
            for line in out.stdout.splitlines() if "TID252" in line]


def test_imports_are_absolute(tmp_path):
    lint = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["ruff"]["lint"]
    assert "TID252" in lint["select"] or "TID" in lint["select"], "enable ruff's TID252 in pyproject.toml"
    assert lint["flake8-tidy-imports"]["ban-relative-imports"] == "all"
    assert not relative_imports(PACKAGE, ROOT / "tests"), relative_imports(PACKAGE, ROOT / "tests")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "b.py").write_text("from . import a\nfrom .a import X\nfrom pkg.a import X as Y\n\nZ = a.X + X + Y\n")
    assert relative_imports(pkg) == ["b.py:1", "b.py:2"]


# ----------------------------------------------------------------- no layer parsed out of a hook name

_LAYER_PATTERN = re.compile(r"blocks\\?\.\(|blocks\\?\.\[|blocks\\?\.\\d")  # a regex that captures blocks.<n>


def parsed_layers(root: Path, exempt: str = "core") -> list[str]:
    """``file:line`` of each place outside ``exempt/`` that reads a layer number back out of a hook
    name: ``int(<name>.split(".")[i])`` (or ``.split(".", n)``, ``.rsplit``, ``.partition`` parts) or a
    regular expression that captures the number after ``blocks.``. Keep the layer beside the name
    instead (``ModelView.block_hook`` builds names; core is where names are read)."""
    found = []
    for file in sorted(root.rglob("*.py")):
        if file.relative_to(root).parts[0] == exempt:
            continue
        where = file.relative_to(root.parent)
        for node in syntax.nodes(file):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "int" and node.args:
                inner = node.args[0]
                while isinstance(inner, ast.Subscript):
                    inner = inner.value
                if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                        and inner.func.attr in ("split", "rsplit", "partition", "rpartition")
                        and inner.args and isinstance(inner.args[0], ast.Constant) and inner.args[0].value == "."):
                    found.append(f"{where}:{node.lineno}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _LAYER_PATTERN.search(node.value):
                found.append(f"{where}:{node.lineno}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


PARSED_TODAY = ("massive_lens/quant/outliers.py",)  # goes with its rename (issue 52 carries the layer as data)


def test_no_layer_is_parsed_out_of_a_hook_name(tmp_path):
    found = [f for f in parsed_layers(PACKAGE) if f.split(":")[0] not in PARSED_TODAY]
    assert not found, f"{found}: carry the layer beside the hook name (a dict, a partial), never parse it back"
    pkg = tmp_path / "pkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "view.py").write_text('def layer(name):\n    return int(name.split(".")[1])\n')
    (pkg / "a.py").write_text('import re\n\n\n'
                              'def f(hook, name):\n'
                              '    a = int(hook.name.split(".")[1])\n'
                              '    b = re.match(r"blocks\\.(\\d+)\\.attn", name)\n'
                              '    c = int(name.split(".", 2)[1])\n'
                              '    d = name.split(".")[-1]  # the hook kind: fine\n'
                              '    e = int("3")\n'
                              '    return a, b, c, d, e\n')
    assert parsed_layers(pkg) == ["pkg/a.py:5", "pkg/a.py:6", "pkg/a.py:7"]


# ----------------------------------------------------------------- namespace rows against __all__

def namespace_rows(text: str) -> dict[str, str]:
    """``namespace -> row text`` of the table under "What users import" in architecture.md."""
    section = text.split("## What users import", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def row_mismatches(rows: dict[str, str], exports: dict[str, dict[str, object]]) -> list[str]:
    """What a row misses (a function in the namespace's ``__all__`` it does not name) or names
    wrongly (a backticked name the namespace does not export); classes and constants may be
    summed up in words ("and their results")."""
    problems = [f"{ns}: exported but has no row" for ns in sorted(set(exports) - set(rows))]
    for ns, row in rows.items():
        if ns not in exports:
            problems.append(f"{ns}: a row for a namespace without __all__")
            continue
        named = {n for part in re.findall(r"`([^`]+)`", row) for n in part.split("/")}
        functions = {n for n, obj in exports[ns].items() if inspect.isfunction(obj)}
        problems += [f"{ns}: {n} is not in the row" for n in sorted(functions - named)]
        problems += [f"{ns}: {n} is in the row, not in __all__" for n in sorted(named - set(exports[ns]))]
    return problems


def public_exports() -> dict[str, dict[str, object]]:
    """``namespace -> {name: object}`` for the package and each module or subpackage with an ``__all__``."""
    names = ["massive_lens"] + [f"massive_lens.{p.stem if p.suffix else p.name}" for p in sorted(PACKAGE.iterdir())
                                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()]
    found = {}
    for name in names:
        module = importlib.import_module(name)
        if hasattr(module, "__all__"):
            found[name] = {n: getattr(module, n) for n in module.__all__}
    return found


def test_each_namespace_row_names_its_functions():
    exports = {ns: e for ns, e in public_exports().items() if ns not in DEPRECATED}
    found = row_mismatches(namespace_rows(ARCHITECTURE.read_text(encoding="utf-8")), exports)
    assert not found, f"{found}: update the namespace table of docs/architecture.md"
    planted = ("## What users import\n\n| namespace | what it exports |\n|---|---|\n"
               "| `pkg.a` | `f`, `g` and their results |\n| `pkg.b` | `h`, `Gone` |\n\n## Next\n")
    exports = {"pkg.a": {"f": row_mismatches, "g": namespace_rows, "k": public_exports, "R": ModelView},
               "pkg.b": {"h": row_mismatches}, "pkg.c": {"x": row_mismatches}}
    assert row_mismatches(namespace_rows(planted), exports) == [
        "pkg.c: exported but has no row", "pkg.a: k is not in the row", "pkg.b: Gone is in the row, not in __all__"]


DEPRECATED = ("massive_lens.quantize", "massive_lens.lowbit")  # old names forwarded to massive_lens.quant


# ----------------------------------------------------------------- capture stays a short driver

CAPTURE_LINES = 20  # the signature, the docstring and a few lines that drive origin.capture's pass


def long_drivers(file: Path, names: dict[str, int]) -> list[str]:
    """``name`` of each function of ``file`` in ``names`` that is longer than its line budget or
    keeps state in a nested function (a closure), and of each that is missing."""
    tree = syntax.tree(file)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    found = [f"{name}: missing" for name in names if name not in funcs]
    for name, budget in names.items():
        if name not in funcs:
            continue
        fn = funcs[name]
        if fn.end_lineno - fn.lineno + 1 > budget:
            found.append(f"{name}: {fn.end_lineno - fn.lineno + 1} lines > {budget}")
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for n in ast.walk(fn) if n is not fn):
            found.append(f"{name}: a nested function keeps state; give the pass a class with named steps")
    return found


def test_capture_stays_short(tmp_path):
    found = long_drivers(PACKAGE / "origin" / "capture.py", {"capture": CAPTURE_LINES})
    assert not found, found
    body = "\n".join(f"    x{i} = {i}" for i in range(25))
    (tmp_path / "capture.py").write_text(f"def capture(view):\n{body}\n\n\n"
                                         "def other():\n    def hook(act):\n        return act\n    return hook\n")
    assert long_drivers(tmp_path / "capture.py", {"capture": 20, "other": 20, "gone": 5}) == [
        "gone: missing", "capture: 26 lines > 20", "other: a nested function keeps state; give the pass a class "
        "with named steps"]


# ----------------------------------------------------------------- the nnsight view's home

def registrations(root: Path) -> list[str]:
    """``file:line`` of each registration of a view (``register_view`` or ``variants.append``) and
    of each import in a package ``__init__`` made only for its side effect (``# noqa: F401``)."""
    found = []
    for file in sorted(root.rglob("*.py")):
        text = file.read_text(encoding="utf-8")
        for node in syntax.walk(syntax.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and (node.func.attr == "register_view" or (node.func.attr == "append"
                         and getattr(node.func.value, "attr", "") == "variants"))):
                found.append(f"{file.relative_to(root.parent)}:{node.lineno}")
        if file.name == "__init__.py":
            found += [f"{file.relative_to(root.parent)}:{i} side effect" for i, line in enumerate(text.splitlines(), 1)
                      if line.startswith(("import ", "from ")) and "noqa: F401" in line]
    return found


def test_the_nnsight_view_registers_from_models(tmp_path):
    found = registrations(PACKAGE)
    assert [f for f in found if not f.startswith("massive_lens/models/")] == [], found
    assert any(f.startswith("massive_lens/models/") for f in found)
    assert [v for _, v in ModelView.variants].count(NnsightView) == 1
    pkg = tmp_path / "pkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "__init__.py").write_text("from pkg.core import view  # noqa: F401  (adds its view)\n")
    (pkg / "core" / "view.py").write_text("ModelView.variants.append((fits, View))\n")
    (pkg / "models.py").write_text("ModelView.register_view(fits, View)\n")
    assert registrations(pkg) == ["pkg/core/__init__.py:1 side effect", "pkg/core/view.py:1", "pkg/models.py:1"]


def test_register_view_replaces_a_view_registered_again():
    before, fits = list(ModelView.variants), (lambda model: False)
    try:
        ModelView.register_view(fits, NnsightView)
        assert [v for _, v in ModelView.variants].count(NnsightView) == 1
        assert next(f for f, v in ModelView.variants if v is NnsightView) is fits
    finally:
        ModelView.variants[:] = before


# ----------------------------------------------------------------- no command writes into docs/ by default

def docs_defaults(root: Path) -> list[str]:
    """``file:line`` of each default that points into the documentation: a ``default=`` keyword or a
    module-level constant whose string starts with ``docs/`` (a command's output goes under the
    working folder, ``runs/...``, unless the docs' own folder is named on purpose)."""
    found = []
    for file in sorted(root.rglob("*.py")):
        tree = syntax.tree(file)
        values = [k.value for n in syntax.walk(tree) if isinstance(n, ast.Call)
                  for k in n.keywords if k.arg == "default"]
        values += [n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None]
        found += [f"{file.relative_to(root.parent)}:{v.lineno}" for v in values
                  if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith("docs/")]
    return sorted(found)


def test_no_command_writes_into_docs_by_default(tmp_path, capsys):
    assert not docs_defaults(PACKAGE), docs_defaults(PACKAGE)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "cli.py").write_text('ROOT = "docs/runs"\nOK = "runs/x"\n\n\n'
                                'def add(parser):\n    parser.add_argument("--page", default="docs/page.md")\n'
                                '    parser.add_argument("--out-dir", default="runs/y", help="not docs/ here")\n')
    assert docs_defaults(pkg) == ["pkg/cli.py:1", "pkg/cli.py:6"]
    assert taskcli(["page", "--root", str(tmp_path)]) == 2  # the page is named, never assumed
    assert "page needs --page" in capsys.readouterr().err
