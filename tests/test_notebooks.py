"""Every notebook runs top to bottom, offline, with small settings (MASSIVE_LENS_SMALL=1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_notebooks_exist_with_badge_and_setup():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        assert "colab.research.google.com" in "".join(cells[0]["source"]), path.name
        assert "google.colab" in "".join(cells[1]["source"]) and "MASSIVE_LENS_SMALL" in "".join(cells[1]["source"])
        assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code"), f"{path.name} has stored outputs"


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
