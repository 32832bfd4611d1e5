"""The :class:`Intervention`: forward hooks plus a context manager that always removes them,
and the check of what its targets hold downstream.

>>> from massive_lens import tiny_model
>>> iv = Intervention(tiny_model("gpt2"), "original", [])
>>> iv.label, len(iv), iv.active
('original', 0, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import pandas as pd

from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.checks import Record, downstream, reading
from massive_lens.interventions.state import HookState

WHERE = {"first": "first layer", "every": "every massive layer"}


class Intervention:
    """Forward hooks plus a context manager that attaches them and always removes them.

    ``record``: what its hooks measured so far (see :meth:`check`); ``acts_on``: where it
    edits the forward pass, relative to the model's norms; ``where``: ``first`` or
    ``every`` for massive-activation edits. Its record of the attention on the sinks needs
    :meth:`reading` around each forward on a view that serves no pattern (nnsight).
    """

    descriptions: ClassVar[dict[str, str]] = {}  # name -> what it does: filled from the registry's rows

    def __init__(self, model: Any, name: str, fwd_hooks: list[tuple[str, Callable]], *,
                 state: HookState | None = None, acts_on: str = "", where: str = "", removes: bool = False,
                 edits_massive: bool = False, uses_sinks: bool = False,
                 observer: Callable[[], Intervention] | None = None):
        self.model, self.name, self.fwd_hooks = model, name, fwd_hooks
        self.acts_on, self.where = acts_on, where
        self.removes, self.edits_massive, self.uses_sinks = removes, edits_massive, uses_sinks
        self._state = state or HookState()
        self._observer = observer
        self._stack: list[Any] = []

    @property
    def description(self) -> str:
        """What it does, from its row in :data:`~massive_lens.interventions.REGISTRY`."""
        return self.descriptions.get(self.name, self.name)

    @property
    def record(self) -> Record:
        """What this intervention's hooks measured over every forward pass so far."""
        return self._state.record

    def reading(self) -> contextlib.AbstractContextManager:
        """What a forward run with its hooks needs around it for the record of the attention on
        the sinks: on a view that serves no pattern (nnsight) the fused kernel, whose log-sum-exp
        gives that attention; elsewhere nothing (its hooks read the pattern).

        >>> from massive_lens import tiny_model
        >>> from massive_lens.interventions import observe
        >>> from massive_lens.metrics import perplexity
        >>> iv = observe(tiny_model("llama"), calibration="Calibrate on this. " * 10)
        >>> with iv.reading():
        ...     _ = perplexity(iv.model, "Some text to read. " * 10, seq_len=16, hooks=iv, progress=False)
        >>> len(iv.record.mass) > 0
        True
        """
        return self._state.reading_context()

    @property
    def label(self) -> str:
        """The name, with where a massive-activation edit acts (``zero (first layer)``)."""
        return f"{self.name} ({WHERE[self.where]})" if self.where else self.name

    def check(self, text: Any) -> pd.DataFrame:
        """Run ``text`` untouched and under this intervention, and compare what the targets hold downstream.

        Args:
            text: a string, a list of strings or a token tensor (with ``sinks=`` given as a
                mask, of the same shape).

        Returns:
            A DataFrame with one row per target and layer: ``kind`` (``massive``: a targeted
            dim's mean ``|value|`` at the positions it targeted; ``sink_mass``: attention of
            non-sink queries to the sinks), ``dim``, ``layer``, ``without``, ``with``,
            ``kept`` (with / without); ``.attrs["verdict"]`` holds the one-line reading
            (e.g. "zero (first layer): dim 5 back to 95% of its value by layer 2; the model
            rebuilds it").

        Raises:
            MassiveLensError: if this intervention has nothing to check (``patch_sink_from``).
        """
        if self._observer is None or self._state.calib is None:
            raise MassiveLensError(f"{self.name} records no downstream check (it has no calibrated targets)")
        view = ModelView(self.model)
        batch = view.tokenize(text)
        base = self._observer()
        with base.reading():
            view.forward(batch, base.fwd_hooks)
        kept, self._state.record = self._state.record, Record()
        try:
            with self.reading():
                view.forward(batch, self.fwd_hooks)
        finally:
            mine, self._state.record = self._state.record, kept
        frame = downstream(base.record, mine)
        calib = self._state.calib
        frame.attrs["verdict"] = reading(frame, label=self.label, first_layer=calib.first_layer,
                                         massive_layers=calib.massive_layers, removes=self.removes,
                                         edits_massive=self.edits_massive, uses_sinks=self.uses_sinks)["check"]
        return frame

    def __iter__(self):
        return iter(self.fwd_hooks)

    def __len__(self) -> int:
        return len(self.fwd_hooks)

    @property
    def active(self) -> bool:
        """Whether its hooks are attached now (inside ``with``); entering again is refused."""
        return bool(self._stack)

    def __enter__(self) -> Intervention:
        if self._stack:
            raise MassiveLensError(
                f"{self.label} is already active (inside its own with block); entering it again would "
                "attach its hooks twice and apply its edit twice. Use one with block, or build a second "
                "intervention to stack two edits"
            )
        view = ModelView(self.model)
        if not view.serves_patterns:  # nnsight: hooks run inside a trace, never attached to the model
            raise view.unsupported(f"{self.label} used as a context manager (with ...:), which attaches hooks "
                                   "outside a forward pass; pass it as hooks= to perplexity or use run_interventions")
        ctx = self.model.hooks(fwd_hooks=self.fwd_hooks)
        ctx.__enter__()
        self._stack.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        if not self._stack:
            raise MassiveLensError(f"{self.label} was exited without being entered; use it as `with intervention:`")
        return self._stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"Intervention({self.name!r}: {self.description}; {len(self.fwd_hooks)} hooks)"
