"""Where a massive activation comes from: :func:`trace_origin` and its :class:`OriginTrace`.

Modules: ``capture`` (the one forward pass), ``ledger`` (the exact per-component sum and
its events), ``neurons`` (neurons, super weights, why this token), ``verify`` (causal
checks), ``story`` (the summary text), ``trace`` (the entry point).
"""

from massive_lens.origin.trace import OriginTrace, trace_origin

__all__ = ["OriginTrace", "trace_origin"]
