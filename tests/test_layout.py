"""The package's layout keeps its rules, each a test that can fail (shown on a planted break):
every internal import takes a name from the module that defines it (only a package's
``__init__`` re-exports); no ``_private`` name is imported across modules; every module sits in
its package's import-linter contract; results are keyword-only dataclasses; every ``.plot()`` draws
through ``core.render`` (no other module touches ``matplotlib.pyplot``, however spelled); ``register``
refuses a name already taken; the quick loop leaves out, by marker or fixture, every test that
loads a real model or builds a report."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import syntax
import tomllib
from conftest import QUICK_SKIPPED_FIXTURES, QUICK_SKIPPED_MARKERS

import massive_lens
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.registry import REGISTRY, InterventionSetting, register

PACKAGE = Path(massive_lens.__file__).parent
PYPROJECT = PACKAGE.parent / "pyproject.toml"


def _module_file(root: Path, module: str) -> tuple[Path | None, bool]:
    """``(file, is_package)`` of a dotted module under ``root``'s parent."""
    path = root.parent.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py", True
    return (path.with_suffix(".py"), False) if path.with_suffix(".py").is_file() else (None, False)


def _defined(file: Path) -> set[str]:
    """The names a module binds itself at top level (functions, classes, assignments), not imports."""
    names: set[str] = set()
    for node in syntax.nodes(file):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def passed_on(root: Path) -> list[str]:
    """``file:line name from module`` for each import that takes ``name`` through a plain
    module that does not define it."""
    found, defined = [], {}  # defined: each module's own names, read once (not once per name imported)
    for file in sorted(root.rglob("*.py")):
        for node in syntax.nodes(file):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == root.name):
                continue
            source, is_package = _module_file(root, node.module)
            if source is None or is_package:
                continue
            if source not in defined:
                defined[source] = _defined(source)
            for alias in node.names:
                if _module_file(root, f"{node.module}.{alias.name}")[0] is None and alias.name not in defined[source]:
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
        for func in syntax.nodes(file):
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


def _is_module(root: Path, dotted: str) -> bool:
    return _module_file(root, dotted)[0] is not None


def private_imports(root: Path) -> list[str]:
    """``file name from module`` for each ``_private`` name one module of the package takes from
    another: ``from pkg.a import _x``, or ``a._x`` on a module ``a`` imported from the package."""
    found = []
    for file in sorted(root.rglob("*.py")):
        tree, where = syntax.tree(file), file.relative_to(root.parent)
        modules: dict[str, str] = {}  # local name -> the package module it is bound to
        for node in syntax.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {a.asname: a.name for a in node.names if a.asname and a.name.split(".")[0] == root.name}
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == root.name):
                continue
            for alias in node.names:
                if _is_module(root, f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{where} {alias.name} from {node.module}")
        found += [f"{where} {node.attr} from {modules[node.value.id]}" for node in syntax.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                  and node.attr.startswith("_") and not node.attr.startswith("__")]
    return found


_PRIVATE_TODAY: dict[str, tuple[str, str]] = {}  # issue 38's offenders, fixed; this list only shrinks
PRIVATE_ALLOWED = {f"{file} {name} from {module}" for file, (module, names) in _PRIVATE_TODAY.items()
                   for name in names.split()}


def test_no_private_name_is_imported_across_modules(tmp_path):
    found = set(private_imports(PACKAGE))
    assert not found - PRIVATE_ALLOWED, (f"{sorted(found - PRIVATE_ALLOWED)}: make the name public where it is "
                                         "defined, or keep its users in that module")
    assert not PRIVATE_ALLOWED - found, f"fixed, so take them off _PRIVATE_TODAY: {sorted(PRIVATE_ALLOWED - found)}"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\n__version__ = 2\n")
    (pkg / "b.py").write_text("from pkg.a import _x, __version__\nimport pkg.a as a\nfrom pkg import a as c\n"
                              "y = a._x + c._x + a.__doc__\n")
    assert private_imports(pkg) == ["pkg/b.py _x from pkg.a", "pkg/b.py _x from pkg.a", "pkg/b.py _x from pkg.a"]


def contracts(pyproject: Path) -> list[list[str]]:
    """Every module each import-linter contract names (layers split at ``|`` and ``:``)."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
    return [[name.strip() for layer in c.get("layers", ()) for name in re.split(r"[|:]", layer)] for c in config]


def outside_contracts(root: Path, named: list[list[str]], exempt: tuple[str, ...] = ()) -> list[str]:
    """What the contracts miss: every package (the root too) needs a contract of its own, one
    naming only its direct children, and its contracts together name every child module and
    subpackage (and nothing that is not one); ``exempt`` packages have no contract yet."""
    problems = []
    for init in sorted(root.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(root.parent).parts)
        children = {f"{package}.{p.stem}" for p in init.parent.glob("*.py") if p.stem != "__init__"}
        children |= {f"{package}.{p.name}" for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
        own = {name for c in named if c and all(n.rpartition(".")[0] == package for n in c) for name in c}
        if not own:
            problems += [] if package in exempt else [f"{package}: has no import contract of its own"]
            continue
        problems += [f"{name}: in no import contract of {package}" for name in sorted(children - own)]
        problems += [f"{name}: named in a contract but not a module" for name in sorted(own - children)]
    return problems


WITHOUT_CONTRACT: tuple[str, ...] = ()  # every package has its inner contract


def test_every_module_sits_in_its_packages_import_contract(tmp_path):
    assert not outside_contracts(PACKAGE, contracts(PYPROJECT), WITHOUT_CONTRACT), \
        outside_contracts(PACKAGE, contracts(PYPROJECT), WITHOUT_CONTRACT)
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "sub/__init__", "sub/c"):
        (pkg / f"{name}.py").write_text("")
    toml = tmp_path / "pyproject.toml"
    toml.write_text('[[tool.importlinter.contracts]]\nlayers = ["pkg.a | pkg.sub", "pkg.gone"]\n')
    assert outside_contracts(pkg, contracts(toml)) == [
        "pkg.b: in no import contract of pkg", "pkg.gone: named in a contract but not a module",
        "pkg.sub: has no import contract of its own"]
    assert outside_contracts(pkg, [["pkg.a", "pkg.b", "pkg.sub"]], exempt=("pkg.sub",)) == []


def _subclasses(cls: type) -> set[type]:
    return {cls} | {s for sub in cls.__subclasses__() for s in _subclasses(sub)}


def positional(classes) -> list[str]:
    """``module.Class`` of each class that is not a dataclass built by keyword only (``kw_only``)."""
    return sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if not dataclasses.is_dataclass(c)
                  or any(f.init and not f.kw_only for f in dataclasses.fields(c)))


def test_results_and_registry_rows_are_keyword_only_dataclasses():
    for module in pkgutil.walk_packages(massive_lens.__path__, "massive_lens."):
        importlib.import_module(module.name)  # every result class is defined, so a subclass
    ours = {c for c in _subclasses(Result) - {Result} if c.__module__.startswith("massive_lens.")}  # not tests' own
    found = positional(ours | {InterventionSetting})
    assert not found, f"{found}: make it @dataclass(kw_only=True) and build it by keyword"

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ByKeyword:
        a: int

    @dataclasses.dataclass(frozen=True)
    class ByPosition:
        a: int
        b: int = dataclasses.field(default=0, kw_only=True)

    assert [name.rsplit(".", 1)[1] for name in positional([ByKeyword, ByPosition, int])] == ["int", "ByPosition"]


def test_register_refuses_a_name_already_taken():
    row = REGISTRY["zero"]
    other = dataclasses.replace(row, description="something else")
    with pytest.raises(MassiveLensError, match="'zero' is already registered.*replace=True"):
        register(other)
    assert REGISTRY["zero"] is row and register(row) is row  # the same row again (a cell run twice): nothing changes
    try:
        assert register(other, replace=True) is other and REGISTRY["zero"] is other
    finally:
        register(row, replace=True)
    assert REGISTRY["zero"] is row


def _marks(nodes: list[ast.AST]) -> set[str]:
    """The ``X`` of every ``pytest.mark.X`` in ``nodes``."""
    return {sub.attr for node in nodes for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark"}


def _functions(tree: ast.Module) -> list[tuple[ast.FunctionDef, set[str]]]:
    """Every top-level function and method, with the marks of its class."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.append((node, set()))
        elif isinstance(node, ast.ClassDef):
            found += [(sub, _marks(node.decorator_list)) for sub in node.body if isinstance(sub, ast.FunctionDef)]
    return found


def _asks(fn: ast.FunctionDef) -> tuple[set[str], bool]:
    """(the fixtures ``fn`` asks for, whether its own body loads a real model or builds a report)."""
    names, heavy = {a.arg for a in fn.args.args + fn.args.kwonlyargs}, False
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        heavy |= (callee == "load_model" and not call.args) or callee in ("write_report", "compare_models")
        if callee == "getfixturevalue":
            names |= {a.value for a in call.args if isinstance(a, ast.Constant)}
    return names, heavy


def quick_leaks(tests: Path) -> list[str]:
    """``file::test`` of each test that the quick loop keeps although it loads a real model
    (``load_model()`` with no model named) or builds a report, itself or through its fixtures: it
    has none of ``QUICK_SKIPPED_MARKERS`` (own, class or module ``pytestmark``) and no fixture of
    ``QUICK_SKIPPED_FIXTURES`` or one marked so."""
    def fixtures(tree: ast.Module) -> dict[str, tuple[set[str], bool, bool]]:  # name -> (asks, heavy, skipped)
        return {fn.name: (*_asks(fn), name_marked(fn)) for fn, _ in _functions(tree)
                if any("fixture" in ast.unparse(d) for d in fn.decorator_list)}

    def name_marked(fn: ast.FunctionDef) -> bool:
        return fn.name in QUICK_SKIPPED_FIXTURES or bool(_marks(fn.decorator_list) & set(QUICK_SKIPPED_MARKERS))

    shared = fixtures(syntax.tree(tests / "conftest.py"))
    found = []
    for file in sorted(tests.rglob("test_*.py")):
        tree = syntax.tree(file)
        known = shared | fixtures(tree)
        module_marks = _marks([n.value for n in tree.body if isinstance(n, ast.Assign)
                               and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)])

        def closure(asks: set[str], seen: set[str], known=known) -> tuple[bool, bool]:  # (heavy, skipped), via fixtures
            heavy = skipped = False
            for name in asks & set(known) - seen:
                sub_asks, own, marked = known[name]
                sub_heavy, sub_skipped = closure(sub_asks, seen | {name})
                heavy, skipped = heavy or own or sub_heavy, skipped or marked or sub_skipped
            return heavy, skipped

        for fn, class_marks in _functions(tree):
            if fn.name.startswith("test") and fn.name not in known:
                asks, own = _asks(fn)
                heavy, skipped = closure(asks, set())
                marked = (module_marks | class_marks | _marks(fn.decorator_list)) & set(QUICK_SKIPPED_MARKERS)
                if (own or heavy) and not (marked or skipped):
                    found.append(f"{file.relative_to(tests.parent)}::{fn.name}")
    return found


def test_the_quick_loop_leaves_out_every_real_model_and_report(tmp_path):
    tests = PACKAGE.parent / "tests"
    assert not quick_leaks(tests), (f"{quick_leaks(tests)}: mark them @pytest.mark.slow (the real model) or "
                                    "heavy, or the module with `pytestmark = pytest.mark.heavy`")
    planted = tmp_path / "tests"
    planted.mkdir()
    (planted / "conftest.py").write_text("@pytest.fixture\ndef big():\n    return load_model()\n\n\n"
                                         "@pytest.fixture\ndef bigger(big):\n    return big\n")
    (planted / "test_a.py").write_text("def test_real(bigger):\n    pass\n\n\n"
                                       "@pytest.mark.slow\ndef test_marked(big):\n    pass\n\n\n"
                                       "def test_report():\n    write_report(tiny_model('x'))\n\n\n"
                                       "def test_named(default_model):\n    load_model('a/local/dir')\n")
    (planted / "test_b.py").write_text("pytestmark = pytest.mark.heavy\n\n\ndef test_real(big):\n    pass\n")
    assert quick_leaks(planted) == ["tests/test_a.py::test_real", "tests/test_a.py::test_report"]


def _docstring_nodes(tree: ast.Module) -> set[int]:
    """``id`` of every docstring constant (a module's, class's or function's first statement)."""
    found = set()
    for node in syntax.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def hand_built_hook_names(root: Path) -> list[str]:
    """``file:line`` of every string outside ``core/`` that is, or starts building, a per-block
    name (``"blocks.0.hook_resid_pre"``, ``f"blocks.{layer}.attn.hook_z"``, ``"blocks." + ...``);
    docstrings and comments are exempt, and so is a message that only mentions one mid-sentence.
    ``ModelView.block_hook`` / ``has_hook`` / ``hook_name`` (and ``block_param``) are the one place."""
    found = []
    for file in sorted(root.rglob("*.py")):
        if file.relative_to(root).parts[0] == "core":
            continue
        tree = syntax.tree(file)
        docs, parts = _docstring_nodes(tree), set()
        for node in syntax.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts |= {id(v) for v in node.values}
                head = node.values[0] if node.values else None
                if isinstance(head, ast.Constant) and str(head.value).startswith("blocks."):
                    found.append(f"{file.relative_to(root.parent)}:{node.lineno}")
        for node in syntax.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("blocks.")
                    and id(node) not in docs and id(node) not in parts):
                found.append(f"{file.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_module_outside_core_builds_a_hook_name(tmp_path):
    found = hand_built_hook_names(PACKAGE)
    assert not found, f"{found}: name per-block hooks with ModelView.block_hook / hook_name / has_hook"
    pkg = tmp_path / "pkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "view.py").write_text('def name(layer):\n    return f"blocks.{layer}.hook_resid_post"\n')
    (pkg / "a.py").write_text('"""blocks.0.hook_resid_pre in a docstring is fine."""\n'
                              'A = f"blocks.{1}.attn.hook_z"\n'
                              'B = "blocks.0.hook_resid_pre"  # blocks.1 in a comment is fine\n'
                              'C = "blocks." + str(2) + ".hook_mlp_out"\n'
                              'D = f"set sae.cfg.hook_name, e.g. blocks.{6}.hook_resid_post"\n')
    assert hand_built_hook_names(pkg) == ["pkg/a.py:2", "pkg/a.py:3", "pkg/a.py:4"]


DRAWS = "core/render.py"  # the one module that makes and closes figures (pyplot); every .plot() draws through it


def pyplot_users(root: Path, gate: str = DRAWS) -> list[str]:
    """``file:line`` of each use of ``matplotlib.pyplot`` outside ``gate``: an import of it in any
    spelling, or ``.pyplot`` read off a name bound to matplotlib (``import matplotlib`` then
    ``matplotlib.pyplot.figure()``, which works wherever some other module imported pyplot)."""
    found = []
    for file in sorted(root.rglob("*.py")):
        if file.relative_to(root).as_posix() == gate:
            continue
        tree = syntax.tree(file)
        imports = [a for node in syntax.walk(tree) if isinstance(node, ast.Import) for a in node.names]
        bound = {a.asname or "matplotlib" for a in imports  # names bound to matplotlib itself
                 if a.name == "matplotlib" or (a.name.startswith("matplotlib.") and a.asname is None)}
        for node in syntax.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""] \
                if isinstance(node, ast.ImportFrom) else []
            reads = isinstance(node, ast.Attribute) and node.attr == "pyplot" and isinstance(node.value, ast.Name) \
                and node.value.id in bound
            if reads or any(n == "matplotlib.pyplot" or n.startswith("matplotlib.pyplot.") for n in names):
                found.append(f"{file.relative_to(root.parent)}:{node.lineno}")
    return found


def test_every_plot_draws_through_core_render(tmp_path):
    assert not pyplot_users(PACKAGE), (f"{pyplot_users(PACKAGE)}: make figures with core.render's ensure_axes / "
                                       "new_figure and close them with close_figure")
    pkg = tmp_path / "pkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "render.py").write_text("import matplotlib.pyplot as plt\n")
    (pkg / "a.py").write_text("import matplotlib.pyplot as plt\nimport matplotlib.colors\n")
    (pkg / "b.py").write_text("def plot():\n    from matplotlib import pyplot\n    return pyplot.gca()\n")
    (pkg / "c.py").write_text("from matplotlib.pyplot import subplots\nfrom matplotlib import ticker\n")
    (pkg / "d.py").write_text("import matplotlib\nimport matplotlib.colors as mcolors\n\n\ndef plot():\n"
                              "    return matplotlib.pyplot.figure(), mcolors.pyplot, ticker.pyplot\n")
    (pkg / "e.py").write_text("import matplotlib as mpl\n\nfig = mpl.pyplot.gcf()\n")
    assert pyplot_users(pkg) == ["pkg/a.py:1", "pkg/b.py:2", "pkg/c.py:1", "pkg/d.py:6", "pkg/e.py:3"]
