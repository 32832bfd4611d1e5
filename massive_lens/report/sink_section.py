"""The report's sections on sinks as the field now measures them, and its half-precision line.

- :func:`sinks_section`: the sink census over the evaluation sequences (every sink, its level
  and its life), the sink's key and value per head, and the dormant heads of the text;
- :func:`precision_line`: whether float16 and bfloat16 hold the model's activations, from the
  float32 measurement alone (:func:`~massive_lens.handover.precision_check` with
  ``confirm=False``: no copy of the model in another dtype, and no fix recommended), or with
  ``full`` confirmed by running in each dtype (a fix shown only as measured).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from massive_lens.attention import dormant_heads, find_sinks, sink_census, sink_kv
from massive_lens.handover import precision_check
from massive_lens.report.inputs import Inputs
from massive_lens.report.render import Section
from massive_lens.report.sections import SECOND_TEXT, quantize_section

CENSUS_COLUMNS = ["seq", "pos", "token", "token_kind", "level", "first_layer", "last_layer", "layer", "peak_mass",
                  "heads", "norm_ratio", "cos_first", "mlp_layer", "neuron", "in_rule"]
KV_COLUMNS = ["key_ratio", "key_cos_query", "bias_share", "value_ratio", "sink_mass", "drain"]


def sinks_section(inputs: Inputs, s: Section) -> None:
    """Census over the evaluation sequences; keys, values and dormant heads on the two short texts."""
    census = sink_census(inputs.model, inputs.eval_tokens, batch_size=inputs.batch_size)
    s.text(f"Census over {inputs.eval_source}. A position acts as a sink at a layer when one head gives it more "
           f"than {census.rule.threshold:g} of its attention (Gu et al.'s threshold, per head); primary sinks are "
           "the first token and what the sink rule counts (the sinks every other analysis and intervention uses), "
           f"secondary sinks the other positions that act as sinks in at least {census.min_layers} layers, "
           "transient the rest.")
    s.pre(census.summary())
    s.figure(census.plot(), "sink census: sinks per layer, by level")
    frame = census.to_frame()
    lasting = frame[frame["level"] != "transient"]
    if not lasting.empty:
        s.table(lasting[[c for c in CENSUS_COLUMNS if c in lasting]].round(3),
                "primary and secondary sinks: life (first and last layer), peak layer and mass, heads that treat it "
                "as a sink, residual norm and cosine to the first token's at the peak, and the MLP (and neuron) "
                "that grew it most")
    if not census.by_kind.empty:
        s.table(census.by_kind.round(3), "how often each token kind becomes a secondary sink, and at which layers")
    texts = [inputs.text, SECOND_TEXT]
    sinks = find_sinks(inputs.model, texts)  # once, for both analyses below
    kv = sink_kv(inputs.model, texts, sinks=sinks)
    s.pre(kv.summary())
    s.figure(kv.plot(), "the sink's key and value against the other tokens', per layer (medians over heads)")
    s.table(kv.to_frame().groupby("layer")[KV_COLUMNS].median().round(3).reset_index(),
            "per layer, medians over heads: key_ratio (sink key norm / other keys' median), key_cos_query, "
            "bias_share (share of each query's logit on the sink that one constant per head explains), "
            "value_ratio, sink_mass (attention to the sink), drain (sink_mass x sink value norm)")
    dormant = dormant_heads(inputs.model, texts, sinks=sinks)
    s.pre(dormant.summary())
    s.figure(dormant.plot(), "dormant heads: attention on the sinks against output norm, per head")


def precision_line(inputs: Inputs, s: Section) -> None:
    """One line per half-precision dtype (float32 models only: the check measures in float32).

    A fix (the layers to keep in float32) is shown only when a run confirmed it: with ``full``
    the check runs the model in each dtype and searches the fewest layers to keep; by default
    it predicts from float32 alone and recommends no fix (a predicted one was not enough on an
    unseen model, whose run still gave NaN)."""
    if inputs.view.dtype != torch.float32:
        s.note(f"Half-precision check not run: the model is in {inputs.view.dtype}, and the check measures in "
               "float32 (massive-lens precision on a float32 load).")
        return
    confirm = inputs.settings.full
    check = precision_check(inputs.model, inputs.eval_tokens[:2], confirm=confirm)
    if confirm:
        s.text("Half precision, run in each dtype on the first two evaluation sequences; each fix below was "
               "measured (the model run with those layers in float32):")
    else:
        check = replace(check, verdicts=check.verdicts.assign(fix=""))  # predicted fixes are not advice
        s.text("Half precision, predicted from the float32 activations of the first two evaluation sequences (not run "
               "in each dtype). No fix is recommended from a prediction: `massive-lens precision` (or this report "
               "with --full) runs the model in each dtype and names only fixes a run confirmed.")
    s.pre(check.summary())


def quantize_and_precision(inputs: Inputs, s: Section) -> None:
    """What the outliers cost under W8A8, then whether half precision holds the activations."""
    quantize_section(inputs, s)
    precision_line(inputs, s)
