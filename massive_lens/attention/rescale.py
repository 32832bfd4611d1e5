"""Rescaler or contributor, and the massive tokens after the norm: :func:`norm_roles`.

A massive entry sits in the residual that the next block reads through its norm. It can act in
two ways (Qiu et al. 2026): as a **rescaler**, its dims take most of the norm's denominator
(``sum_{massive} x_d^2 / sum_d x_d^2``, after centring for LayerNorm) and so shrink every other
dim, while the norm's weight keeps them out of what the block reads; or as a **contributor**, its
dims carry as large a share of the norm's output (``sum_{massive} y_d^2 / sum_d y_d^2``, ``y`` the
normalised, weighted state: the next block's input) as of the denominator. ``role`` is
``rescaler`` when the denominator share is more than twice the output share, else
``contributor``. (The output share is read at the norm's output, the block's input, not at the
block's output, which is not linear in it.)

After the norm (Sun et al. 2026), the massive tokens' states are nearly identical and sparse: per
layer, the mean pairwise cosine between the normalised states of the massive tokens across
sequences and texts, and their sparsity (the share of the squared norm in the top ``k`` dims,
``k`` the number of dims massive at that layer), beside the same numbers on the raw residual.
One forward pass, reading each layer's ``ln1`` input, scale and output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.circuit_split import TOL, read_norm
from massive_lens.core.checks import full_precision
from massive_lens.core.criterion import Criterion, as_criterion, massive_mask
from massive_lens.core.gather import LayerGather
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

RESCALER_RATIO = 2.0  # denominator share / output share above which the entry is a rescaler
COLUMNS = ["layer", "seq", "pos", "token", "dims", "value", "denominator_share", "output_share", "role"]
LAYER_COLUMNS = ["layer", "n_tokens", "top_k", "cos_normed", "cos_raw", "sparsity_normed", "sparsity_raw",
                 "value"]


@dataclass(frozen=True, kw_only=True)
class NormRoles(Result):
    """Per massive token and layer, rescaler or contributor; per layer, the massive tokens after the norm.

    ``to_frame()``: ``layer`` (the block whose norm reads it), ``seq``, ``pos``, ``token``, ``dims``
    (the massive dims, comma-separated), ``value`` (the largest |value|), ``denominator_share``,
    ``output_share``, ``role``. ``.layers``: ``layer``, ``n_tokens`` (massive tokens there),
    ``top_k``, ``cos_normed``/``cos_raw`` (mean pairwise cosine; NaN with fewer
    than two tokens), ``sparsity_normed``/``sparsity_raw`` (share of the squared norm in the top
    ``top_k`` dims), ``value`` (median largest |value|).
    """

    frame: pd.DataFrame
    layers: pd.DataFrame
    model_name: str
    n_seqs: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def headline(self) -> pd.Series:
        """The row of the largest massive entry."""
        return self.frame.loc[self.frame["value"].idxmax()]

    def summary(self) -> str:
        if self.frame.empty:
            return f"{self.model_name}: no massive entries in the text, so no rescaler or contributor to name"
        top, f = self.headline(), self.frame
        share = (f["role"] == "rescaler").mean()
        lay = self.layers.dropna(subset=["cos_normed"])
        text = (f"{self.model_name}: the largest massive entry ({top.value:.4g} at {top.token!r}, pos {top.pos}, dims "
                f"{top.dims}, read by block {top.layer}'s norm) takes {top.denominator_share:.0%} of the norm's "
                f"denominator and {top.output_share:.0%} of its output: a {top.role}; {share:.0%} of the "
                f"{len(f)} massive (token, layer) entries are rescalers")
        if len(lay):
            text += (f"; after the norm the massive tokens' states have mean cosine {lay['cos_normed'].median():.3f} "
                     f"(raw {lay['cos_raw'].median():.3f}) and keep {lay['sparsity_normed'].median():.0%} of their "
                     f"squared norm in the top dims (raw {lay['sparsity_raw'].median():.0%}), medians over "
                     f"{len(lay)} layers")
        return text

    def plot(self, ax: Any = None) -> Any:
        """Per layer: cosine and sparsity after the norm and raw."""
        ax = ensure_axes(ax, (7, 4))
        for col in ("cos_normed", "cos_raw", "sparsity_normed", "sparsity_raw"):
            ax.plot(self.layers["layer"], self.layers[col], marker="o", markersize=3, label=col)
        ax.set(xlabel="layer", ylabel="massive tokens", title=f"{self.model_name}: massive tokens after the norm")
        ax.legend(fontsize=7)
        return ax


def _cos(x: Tensor) -> float:
    if len(x) < 2:
        return float("nan")
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    c = u @ u.T
    n = len(x)
    return float((c.sum() - c.diagonal().sum()) / (n * (n - 1)))


def _sparsity(x: Tensor, k: int) -> float:
    sq = x.double().pow(2)
    return float((sq.topk(min(k, sq.shape[-1]), -1).values.sum(-1) / sq.sum(-1).clamp(min=1e-300)).mean())


def norm_roles(model: Any, text: Any, *, criterion: Criterion | None = None) -> NormRoles:
    """For every massive entry, rescaler or contributor at the next norm; per layer, the massive
    tokens' states after the norm against before (see the module docstring).

    Args:
        model: a TransformerLens-style model with a norm before each block's attention (``ln1``).
        text: a string, a list of strings or a token tensor.
        criterion: what counts as massive (default ``Criterion()``).

    Returns:
        A :class:`NormRoles`.

    Raises:
        MassiveLensError: if the model has no ``ln1`` input and output hooks.

    >>> from massive_lens import tiny_model
    >>> r = norm_roles(tiny_model("llama"), "Hello there, world.")
    >>> list(r.layers.columns)[:3]
    ['layer', 'n_tokens', 'top_k']
    """
    view = ModelView(model)
    full_precision(view.dtype, view.name, "norm_roles", TOL)  # the norm's form is read to TOL: not in half precision
    crit = as_criterion(criterion)
    batch = view.tokenize(text)
    tokens = view.str_tokens(batch)
    rows: list[dict[str, Any]] = []
    layer_rows: list[dict[str, Any]] = []

    def ready(layer: int, x: Tensor, scale: Tensor, y: Tensor) -> None:
        x, y = x.detach().float(), y.detach().float()
        valid = batch.mask.to(x.device)
        mask = massive_mask(x, crit, valid)
        # LayerNorm centres before dividing: the denominator is the centred input's (the form read off the output)
        norm = read_norm(view.block(layer).ln1, x[0], scale.detach().float()[0], y[0], f"{view.name}, layer {layer}")
        xc = x - x.mean(-1, keepdim=True) if norm.centre else x
        den = (xc.pow(2) * mask).sum(-1) / xc.pow(2).sum(-1).clamp(min=1e-300)
        out = (y.pow(2) * mask).sum(-1) / y.pow(2).sum(-1).clamp(min=1e-300)
        where = mask.any(-1).nonzero().tolist()
        for b, p in where:
            dims = mask[b, p].nonzero().flatten().tolist()
            d, o = float(den[b, p]), float(out[b, p])
            rows.append(dict(layer=layer, seq=b, pos=p, token=tokens[b][p], dims=",".join(map(str, dims)),
                             value=float(x[b, p].abs().max()), denominator_share=d, output_share=o,
                             role="rescaler" if d > RESCALER_RATIO * o else "contributor"))
        k = max(int(mask.any((0, 1)).sum()), 1)
        idx = torch.tensor(where, dtype=torch.long).reshape(-1, 2)
        raw, normed = x[idx[:, 0], idx[:, 1]], y[idx[:, 0], idx[:, 1]]
        layer_rows.append(dict(layer=layer, n_tokens=len(idx), top_k=k, cos_normed=_cos(normed), cos_raw=_cos(raw),
                               sparsity_normed=_sparsity(normed, k) if len(idx) else float("nan"),
                               sparsity_raw=_sparsity(raw, k) if len(idx) else float("nan"),
                               value=float(raw.abs().amax(-1).median()) if len(idx) else float("nan")))

    gather = LayerGather(("x", "scale", "y"), ready)
    hooks = []
    for layer in range(view.n_layers):
        if not all(view.has_hook(layer, f"ln1.hook_{k}") for k in ("in", "scale", "out")):
            raise MassiveLensError(f"{view.name}: block {layer} has no ln1.hook_in/scale/out; norm_roles reads the "
                                   "norm before each block's attention (a model without one has no rescaling to "
                                   "measure)")
        hooks += [(view.hook_name(layer, "ln1.hook_in"), gather.hook("x", layer)),
                  (view.hook_name(layer, "ln1.hook_scale"), gather.hook("scale", layer)),
                  (view.hook_name(layer, "ln1.hook_out"), gather.hook("y", layer))]
    view.forward(batch, hooks, stop_after=view.hook_name(view.n_layers - 1, "ln1.hook_out"))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return NormRoles(frame=frame, layers=pd.DataFrame(layer_rows, columns=LAYER_COLUMNS), model_name=view.name,
                     n_seqs=len(batch.tokens))

