"""Every public function documents its arguments in Google style, so mkdocstrings renders them.

"Public" is every function exported by ``massive_lens``, ``massive_lens.interventions``,
``massive_lens.train`` and ``massive_lens.viz`` (plus ``massive_lens.models.byte_tokenizer``
and ``wrap_hf_model``), and every public method that takes arguments (besides ``self`` and
``ax``) of the public classes: the exported ones and those the public functions return.
Each has a one-line summary first, an ``Args:`` section naming exactly the parameters of its
signature in order (``*args``/``**overrides`` with their stars), a ``Returns:`` (or
``Yields:``) section, and a ``Raises:`` entry for ``MassiveLensError`` when it raises one
itself. Functions of the top-level API also carry a runnable ``>>>`` example (a doctest).
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import massive_lens
import massive_lens.interventions
import massive_lens.quant
import massive_lens.train
import massive_lens.viz
from massive_lens.models import byte_tokenizer, wrap_hf_model

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = (massive_lens, massive_lens.interventions, massive_lens.train, massive_lens.viz, massive_lens.quant)
EXTRA_FUNCTIONS = {"massive_lens.models.byte_tokenizer": byte_tokenizer,
                   "massive_lens.models.wrap_hf_model": wrap_hf_model}
SKIPPED_PARAMS = {"self", "cls"}
_SECTION = re.compile(r"^(\w[\w ]*):\s*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)(?:\s*\([^)]*\))?:\s*(?P<text>.*)$")


def _own(obj: Any) -> bool:
    return (getattr(obj, "__module__", "") or "").startswith("massive_lens")


def public_functions() -> dict[str, Any]:
    """Qualified name -> function, for every function the public modules export."""
    found: dict[str, Any] = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                found.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
    found.update(EXTRA_FUNCTIONS)
    return found


def top_level_functions() -> set[str]:
    return {f"{obj.__module__}.{obj.__qualname__}" for name in massive_lens.__all__
            if inspect.isfunction(obj := getattr(massive_lens, name))}


def public_classes() -> dict[str, type]:
    """The exported classes and the massive_lens classes the public functions return."""
    classes: dict[str, type] = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and _own(obj):
                classes.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
    for func in public_functions().values():
        returned = inspect.signature(func).return_annotation
        if isinstance(returned, str):  # postponed annotations: resolve in the function's module
            returned = vars(sys.modules[func.__module__]).get(returned)
        if inspect.isclass(returned) and _own(returned):
            classes.setdefault(f"{returned.__module__}.{returned.__qualname__}", returned)
    return classes


def public_methods() -> tuple[dict[str, Any], dict[str, Any]]:
    """(methods taking arguments besides self/cls/ax, methods taking only ``ax``), defined in
    massive_lens (methods inherited from torch or TransformerLens are theirs to document)."""
    with_args: dict[str, Any] = {}
    ax_only: dict[str, Any] = {}
    for cls in public_classes().values():
        for klass in cls.__mro__:
            if not _own(klass):
                continue
            for name, raw in vars(klass).items():
                func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
                if name.startswith("_") or not inspect.isfunction(func):
                    continue
                key = f"{klass.__module__}.{klass.__qualname__}.{name}"
                params = [p for p in inspect.signature(func).parameters if p not in SKIPPED_PARAMS]
                if [p for p in params if p != "ax"]:
                    with_args.setdefault(key, func)
                elif params == ["ax"]:
                    ax_only.setdefault(key, func)
    return with_args, ax_only


FUNCTIONS = public_functions()
METHODS, AX_ONLY_METHODS = public_methods()
DOCUMENTED = {**FUNCTIONS, **METHODS}


def sections(doc: str) -> dict[str, list[str]]:
    """Google-style sections of a cleaned docstring: title -> its indented lines (dedented)."""
    found: dict[str, list[str]] = {}
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        match = _SECTION.match(lines[i])
        if not match:
            i += 1
            continue
        body, i = [], i + 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        indent = min((len(line) - len(line.lstrip()) for line in body if line.strip()), default=0)
        found[match.group(1)] = [line[indent:] for line in body]
    return found


def entries(body: list[str]) -> list[tuple[str, str]]:
    """(name, description) of each entry of an Args/Raises section (continuations joined)."""
    out: list[tuple[str, str]] = []
    for line in body:
        if line.strip() and not line.startswith((" ", "\t")):
            match = _ENTRY.match(line)
            assert match, f"not a 'name: description' entry: {line!r}"
            out.append((match["name"], match["text"].strip()))
        elif out and line.strip():
            out[-1] = (out[-1][0], (out[-1][1] + " " + line.strip()).strip())
    return out


def expected_params(func: Any) -> list[str]:
    names = []
    for p in inspect.signature(func).parameters.values():
        if p.name in SKIPPED_PARAMS:
            continue
        stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(stars + p.name)
    return names


def test_the_public_api_is_found():
    assert {"massive_lens.detect.find.find_massive", "massive_lens.viz.views.page",
            "massive_lens.train.presets.get_preset", "massive_lens.models.byte_tokenizer",
            "massive_lens.interventions.builders.ablate_massive"} <= set(FUNCTIONS)
    assert {"massive_lens.origin.trace.OriginTrace.plot", "massive_lens.viz.views.View.save",
            "massive_lens.train.model.MassiveLM.forward"} <= set(METHODS)
    assert "massive_lens.detect.find.MassiveActivations" in public_classes()
    assert len(FUNCTIONS) >= 40


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_summary_line_first(name):
    doc = inspect.getdoc(DOCUMENTED[name])
    assert doc, f"{name} has no docstring"
    first = doc.splitlines()[0]
    assert first.strip() and not _SECTION.match(first) and not first.startswith(">>>"), \
        f"{name}: the docstring must open with a one-line summary, got {first!r}"


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_args_match_the_signature(name):
    func = DOCUMENTED[name]
    found = sections(inspect.getdoc(func) or "")
    expected = expected_params(func)
    if not expected:
        assert "Args" not in found, f"{name} takes no arguments but documents some"
        return
    assert "Args" in found, f"{name} has no Args: section"
    documented = entries(found["Args"])
    assert [n for n, _ in documented] == expected, f"{name}: Args: lists {[n for n, _ in documented]}, " \
                                                   f"the signature has {expected}"
    empty = [n for n, text in documented if not text]
    assert not empty, f"{name}: no description for {empty}"


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_returns_section(name):
    found = sections(inspect.getdoc(DOCUMENTED[name]) or "")
    body = found.get("Returns") or found.get("Yields")
    assert body and any(line.strip() for line in body), f"{name} has no (non-empty) Returns: or Yields: section"


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_raises_documented(name):
    func = DOCUMENTED[name]
    if "raise MassiveLensError" not in inspect.getsource(func):
        return
    raised = [n for n, _ in entries(sections(inspect.getdoc(func) or "").get("Raises", []))]
    assert "MassiveLensError" in raised, f"{name} raises MassiveLensError but has no Raises: entry for it"


@pytest.mark.parametrize("name", sorted(top_level_functions()))
def test_top_level_example(name):
    doc = inspect.getdoc(FUNCTIONS[name]) or ""
    assert re.search(r"^>>> ", doc, re.M), f"{name} (top-level API) has no >>> example"


@pytest.mark.parametrize("name", sorted(AX_ONLY_METHODS))
def test_ax_only_methods_have_a_line(name):
    doc = inspect.getdoc(AX_ONLY_METHODS[name])
    assert doc and doc.splitlines()[0].strip(), f"{name} needs at least a one-line docstring"


def test_griffe_reads_the_sections(caplog):
    """What mkdocstrings renders: griffe's Google parser finds the same parameters and a
    Returns section, without warnings (an unknown parameter, a malformed section)."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("massive_lens", search_paths=[str(ROOT)])
    problems = []
    with caplog.at_level(logging.WARNING, logger="griffe"):
        for name, func in sorted(DOCUMENTED.items()):
            obj = package[name.removeprefix("massive_lens.")]
            kinds = {}
            for section in obj.docstring.parse("google"):
                kinds.setdefault(section.kind.value, section.value)
            params = [p.name for p in kinds.get("parameters", [])]
            if params != expected_params(func):
                problems.append(f"{name}: griffe reads parameters {params}")
            if "returns" not in kinds and "yields" not in kinds:
                problems.append(f"{name}: griffe finds no Returns section")
    problems += [record.getMessage() for record in caplog.records if record.name.startswith("griffe")]
    assert not problems, "\n".join(problems)
