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

Two things are kept apart so a statistic does not read more than it measured:

- **scope** (``find_massive``'s column): an entry of an *outlier dimension* (a dim massive at most
  tokens of a layer, :class:`~massive_lens.core.outliers.OutlierTally`'s rule over the pass) is a
  property of the channel, not of the token; its dims get rows of their own (``scope ==
  "outlier_dim"``) and the summary counts them apart from the token-specific entries.
- **copies**: the first token attends only to itself, so the same first token in several sequences
  gives the same state, again and again. The per-layer cosine and sparsity are taken over the
  *distinct* token-specific massive states (equal states counted once, ``n_distinct``); a layer
  whose massive tokens are all copies of one state has no cosine (NaN), and the summary says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.circuit_split import TOL, read_norm, visible_token
from massive_lens.core.checks import full_precision
from massive_lens.core.criterion import Criterion, as_criterion, massive_mask
from massive_lens.core.gather import LayerGather
from massive_lens.core.model_view import ModelView
from massive_lens.core.outliers import OutlierTally
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

RESCALER_RATIO = 2.0  # denominator share / output share above which the entry is a rescaler
SAME_STATE = 1e-5  # relative distance under which two massive tokens' states are copies of one
COLUMNS = ["layer", "seq", "pos", "token", "scope", "dims", "value", "denominator_share", "output_share", "role"]
LAYER_COLUMNS = ["layer", "n_tokens", "n_distinct", "n_outlier", "top_k", "cos_normed", "cos_raw", "sparsity_normed",
                 "sparsity_raw", "value"]


@dataclass(frozen=True, kw_only=True)
class NormRoles(Result):
    """Per massive token and layer, rescaler or contributor; per layer, the massive tokens after the norm.

    ``to_frame()``: ``layer`` (the block whose norm reads it), ``seq``, ``pos``, ``token``, ``scope``
    (``token``: token-specific; ``outlier_dim``: the dims of an outlier dimension there, a row of
    their own), ``dims`` (the massive dims, comma-separated), ``value`` (the largest |value|),
    ``denominator_share``, ``output_share``, ``role``. ``.layers``: ``layer``, ``n_tokens``
    (token-specific massive tokens there), ``n_distinct`` (distinct states among them: copies of
    one state, as the first token's in several sequences, counted once), ``n_outlier`` (tokens
    with outlier-dimension entries only), ``top_k``, ``cos_normed``/``cos_raw`` (mean pairwise
    cosine of the distinct states; NaN with fewer than two), ``sparsity_normed``/``sparsity_raw``
    (share of the squared norm in the top ``top_k`` dims, over the distinct states), ``value``
    (median largest |value|).
    """

    frame: pd.DataFrame
    layers: pd.DataFrame
    model_name: str
    n_seqs: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def headline(self) -> pd.Series:
        """The row of the largest token-specific massive entry (the largest outlier-dimension
        entry where there is none)."""
        token = self.frame[self.frame["scope"] == "token"] if "scope" in self.frame else self.frame
        rows = token if len(token) else self.frame
        return rows.loc[rows["value"].idxmax()]

    def summary(self) -> str:
        if self.frame.empty:
            return f"{self.model_name}: no massive entries in the text, so no rescaler or contributor to name"
        top, f = self.headline(), self.frame
        scope = f["scope"] if "scope" in f else pd.Series("token", index=f.index)
        token, outlier = f[scope == "token"], f[scope == "outlier_dim"]
        text = (f"{self.model_name}: the largest {'token-specific ' if top.get('scope', 'token') == 'token' else ''}"
                f"massive entry ({top.value:.4g} at '{visible_token(str(top.token))}', pos {top.pos}, dims "
                f"{top.dims}, read by block {top.layer}'s norm) takes {top.denominator_share:.0%} of the norm's "
                f"denominator and {top.output_share:.0%} of its output: a {top.role}")
        if len(token):
            text += (f"; {(token['role'] == 'rescaler').mean():.0%} of the {len(token)} token-specific massive "
                     "(token, layer) entries are rescalers")
        if len(outlier):
            dims = sorted({int(d) for ds in outlier["dims"] for d in str(ds).split(",")})
            text += (f"; counted apart, outlier dimensions (dims {', '.join(map(str, dims[:6]))}"
                     f"{', ...' if len(dims) > 6 else ''}: massive at most tokens of a layer, a property of the "
                     f"channel): {(outlier['role'] == 'rescaler').mean():.0%} of their {len(outlier)} entries are "
                     "rescalers")
        lay = self.layers.dropna(subset=["cos_normed"])
        some = self.layers.dropna(subset=["sparsity_normed"])
        copies = self.layers[(self.layers["n_tokens"] > 1) & (self.layers["n_distinct"] == 1)]
        if len(lay):
            text += (f"; after the norm the distinct token-specific massive states have mean cosine "
                     f"{lay['cos_normed'].median():.3f} (raw {lay['cos_raw'].median():.3f}), median over the "
                     f"{len(lay)} layers with two or more distinct states (copies of one state, as the first token's "
                     "in several sequences, counted once)")
        if len(copies):
            text += (f"; in {len(copies)} layers the massive tokens are copies of one state only (no cosine to "
                     "give there)")
        if len(some):
            text += (f"; after the norm they keep {some['sparsity_normed'].median():.0%} of their squared norm in the "
                     f"top dims (raw {some['sparsity_raw'].median():.0%}), median over {len(some)} layers")
        return text

    def plot(self, ax: Any = None) -> Any:
        """Per layer: cosine and sparsity of the distinct massive states after the norm and raw."""
        ax = ensure_axes(ax, (7, 4))
        for col in ("cos_normed", "cos_raw", "sparsity_normed", "sparsity_raw"):
            ax.plot(self.layers["layer"], self.layers[col], marker="o", markersize=3, label=col)
        ax.set(xlabel="layer", ylabel="distinct massive states",
               title=f"{self.model_name}: massive tokens after the norm")
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


def distinct(x: Tensor) -> Tensor:
    """Indices of the distinct rows of ``x`` [n d]: a row within ``SAME_STATE`` (relative) of an
    earlier kept row is a copy of it and left out.

    >>> distinct(torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]])).tolist()
    [0, 2]
    """
    kept: list[int] = []
    if len(x):
        dist = torch.cdist(x.double(), x.double())
        size = x.double().norm(dim=-1).clamp(min=1e-300)
        for i in range(len(x)):
            if not any(bool(dist[i, j] <= SAME_STATE * size[j]) for j in kept):
                kept.append(i)
    return torch.tensor(kept, dtype=torch.long)


class _Entries:
    """Per layer, what the pass kept of its massive entries, for scoping after the pass: the
    (seq, pos, dim) of each with its shares, and the states of the tokens with any dim that is
    not an outlier dimension at that layer."""

    def __init__(self) -> None:
        self.dims: dict[int, list[tuple[int, int, int, float, float, float]]] = {}
        self.states: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # idx [n 2], raw, normed, mask [n d]


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
        MassiveLensError: if the model has no ``ln1`` input and output hooks, or is an nnsight model.

    >>> from massive_lens import tiny_model
    >>> r = norm_roles(tiny_model("llama"), "Hello there, world.")
    >>> list(r.layers.columns)[:3]
    ['layer', 'n_tokens', 'n_distinct']
    """
    view = ModelView(model)
    if not view.serves_patterns:  # nnsight: the norm's input, scale and output are not served
        raise view.unsupported("norm_roles (each block's ln1 input, scale and output sites)")
    full_precision(view.dtype, view.name, "norm_roles", TOL)  # the norm's form is read to TOL: not in half precision
    crit = as_criterion(criterion)
    batch = view.tokenize(text)
    tokens = view.str_tokens(batch)
    tally, kept = OutlierTally(), _Entries()

    def ready(layer: int, x: Tensor, scale: Tensor, y: Tensor) -> None:
        x, y = x.detach().float(), y.detach().float()
        valid = batch.mask.to(x.device)
        mask = massive_mask(x, crit, valid)
        flags = tally.add(layer, mask, valid, x.abs())  # [B d]: outlier dimensions here, find_massive's rule
        # LayerNorm centres before dividing: the denominator is the centred input's (the form read off the output)
        norm = read_norm(view.block(layer).ln1, x[0], scale.detach().float()[0], y[0], f"{view.name}, layer {layer}")
        xc = x - x.mean(-1, keepdim=True) if norm.centre else x
        den = xc.pow(2) / xc.pow(2).sum(-1, keepdim=True).clamp(min=1e-300)
        out = y.pow(2) / y.pow(2).sum(-1, keepdim=True).clamp(min=1e-300)
        idx = mask.nonzero()
        kept.dims[layer] = [(b, p, d, float(den[b, p, d]), float(out[b, p, d]), float(x[b, p, d].abs()))
                            for b, p, d in idx.tolist()]
        own = mask & ~flags[:, None, :]  # entries that may be token-specific
        where = own.any(-1).nonzero()
        kept.states[layer] = (where.cpu(), x[where[:, 0], where[:, 1]].cpu(), y[where[:, 0], where[:, 1]].cpu(),
                              mask[where[:, 0], where[:, 1]].cpu())

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
    rows, layer_rows = _rows(kept, tally, tokens)
    return NormRoles(frame=pd.DataFrame(rows, columns=COLUMNS), layers=pd.DataFrame(layer_rows, columns=LAYER_COLUMNS),
                     model_name=view.name, n_seqs=len(batch.tokens))


def _rows(kept: _Entries, tally: OutlierTally, tokens: list[list[str]]) -> tuple[list[dict], list[dict]]:
    """The entry rows (one per token, layer and scope) and the layer rows, once the pass has
    decided which dims are outlier dimensions at which layer."""
    rows, layer_rows = [], []
    for layer in sorted(kept.dims):
        outlier = tally.at(layer)
        groups: dict[tuple[int, int, str], list[tuple[int, float, float, float]]] = {}
        for b, p, d, den, out, value in kept.dims[layer]:
            scope = "outlier_dim" if bool(outlier[d]) else "token"
            groups.setdefault((b, p, scope), []).append((d, den, out, value))
        for (b, p, scope), dims in sorted(groups.items()):
            den, out = sum(x[1] for x in dims), sum(x[2] for x in dims)
            rows.append(dict(layer=layer, seq=b, pos=p, token=tokens[b][p], scope=scope,
                             dims=",".join(str(x[0]) for x in dims), value=max(x[3] for x in dims),
                             denominator_share=den, output_share=out,
                             role="rescaler" if den > RESCALER_RATIO * out else "contributor"))
        where, raw, normed, mask = kept.states[layer]
        token_mask = mask & ~outlier[None, :]
        own = token_mask.any(-1)
        raw, normed, token_mask = raw[own], normed[own], token_mask[own]
        one = distinct(raw)
        raw, normed = raw[one], normed[one]
        n_tok = len({(b, p) for (b, p, s) in groups if s == "token"})
        n_out = len({(b, p) for (b, p, s) in groups}) - n_tok
        k = max(int(token_mask.any(0).sum()), 1)
        some = len(raw) > 0
        layer_rows.append(dict(layer=layer, n_tokens=n_tok, n_distinct=len(raw), n_outlier=n_out, top_k=k,
                               cos_normed=_cos(normed), cos_raw=_cos(raw),
                               sparsity_normed=_sparsity(normed, k) if some else float("nan"),
                               sparsity_raw=_sparsity(raw, k) if some else float("nan"),
                               value=float(raw.abs().amax(-1).median()) if some else float("nan")))
    return rows, layer_rows
