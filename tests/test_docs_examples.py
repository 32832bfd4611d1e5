"""Every Python example in ``docs/`` and ``README.md`` runs as written (issue 14).

One test per page: the page's Python blocks run in order in one namespace, with the
repository root as the working directory (so ``../shared/data/...`` names the shared data
folder beside the checkout), matplotlib on Agg and the Hugging Face hub offline.

A block that cannot run in a test (an hour of training, the 7 GB second model, a download)
carries an HTML comment on the line right before its fence::

    <!-- not run in tests: trains for about an hour on 2 CPU cores -->

and only such blocks are skipped. A page whose examples read ``../shared/data/...`` is
skipped, with the reason, where the checkout has no ``../shared/data`` beside it.
"""

from __future__ import annotations

import ast
import doctest
import re
from pathlib import Path

import pytest
from test_docs import ROOT, doc_files, python_blocks

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

SHARED_DATA = "../shared/data/"
_NOT_RUN = re.compile(r"^\s*<!--\s*not run in tests:\s*(?P<why>\S.*?)\s*-->\s*$")
_SLOW = {"load_model", "compare_models"}  # they load a real model: the `slow` marker's meaning


def runnable_blocks(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The page's Python blocks as (first code line, source): those to run, and those marked
    ``<!-- not run in tests: why -->`` on the line before their fence (source = the reason)."""
    lines, run, skipped = text.splitlines(), [], []
    for start, body in python_blocks(text):
        before = lines[start - 3] if start >= 3 else ""  # start is 1-based; the fence is line start - 1
        if m := _NOT_RUN.match(before):
            skipped.append((start, m["why"]))
        elif any(line.lstrip().startswith(">>>") for line in body):  # a pycon block: run its sources
            run.append((start, "".join(e.source for e in doctest.DocTestParser().get_examples("\n".join(body)))))
        else:
            run.append((start, "\n".join(body)))
    return run, skipped


def _called(sources) -> list[str]:
    """The names of the functions the sources call (``f(...)`` and ``module.f(...)``)."""
    calls = [node.func for source in sources for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    return [getattr(f, "id", None) or getattr(f, "attr", "") for f in calls]


def _pages() -> list:
    params = []
    for path in doc_files():
        run, _ = runnable_blocks(path.read_text())
        if run:
            marks = [pytest.mark.slow] if _SLOW & set(_called(source for _, source in run)) else []
            params.append(pytest.param(path, marks=marks, id=str(path.relative_to(ROOT))))
    return params


def test_marker_reader():
    text = ("Intro.\n\n```python\nx = 1\n```\n\n<!-- not run in tests: an hour on 2 CPU cores -->\n```python\n"
            "train()\n```\n\n<!-- a comment -->\n```py\ny = x + 1\n```\n\n```pycon\n>>> z = y * 2\n>>> z\n4\n```\n")
    run, skipped = runnable_blocks(text)
    assert [start for start, _ in run] == [4, 14, 18]
    assert [source for _, source in run] == ["x = 1", "y = x + 1", "z = y * 2\nz\n"]
    assert skipped == [(9, "an hour on 2 CPU cores")]


def test_shared_data_has_one_spelling():
    """Examples name the shared data as ``../shared/data/...`` (relative to the repository root,
    where the examples run), never by an absolute path of one machine."""
    spelled = re.compile(r"(?<![\w.])[/~][\w./-]*shared/data/")
    problems = [f"{path.relative_to(ROOT)}:{n}: {m.group()}" for path in doc_files()
                for n, line in enumerate(path.read_text().splitlines(), 1)
                for m in spelled.finditer(line) if m.group() != SHARED_DATA]
    assert not problems, f"write the shared data as {SHARED_DATA}...:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", _pages())
def test_docs_page_examples_run(path: Path, monkeypatch):
    run, _ = runnable_blocks(path.read_text())
    if any(SHARED_DATA in source for _, source in run) and not (ROOT / SHARED_DATA).is_dir():
        pytest.skip(f"{path.name} reads {SHARED_DATA}..., and {(ROOT / SHARED_DATA).resolve()} does not exist "
                    "(the shared data sits beside the checkout on the dev machines and in CI)")
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    before = set(ROOT.iterdir())
    namespace: dict = {"__name__": "__docs__"}
    try:
        for start, source in run:
            # padded so a traceback names the Markdown line
            exec(compile("\n" * (start - 1) + source, str(path), "exec"), namespace)
    finally:
        plt.close("all")
    written = sorted(p.name for p in set(ROOT.iterdir()) - before)
    assert not written, f"{path.name}: the examples wrote {written} into the repository root; use a temporary folder"
