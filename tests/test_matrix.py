"""The architecture conformance matrix: every decoder-only architecture of TransformerLens's
bridge, and every vision transformer (``matrix_vit.py``), as a tiny planted model, through
every analysis (see ``matrix.py``).

Each cell is a test: ✓ (exact), or the named limitation that ``docs/architectures.md`` records
for it; a wrong number, an unexpected exception or a cell that changed fails.
``MASSIVE_LENS_WRITE_MATRIX=1`` rewrites the page from the results instead.
"""

from __future__ import annotations

import os

import pytest
from matrix import ANALYSES, DOC, decoder_architectures, parse, render, same, versions
from matrix import cell as run_cell
from matrix_vit import vision_architectures

WRITE = os.environ.get("MASSIVE_LENS_WRITE_MATRIX") == "1"
DECODERS = decoder_architectures()
ARCHITECTURES = DECODERS + vision_architectures()
COMMITTED = parse(DOC.read_text()) if DOC.exists() and not WRITE else {}
RESULTS: dict[tuple[str, str], str] = {}
REGENERATE = "regenerate it with MASSIVE_LENS_WRITE_MATRIX=1 pytest tests/test_matrix.py"


pytestmark = [pytest.mark.usefixtures("free_matrix_models"), pytest.mark.heavy]  # heavy: not in make check


def test_enough_architectures():
    assert len(DECODERS) >= 40, DECODERS
    assert len(ARCHITECTURES) > len(DECODERS), "no vision transformer among the bridge's architectures"


@pytest.mark.parametrize("analysis", list(ANALYSES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cell(arch, analysis):
    value = run_cell(arch, analysis)
    RESULTS[arch, analysis] = value
    if not WRITE:
        expected = COMMITTED.get((arch, analysis))
        assert expected is not None, f"{arch} / {analysis} is not in {DOC.name}; {REGENERATE}"
        assert same(value, expected), f"{arch} / {analysis} is now {value!r}, the page says {expected!r}; {REGENERATE}"
    if value.startswith("not built"):
        pytest.skip(value)


def test_page_matches_results():
    """The whole page (counts, footnotes, the list of architectures) is what this run gives;
    with MASSIVE_LENS_WRITE_MATRIX=1, write it."""
    expected = {(a, x) for a in ARCHITECTURES for x in ANALYSES}
    if set(RESULTS) != expected:
        pytest.skip("only part of the matrix ran")
    page = render(RESULTS, versions())
    built = sum(not RESULTS[a, "find_massive"].startswith("not built") for a in ARCHITECTURES)
    assert built >= 40, f"only {built} tiny models could be built"
    if WRITE:
        DOC.write_text(page)
        return
    assert DOC.exists(), f"{DOC} is missing; {REGENERATE}"
    old, new = DOC.read_text().splitlines(), page.splitlines()
    assert len(old) == len(new) and all(same(a, b) for a, b in zip(old, new, strict=True)), \
        f"{DOC.name} does not match this run; {REGENERATE}"
