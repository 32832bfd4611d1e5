"""What half precision cannot hold, measured in float32: each site's peaks (:class:`SitePeaks`,
reduced inside the hooks), the dtypes' spacing, and the problems the peaks make in each dtype
(:func:`problems_in`). :func:`~massive_lens.handover.precision.precision_check` measures with them,
then confirms by running the model in each dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.errors import MassiveLensError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# per block: (hook, what it is); a norm's input is also checked for its sum of squares
SITES = (("hook_resid_pre", "residual"), ("hook_resid_mid", "residual"), ("hook_resid_post", "residual"),
         ("attn.hook_q", "attention"), ("attn.hook_k", "attention"), ("attn.hook_v", "attention"),
         ("hook_attn_out", "attention"), ("mlp.hook_pre", "mlp"), ("mlp.hook_post", "mlp"),
         ("hook_mlp_out", "mlp"), ("ln1.hook_in", "norm"), ("ln2.hook_in", "norm"),
         ("attn.hook_attn_scores", "scores"))
PROBLEMS = ("overflow", "square_overflow", "variance_overflow", "rounds_away")
PROBLEM_COLUMNS = ["dtype", "problem", "site", "layer", "seq", "pos", "dim", "value", "limit", "count"]


def spacing(value: Float[Tensor, "..."], dtype: torch.dtype) -> Float[Tensor, "..."]:
    """The gap between neighbouring numbers of ``dtype`` at ``|value|`` (its unit in the last place).

    >>> spacing(torch.tensor([25000.0, 1.0]), torch.bfloat16).tolist()
    [128.0, 0.0078125]
    """
    info = torch.finfo(dtype)
    mag = value.abs().float().clamp(min=info.tiny)
    return info.eps * torch.exp2(torch.floor(torch.log2(mag)))


def dtype_of(name: str) -> torch.dtype:
    """``"float16"`` or ``"bfloat16"`` to the torch dtype (anything else is an error)."""
    if name not in DTYPES:
        raise MassiveLensError(f"dtypes are half-precision dtype names, some of {tuple(DTYPES)}; got {name!r}")
    return DTYPES[name]


class SitePeaks:
    """Float32 statistics per (site, layer), reduced inside the hooks."""

    def __init__(self, dtypes: Sequence[torch.dtype], centred: bool, attn_scale: float):
        self.dtypes, self.centred, self.attn_scale = dtypes, centred, attn_scale
        self.rows: list[dict[str, Any]] = []

    def hook(self, x: Tensor, hook: Any, *, site: str, kind: str, layer: int) -> None:
        x = x.detach().float()
        if kind == "scores":  # [batch head query key] -> q.k before the scaling, at causal entries only
            n = x.shape[-1]
            real = torch.ones(n, n, dtype=torch.bool, device=x.device).tril() & (x > torch.finfo(x.dtype).min / 2)
            x = (x * self.attn_scale).masked_fill(~real, 0.0).abs().amax(1)  # [batch query key], largest head
        x = x.flatten(2) if x.ndim > 3 else x  # [batch pos head d_head] -> [batch pos dim]
        mag = x.abs()
        median = float(mag.median()) if kind != "scores" else float("nan")
        flat = int(mag.argmax())
        seq, pos, dim = (int(i) for i in torch.unravel_index(torch.tensor(flat), mag.shape))
        row = dict(site=site, kind=kind, layer=layer, seq=seq, pos=pos, dim=dim, value=float(x[seq, pos, dim]),
                   max_abs=float(mag.max()), median=median, max_square=float("nan"), max_variance=float("nan"),
                   sq_seq=-1, sq_pos=-1, sq_dim=-1, var_seq=-1, var_pos=-1)
        for dtype in self.dtypes:
            limit = torch.finfo(dtype).max
            row[f"over:{dtype}"] = int((mag > limit).sum())
            row[f"round:{dtype}"] = int((spacing(mag, dtype) > median).sum()) if kind != "scores" else 0
        if kind == "norm":  # what the norm computes: squares (centred for LayerNorm), then their mean
            sq = (x - x.mean(-1, keepdim=True) if self.centred else x).double().pow(2)
            var = sq.mean(-1)
            s_seq, s_pos, s_dim = (int(i) for i in torch.unravel_index(sq.argmax(), sq.shape))
            v_seq, v_pos = (int(i) for i in torch.unravel_index(var.argmax(), var.shape))
            row.update(max_square=float(sq.max()), sq_seq=s_seq, sq_pos=s_pos, sq_dim=s_dim,
                       max_variance=float(var.max()), var_seq=v_seq, var_pos=v_pos)
            for dtype in self.dtypes:
                limit = torch.finfo(dtype).max
                row[f"sq:{dtype}"] = int((sq.amax(-1) > limit).sum())
                row[f"var:{dtype}"] = int((var > limit).sum())
        self.rows.append(row)


def problems_in(frame: pd.DataFrame, name: str, dtype: torch.dtype, limit: float) -> list[tuple]:
    """The problems of ``dtype`` (named ``name``, largest value ``limit``) in the :class:`SitePeaks` rows
    ``frame``: one ``PROBLEM_COLUMNS`` tuple per (problem, site, layer), in the order of the rows."""
    out = []
    counts = [c for c in frame.columns if ":" in c]
    frame = frame.assign(**{c: frame[c].fillna(0).astype(int) for c in counts})  # NaN where a site is no norm
    for r in frame.to_dict("records"):
        if r[f"over:{dtype}"]:
            out.append((name, "overflow", r["site"], r["layer"], r["seq"], r["pos"], r["dim"], r["value"], limit,
                        r[f"over:{dtype}"]))
        if r["kind"] == "norm" and r[f"sq:{dtype}"]:
            out.append((name, "square_overflow", r["site"], r["layer"], r["sq_seq"], r["sq_pos"], r["sq_dim"],
                        r["max_square"], limit, r[f"sq:{dtype}"]))
        if r["kind"] == "norm" and r[f"var:{dtype}"]:
            out.append((name, "variance_overflow", r["site"], r["layer"], r["var_seq"], r["var_pos"], -1,
                        r["max_variance"], limit, r[f"var:{dtype}"]))
        if r[f"round:{dtype}"]:
            out.append((name, "rounds_away", r["site"], r["layer"], r["seq"], r["pos"], r["dim"], r["value"],
                        r["median"], r[f"round:{dtype}"]))
    return out
