"""Griffe extension for the API reference: fence doctest examples as Python code.

Our docstrings are plain text with ``>>>`` examples (checked by ``pytest --doctest-modules``).
Markdown would read ``>>>`` as nested block quotes; this wraps each run of doctest lines
(prompts, continuations and expected output, up to a blank line) in a ```` ```python ````
fence before mkdocstrings renders the docstring.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        starts = line.lstrip().startswith(">>>")
        if starts and not inside:
            out.append("```python")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
