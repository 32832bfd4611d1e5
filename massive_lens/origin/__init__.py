"""Where a massive activation comes from: :func:`trace_origin` and its :class:`OriginTrace`.

Modules: ``capture`` (the one forward pass), ``ledger`` (the exact per-component sum and
its events), ``neurons`` (neurons, super weights, why this token), ``verify`` (causal
checks), ``story`` (the summary text), ``trace`` (the entry point), ``superweights``
(:func:`verify_super_weights`: the trace's candidate super weights against the loss each
one's removal costs).
"""

from massive_lens.origin.superweights import SuperWeightCheck, verify_super_weights
from massive_lens.origin.trace import OriginTrace, trace_origin

__all__ = ["OriginTrace", "SuperWeightCheck", "trace_origin", "verify_super_weights"]
