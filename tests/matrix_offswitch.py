"""The matrix's columns for an attention's own off-switch (issue 51): ``null_mass`` (the attention to
a learned sink logit, gpt-oss) on both paths against transformers' eager attention with sinks (one
minus the keys' weights, which drop the sink's column), and ``gate_census`` (Qwen3-Next / Qwen3.5's
output gate) against the sigmoid of the gate half of the reference model's ``q_proj`` output.
An architecture without the off-switch is not applicable (``n/a``)."""

from __future__ import annotations

from typing import Any

import torch

from massive_lens.attention.gates import GATE_THRESHOLD, gate_census, gate_sites
from massive_lens.attention.null_mass import null_mass, off_switch_layers
from massive_lens.core.lse import lse_support
from massive_lens.core.model_view import ModelView

TOL = 1e-5  # attention shares and gates in float32


def check_null_mass(b: Any) -> str | None:
    view = ModelView(b.model)
    if not off_switch_layers(view)[1]:
        return "n/a: no learned sink logit or sink slot"
    with torch.no_grad():
        weights = b.ref(b.tokens, output_attentions=True).attentions
    paths = ["eager"] + (["lse"] if lse_support(view) is None else [])
    for path in paths:
        frame = null_mass(b.model, b.tokens, attention=path).to_frame()
        for layer, w in enumerate(weights):
            if w is None or layer not in set(frame.layer):
                continue
            want = (1 - w[0, :, 1:].float().sum(-1)).mean(-1)  # [head]
            got = torch.tensor(frame[frame.layer == layer].null_mass.to_numpy(), dtype=torch.float32)
            err = float((got - want).abs().max())
            assert err < TOL, f"{path}: null mass of layer {layer} differs from transformers by {err:.1e}"
    return None if len(paths) == 2 else f"eager path only: {lse_support(view)}"


def check_gates(b: Any) -> str | None:
    kind, layers = gate_sites(ModelView(b.model))
    if not layers:
        return "n/a: no output gate"
    census = gate_census(b.model, b.tokens).to_frame()
    cfg = b.ref.config
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out))
               for i, layer in enumerate(b.ref.model.layers) if i in layers]
    try:
        with torch.no_grad():
            b.ref(b.tokens)
    finally:
        for h in handles:
            h.remove()
    for layer, out in seen.items():
        gate = torch.sigmoid(out[0].float().view(out.shape[1], cfg.num_attention_heads, -1)[..., cfg.head_dim:])
        mine = census[census.layer == layer]
        shut = (gate < GATE_THRESHOLD).float().mean((0, 2))
        for column, want in (("mean_gate", gate.mean((0, 2))), ("shut_share", shut)):
            err = float((torch.tensor(mine[column].to_numpy(), dtype=torch.float32) - want).abs().max())
            assert err < TOL, f"gate {column} of layer {layer} differs from q_proj's gate by {err:.1e}"
    return None


ANALYSES = {"null_mass": check_null_mass, "gate_census": check_gates}
