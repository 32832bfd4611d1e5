"""The report's section on why the first token is the sink: with ``full=True`` (``--full``),
:func:`~massive_lens.attention.sink_circuit` on the evaluation sequences, the logit split per sink
head and each removal alone (the causal check on the same sequences). The light default only names
the call: the split's pass raised the default report's peak from 1.39x to 1.52x the weights and the
causal check cost 40+ s (measured on the default model), more than the section earns on a first
screen. A text with no sink head says so instead of failing the report.
"""

from __future__ import annotations

from massive_lens.attention import sink_circuit
from massive_lens.errors import MassiveLensError
from massive_lens.report.inputs import Inputs
from massive_lens.report.render import Section

HEAD_COLUMNS = ["layer", "head", "sink_mass", "logit", "dominant", "dominant_share", "massive_share", "b_q",
                "content", "check"]
CAUSAL_COLUMNS = ["layer", "head", "removal", "mass_before", "mass_after", "mass_after_low", "mass_after_high",
                  "loss_ratio", "loss_ratio_low", "loss_ratio_high", "kills"]
N_HEADS = 6  # sink heads the report splits (the function's default is 12)


def circuit_section(inputs: Inputs, s: Section) -> None:
    """With ``full``: the split on the first two evaluation sequences, the causal check on all of them."""
    tokens = inputs.eval_tokens
    if not inputs.settings.full:
        s.note("Not run in the light default: `full=True` (`--full`) adds this section, or run `massive-lens "
               "sink-circuit` (docs/circuit.md) for the sink's circuit and the one removal that kills it.")
        return
    try:
        circuit = sink_circuit(inputs.model, tokens[:2], n_heads=N_HEADS, corpus=tokens, n_seqs=len(tokens),
                               seq_len=tokens.shape[1])
    except MassiveLensError as exc:
        s.note(f"sink_circuit did not run: {exc}")
        return
    s.text(f"Each of the top {N_HEADS} sink heads' attention logit on the first token, split exactly into the "
           "sink residual's writers (massive dims against the rest, through the layer's norm at its measured "
           "scale, W_K, b_K and the rotary rotation) and, on the query side, b_Q against the content; then each "
           f"removal alone on the {len(tokens)} evaluation sequences (`massive-lens sink-circuit`, docs/circuit.md).")
    s.pre(circuit.summary())
    s.figure(circuit.plot(), "the logit on the sink per head, by part (key side); the black mark is the sum")
    s.table(circuit.heads[HEAD_COLUMNS].round(3),
            "per sink head: attention on the first token, mean logit, its dominant key-side writer and share, the "
            "massive dims' share, b_Q and content (query side), and the check (parts against the model's scores)")
    if len(circuit.causal):
        s.table(circuit.causal[CAUSAL_COLUMNS].round(3),
                "each removal alone: attention on the first token before and after (95% interval over sequences), "
                "the next-token loss ratio (paired), and whether it kills the sink (below the sink threshold)")
