"""The contract every analysis result keeps.

A result is a small frozen dataclass holding tensors and frames, never the model. It has

- ``to_frame()``: the long table, one row per fact, with the documented column names;
- ``summary()``: a short text, what a researcher would write in a lab notebook;
- ``plot(ax=None)``: a figure drawn through :mod:`massive_lens.core.render`, returning the Axes;
- ``_repr_html_``: the summary and the head of the table, shared by all results;
- ``save(path)``: the result in a folder that :func:`massive_lens.load` reads back without
  the model (:mod:`massive_lens.core.store`; every subclass registers itself for loading).

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

import dataclasses
import html
import os
from pathlib import Path
from typing import Any

import pandas as pd

from massive_lens.core import store
from massive_lens.core.fmt import cell

HTML_ROWS = 20


class Result:
    """Base class of every public result type (see the module docstring)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        store.register(cls)  # so that massive_lens.load finds the class named in a manifest

    def to_frame(self) -> pd.DataFrame:  # pragma: no cover - every result overrides it
        """The long table: one row per fact, with the documented column names."""
        raise NotImplementedError

    def summary(self) -> str:  # pragma: no cover
        """A short text, what a researcher would write in a lab notebook."""
        raise NotImplementedError

    def plot(self, ax: Any = None) -> Any:  # pragma: no cover
        """Draw the result on ``ax`` (None: a new figure) and return the matplotlib Axes."""
        raise NotImplementedError

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Save the result to a folder that ``massive_lens.load(path)`` reads back without the model.

        The folder holds ``manifest.json`` (type, library version, summary, scalar fields),
        one Parquet file per table under ``frames/`` and ``tensors.safetensors``; see
        ``docs/results.md``. It is written under a temporary name and renamed into place, so
        an interrupted save leaves nothing half-written.

        Args:
            path: the folder to create (missing parents are created too).
            overwrite: replace ``path`` if it already holds a saved result; a folder holding
                anything else is never replaced.

        Returns:
            The folder, as a ``Path``.

        Raises:
            MassiveLensError: if ``path`` is a file or a non-empty folder (without
                ``overwrite``, or not holding a saved result), or a field cannot be saved.
        """
        return store.save_result(self, path, overwrite=overwrite)

    def _stored_fields(self) -> dict[str, Any]:
        """What :meth:`save` stores: the ``__init__`` fields (override for unstorable ones)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def _from_stored(cls, fields: dict[str, Any]) -> Result:
        """The result back from the decoded ``_stored_fields`` (the inverse of that hook)."""
        return store.build_dataclass(cls, fields)

    def _repr_html_(self) -> str:
        frame = self.to_frame()
        table = frame.head(HTML_ROWS).to_html(index=False, float_format=cell) if len(frame) else ""
        more = f"<p>... {len(frame) - HTML_ROWS} more rows: .to_frame()</p>" if len(frame) > HTML_ROWS else ""
        return f"<pre>{html.escape(self.summary())}</pre>{table}{more}"

    def __str__(self) -> str:
        return self.summary()
