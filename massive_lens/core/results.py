"""The contract every analysis result keeps.

A result is a small frozen dataclass holding tensors and frames, never the model. It has

- ``to_frame()``: the long table, one row per fact, with the documented column names;
- ``summary()``: a short text, what a researcher would write in a lab notebook;
- ``plot(ax=None)``: a figure drawn through :mod:`massive_lens.core.render`, returning the Axes;
- ``_repr_html_``: the summary and the head of the table, shared by all results.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Count(Result):
...     n: int
...     def to_frame(self): return pd.DataFrame({"n": [self.n]})
...     def summary(self): return f"{self.n} things"
...     def plot(self, ax=None): return None
>>> "<pre>3 things</pre>" in Count(3)._repr_html_()
True
"""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from massive_lens.core.fmt import cell

HTML_ROWS = 20


class Result:
    """Base class of every public result type (see the module docstring)."""

    def to_frame(self) -> pd.DataFrame:  # pragma: no cover - every result overrides it
        """The long table: one row per fact, with the documented column names."""
        raise NotImplementedError

    def summary(self) -> str:  # pragma: no cover
        """A short text, what a researcher would write in a lab notebook."""
        raise NotImplementedError

    def plot(self, ax: Any = None) -> Any:  # pragma: no cover
        """Draw the result on ``ax`` (None: a new figure) and return the matplotlib Axes."""
        raise NotImplementedError

    def _repr_html_(self) -> str:
        frame = self.to_frame()
        table = frame.head(HTML_ROWS).to_html(index=False, float_format=cell) if len(frame) else ""
        more = f"<p>... {len(frame) - HTML_ROWS} more rows: .to_frame()</p>" if len(frame) > HTML_ROWS else ""
        return f"<pre>{html.escape(self.summary())}</pre>{table}{more}"

    def __str__(self) -> str:
        return self.summary()
