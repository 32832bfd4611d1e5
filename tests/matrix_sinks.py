"""The matrix's columns for the sink census, the sink's keys and values, and dormant heads
(issue 22), each checked against the Hugging Face reference model's own attention weights and
projections (``output_attentions`` of the eager model, and forward hooks on ``v_proj`` and
``o_proj`` where the attention has them), computed here independently of massive_lens.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from massive_lens.attention import dormant_heads, sink_attention, sink_census, sink_kv
from massive_lens.core.criterion import SinkRule
from massive_lens.core.lse import lse_support
from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError

TOL = 1e-4  # float32
QUERIES = 64  # Gu et al.: a key's attention is averaged over the (up to) 64 queries after it


def reference(b: Any, modules: tuple[str, ...] = ()) -> tuple[list[torch.Tensor | None], dict[tuple[int, str], Any]]:
    """The reference model's attention weights per layer (None where it returns none) and, per
    (layer, name) for each name in ``modules`` (``v_proj``: output; ``o_proj``: input), what that
    linear layer saw, where the attention has one."""
    found: dict[tuple[int, str], torch.nn.Module] = {}
    pattern = re.compile(r"\.(\d+)\.(?:self_attn|attn|attention)\.(" + "|".join(modules or ("-",)) + r")$")
    for name, module in b.ref.named_modules():
        if (m := pattern.search(name)) and isinstance(module, torch.nn.Linear):
            found[int(m[1]), m[2]] = module
    seen: dict[tuple[int, str], Any] = {}
    handles = []
    for key, module in found.items():
        if key[1] == "o_proj":
            handles.append(module.register_forward_pre_hook(lambda mod, args, key=key: seen.__setitem__(key, args[0])))
        else:
            handles.append(module.register_forward_hook(lambda mod, args, out, key=key: seen.__setitem__(key, out)))
    try:
        with torch.no_grad():
            attentions = list(b.ref(b.tokens, output_attentions=True).attentions)
    finally:
        for h in handles:
            h.remove()
    seen = {k: (v, found[k]) for k, v in seen.items()}
    return attentions, seen


def key_mass(pattern: torch.Tensor, min_queries: int) -> torch.Tensor:
    """[head, key]: each key's mean attention from the (up to 64) queries after it; 0 for a key
    with fewer than ``min_queries`` of them (sequence 0 of the batch)."""
    p = pattern[0].float()
    heads, n, _ = p.shape
    out = torch.zeros(heads, n)
    for k in range(n):
        queries = list(range(k + 1, min(n, k + QUERIES + 1)))
        if len(queries) >= min_queries:
            out[:, k] = p[:, queries, k].mean(-1)
    return out


def check_census(b: Any) -> str | None:
    """Every position that some head gives more than the threshold at some layer is in the
    census, in as many layers and with the same peak mass (and, where transformers returns a
    pattern for every layer, the same first and last layer); no other position is. The
    threshold is lowered to 0.1 so that a random tiny model has sinks to list (at 0.3 most list
    none). A hybrid model's reference returns the patterns of its attention layers only."""
    rule = SinkRule(threshold=0.1)
    frame = sink_census(b.model, b.tokens, rule=rule).to_frame()
    patterns = [p for p in reference(b)[0] if p is not None]
    best = [key_mass(p, rule.min_queries).max(0).values for p in patterns]
    acting = [set((m > rule.threshold).nonzero().flatten().tolist()) for m in best]
    assert sorted(frame["pos"]) == sorted(set().union(*acting)), (sorted(frame["pos"]), acting)
    every_layer = len(patterns) == b.model.cfg.n_layers
    for row in frame.itertuples():
        layers = [i for i, positions in enumerate(acting) if row.pos in positions]
        assert row.n_layers == len(layers), (row, layers)
        assert not every_layer or (row.first_layer, row.last_layer) == (layers[0], layers[-1]), (row, layers)
        peak = max(float(m[row.pos]) for m in best)
        assert abs(row.peak_mass - peak) < TOL, (row.peak_mass, peak)
    return None


def _sink_mass(pattern: torch.Tensor) -> torch.Tensor:
    """[head]: the attention the queries after the first token put on it."""
    return pattern[0, :, 1:, 0].float().mean(-1)


def check_kv(b: Any) -> str | None:
    """Attention to the sink per head against transformers' attention weights; the sink's value
    norm and the others' median against ``v_proj``'s output, where the attention has one."""
    frame = sink_kv(b.model, b.tokens, sinks=[0]).to_frame()
    attentions, seen = reference(b, ("v_proj",))
    for layer, pattern in enumerate(attentions):
        mine = frame[frame["layer"] == layer].sort_values("head")
        if pattern is not None:
            err = (torch.tensor(mine["sink_mass"].to_numpy(), dtype=torch.float32) - _sink_mass(pattern)).abs().max()
            assert err < TOL, f"sink mass of layer {layer} differs from transformers by {float(err):.1e}"
        if (layer, "v_proj") in seen:
            v, _ = seen[layer, "v_proj"]
            norms = v[0].float().view(v.shape[1], _kv_heads(b), -1).norm(dim=-1)  # [pos kv_head]
            group = len(mine) // norms.shape[1]
            want = norms[0].repeat_interleave(group)
            err = (torch.tensor(mine["value_norm"].to_numpy(), dtype=torch.float32) - want).abs().max()
            assert err < TOL * max(1.0, float(want.abs().max())), (layer, float(err))
            median = norms[1:].median(0).values.repeat_interleave(group)
            err = (torch.tensor(mine["value_median"].to_numpy(), dtype=torch.float32) - median).abs().max()
            assert err < TOL * max(1.0, float(median.abs().max())), (layer, float(err))
    return None


def _kv_heads(b: Any) -> int:
    cfg = b.ref.config
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def check_dormant(b: Any) -> str | None:
    """Attention on the sink per head against transformers' attention weights; each head's
    output norm against ``o_proj``'s input, sliced per head and multiplied by its columns."""
    frame = dormant_heads(b.model, b.tokens, sinks=[0]).to_frame()
    attentions, seen = reference(b, ("o_proj",))
    for layer, pattern in enumerate(attentions):
        mine = frame[frame["layer"] == layer].sort_values("head")
        if pattern is not None:
            err = (torch.tensor(mine["sink_mass"].to_numpy(), dtype=torch.float32) - _sink_mass(pattern)).abs().max()
            assert err < TOL, f"sink mass of layer {layer} differs from transformers by {float(err):.1e}"
        if (layer, "o_proj") in seen:
            z, proj = seen[layer, "o_proj"]
            heads = len(mine)
            z = z[0].float().view(z.shape[1], heads, -1)  # [pos head d_head]
            w = proj.weight.float().view(proj.weight.shape[0], heads, -1)  # [d_model head d_head]
            out = torch.einsum("phd,mhd->phm", z, w).norm(dim=-1).mean(0)  # [head]
            err = (torch.tensor(mine["out_norm"].to_numpy(), dtype=torch.float32) - out).abs().max()
            assert err < TOL * max(1.0, float(out.max())), (layer, float(err))
    return None


LSE_TOL = 1e-5  # relative to the column's largest value (norms are large, attention shares at most 1)


def check_lse(b: Any) -> str | None:
    """The LSE path (attention from q, k and the fused kernel's log-sum-exp) gives the eager
    path's tables: sink_attention, dormant_heads and the census (threshold 0.1); a model that has
    none says why (the reason is the cell)."""
    reason = lse_support(ModelView(b.model))
    if reason is not None:
        raise MassiveLensError(f"{b.arch}: no LSE path: {reason}")
    runs = (lambda a: sink_attention(b.model, b.tokens, sinks=[0], attention=a),
            lambda a: dormant_heads(b.model, b.tokens, sinks=[0], attention=a),
            lambda a: sink_census(b.model, b.tokens, rule=SinkRule(threshold=0.1), attention=a))
    for run in runs:
        eager, lse = run("eager"), run("lse")
        fa, fb = eager.to_frame(), lse.to_frame()
        assert lse.attention == "lse" and len(fa) == len(fb), (type(lse).__name__, len(fa), len(fb))
        num = fa.select_dtypes("number").columns
        scale = fa[num].abs().max().clip(lower=1.0)
        err = ((fa[num] - fb[num]).abs() / scale).max().max() if len(fa) else 0.0
        assert err < LSE_TOL, f"{type(lse).__name__}: the LSE path differs from the eager one by {err:.1e}"
        assert fa.drop(columns=num).equals(fb.drop(columns=num)), type(lse).__name__
    return None


ANALYSES = {"sink_census": check_census, "sink_kv": check_kv, "dormant_heads": check_dormant, "lse": check_lse}
