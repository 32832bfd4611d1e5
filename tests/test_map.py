"""The map matches the house: ``docs/architecture.md``'s layer diagram and layer table follow
the import-linter layers contract in ``pyproject.toml``, its namespace table lists
``massive_lens.__all__`` and every public namespace, and the README lists every ``massive-lens``
command and every notebook. Each check is also run on a planted break."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import tomllib

import massive_lens
from massive_lens.cli import build_parser

ROOT = Path(massive_lens.__file__).parent.parent
PYPROJECT, ARCHITECTURE, README = ROOT / "pyproject.toml", ROOT / "docs" / "architecture.md", ROOT / "README.md"


def layer_contract(pyproject: Path) -> list[set[str]]:
    """The package-wide layers contract (the one naming only top-level modules), top first."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
    layers = [[{n.strip() for n in re.split(r"[|:]", layer)} for layer in c.get("layers", ())] for c in config]
    top = next(c for c in layers if all(name.count(".") == 1 for layer in c for name in layer))
    return [{name.split(".", 1)[1] for name in layer} for layer in top]


def diagram_layers(page: str) -> list[set[str]]:
    """The layers of the page's first ``text`` block (``a | b   what they hold`` a line), top first."""
    block = page.split("```text\n", 1)[1].split("```", 1)[0]
    return [{n.strip() for n in line.strip().split("  ", 1)[0].split("|")} for line in block.splitlines() if line]


def _table(page: str, header: str) -> list[list[str]]:
    rows = page.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # past the header and |---| lines
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def table_layers(page: str) -> list[set[str]]:
    """The layer column of the page's ``| layer | package or module |`` table (bottom up), top first."""
    return [{n.strip() for n in row[0].split(",")} for row in reversed(_table(page, "| layer | package or module |"))]


def namespace_table(page: str) -> dict[str, set[str]]:
    """Each namespace of the page's table of what users import -> the names its row spells in backticks."""
    return {row[0].strip("`"): set(re.findall(r"`([^`]+)`", row[1]))
            for row in _table(page, "| namespace | what it exports |")}


def test_the_architecture_page_matches_the_contract_and_the_public_names():
    page, layers = ARCHITECTURE.read_text(encoding="utf-8"), layer_contract(PYPROJECT)
    assert diagram_layers(page) == layers, "docs/architecture.md's diagram: the layers of pyproject.toml's contract"
    assert table_layers(page) == layers, "docs/architecture.md's layer table: the layers of pyproject.toml's contract"
    table = namespace_table(page)
    assert table["massive_lens"] == set(massive_lens.__all__), set(massive_lens.__all__) ^ table["massive_lens"]
    public = {f"massive_lens.{m.name}" for m in pkgutil.iter_modules(massive_lens.__path__)
              if m.name != "core" and hasattr(importlib.import_module(f"massive_lens.{m.name}"), "__all__")}
    assert set(table) == public | {"massive_lens"}, set(table) ^ (public | {"massive_lens"})
    assert diagram_layers(page.replace("origin | handover", "origin")) != layers  # planted
    assert table_layers(page.replace("| quant | `massive_lens.quant`", "| quantize | `massive_lens.quant`")) != layers
    assert namespace_table(page.replace("`default_text`, ", ""))["massive_lens"] != set(massive_lens.__all__)


def readme_lists(readme: str) -> tuple[set[str], set[str]]:
    """The commands of the README's ``Command line: `massive-lens a | b` `` and the notebook
    numbers of its ``Notebooks: ... (01 find, ...)``."""
    commands = re.search(r"Command line: `massive-lens ([^`]+)`", readme).group(1)
    notebooks = re.search(r"Notebooks:.*\((\d\d [^)]*)\)", readme).group(1)
    return {c.strip() for c in commands.split("|")}, set(re.findall(r"\b(\d\d) ", notebooks))


def test_the_readme_lists_every_command_and_notebook():
    readme = README.read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    notebooks = {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py")}
    assert readme_lists(readme) == (set(sub.choices), notebooks)
    assert readme_lists(readme.replace(" | quantize", ""))[0] != set(sub.choices)  # planted breaks
    assert readme_lists(readme.replace(", 07 what sinks do", ""))[1] != notebooks
