"""The report's part on an attention's own off-switch (issue 51): where the model has a learned
sink logit or sink slots, the null mass beside the first-token mass; where it has output gates, the
gate census. Nothing is added for a model without either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from massive_lens.attention.gates import gate_census, gate_sites
from massive_lens.attention.null_mass import null_mass, off_switch_layers
from massive_lens.core.model_view import ModelView
from massive_lens.report.render import Section


def off_switch_part(model: Any, texts: Sequence[str], s: Section) -> None:
    """Add the null mass and the gate census to ``s`` where ``model``'s attention has them.

    >>> from massive_lens import tiny_model
    >>> s = Section("Attention")
    >>> off_switch_part(tiny_model("gpt_oss"), ["Hello world."], s)
    >>> [kind for kind, _, _ in s.blocks]
    ['pre', 'table']
    """
    view = ModelView(model)
    if off_switch_layers(view)[1]:
        result = null_mass(model, list(texts))
        s.pre(result.summary())
        s.table(result.to_frame(), "null mass per layer and head: the attention to the learned sink logit or slot "
                "(exp(s - LSE), the sink's logit in the normaliser) beside the first-token mass over the same queries")
    if gate_sites(view)[1]:
        census = gate_census(model, list(texts))
        s.pre(census.summary())
        s.table(census.to_frame(), f"output gates per layer and head: share below {census.threshold:g} (shut), mean "
                "gate, gate at the first token, and the tokens where the head's gate is widest open")
