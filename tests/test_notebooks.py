"""The notebooks: in sync with their sources, public imports only, and every one runs.

Each ``notebooks/NN_name.ipynb`` is generated from the jupytext percent-format source
``notebooks/NN_name.py`` beside it; edit the ``.py`` and regenerate (outputs stay empty,
cell ids are kept)::

    .venv/bin/jupytext --update --to ipynb notebooks/[0-9][0-9]_*.py

(Opened in Jupyter with jupytext installed, the pair stays in sync by itself; after editing
either file by hand, ``.venv/bin/jupytext --sync notebooks/[0-9][0-9]_*.py`` also works.)

The run test executes every notebook top to bottom, offline, with small settings
(``MASSIVE_LENS_SMALL=1``).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import jupytext
import pytest

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
SOURCES = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
REGENERATE = ".venv/bin/jupytext --update --to ipynb notebooks/[0-9][0-9]_*.py"
PUBLIC = {"massive_lens", "massive_lens.interventions", "massive_lens.train", "massive_lens.viz",
          "massive_lens.effects", "massive_lens.attention", "massive_lens.handover"}


def test_notebooks_exist_with_badge_and_setup():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(1, len(NOTEBOOKS) + 1)], "numbered 01, 02, ..."
    assert len(NOTEBOOKS) >= 9
    assert [p.stem for p in SOURCES] == [p.stem for p in NOTEBOOKS], "every notebook needs its .py source"
    for path in NOTEBOOKS:
        notebook = json.loads(path.read_text())
        cells = notebook["cells"]
        assert notebook["metadata"]["kernelspec"]["name"] == "python3", path.name
        assert "colab.research.google.com" in "".join(cells[0]["source"]), path.name
        assert path.name in "".join(cells[0]["source"]), f"{path.name}: the Colab badge links another notebook"
        assert "google.colab" in "".join(cells[1]["source"]) and "MASSIVE_LENS_SMALL" in "".join(cells[1]["source"])
        assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code"), f"{path.name} has stored outputs"


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_matches_its_source(source):
    """A stale .ipynb (the .py edited, the notebook not regenerated) fails here."""
    assert "formats: ipynb,py:percent" in source.read_text(), f"{source.name} is not a paired percent source"
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} is missing; run {REGENERATE}"

    def cells(path: Path) -> list[tuple[str, str]]:
        return [(c.cell_type, c.source) for c in jupytext.read(path).cells]

    assert cells(ipynb) == cells(source), f"{ipynb.name} is out of date with {source.name}; run {REGENERATE}"


def _imports(code: str, where: str) -> list[tuple[str, str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(code, filename=where)):
        if isinstance(node, ast.Import):
            found += [(where, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((where, module, [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_imports_only_the_public_api(source):
    """Code cells, and python examples in markdown cells, import massive_lens only from its
    public modules (no private modules or names), and otherwise only the standard library."""
    imports = _imports(source.read_text(), source.name)
    for i, cell in enumerate(jupytext.read(source).cells):
        if cell.cell_type == "markdown":
            for block in re.findall(r"```python\n(.*?)```", cell.source, flags=re.DOTALL):
                imports += _imports(block, f"{source.name}, markdown cell {i}")
    assert any(module in PUBLIC for _, module, _ in imports), f"{source.name} does not use massive_lens"
    for where, module, names in imports:
        if module.split(".")[0] == "massive_lens":
            assert module in PUBLIC, f"{where}: imports {module}; use one of {sorted(PUBLIC)}"
            assert not [n for n in names if n.startswith("_")], f"{where}: imports private {names} from {module}"
        else:
            assert module.split(".")[0] in sys.stdlib_module_names, f"{where}: imports {module}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MASSIVE_LENS_SMALL", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []
    html = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "data" in o and "text/html" in o["data"] and "CircuitsVis" in o["data"]["text/html"]]
    assert all("unpkg.com" not in h for h in html)
