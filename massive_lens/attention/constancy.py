"""How constant a term of the attention output is across query positions and texts, per head:
the sums :func:`reductions` takes of each term, and the statistics :func:`constancy` makes of them
(see :class:`~massive_lens.attention.decompose.AttentionDecomposition`).

>>> import torch
>>> x = torch.ones(1, 1, 3, 4)  # [batch head pos d_model]: the same vector at every position
>>> stats = constancy([reductions(x, torch.ones(1, 3, dtype=torch.bool))], torch.ones(1, 3, dtype=torch.bool))
>>> [round(v, 3) for v in stats[0, 0, :3].tolist()]  # norm, spread, mean cosine across positions
[2.0, 0.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def reductions(x: Float[Tensor, "*batch head_index pos dim"], keep: Bool[Tensor, "*keep_batch pos"],
               basis: Float[Tensor, "*basis_batch head_index dim d_model"] | None = None,
               gram: Float[Tensor, "*gram_batch head_index dim dim"] | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One term's sums over the positions that count, per text and head (a few passes over x; any
    leading dimensions, ``keep`` and the factors broadcast over them): the mean vector, the sum of unit
    vectors, the mean squared norm and the mean norm. With ``basis``, the term's vectors are ``x @ basis``
    (e.g. attention on a few sinks times their values), never built: the norms come from the basis's Gram
    matrix (``gram``, where the caller has it: ``basis @ basis.mT``). With ``gram`` and no basis the
    norms are those of ``x @ basis`` and the two sums are left for the caller to take through the basis."""
    x = x.contiguous()  # read by three products: one copy, not one each
    w = keep.to(x.dtype)
    share = (w / w.sum(-1, keepdim=True).clamp(min=1)).unsqueeze(-2)  # [*batch 1 pos]
    if gram is None and basis is not None:
        gram = basis @ basis.transpose(-1, -2)  # [*batch head dim dim]
    if gram is None:
        norms = torch.linalg.vector_norm(x, dim=-1)  # [*batch head pos]
    else:
        norms = (x @ gram).mul_(x).sum(-1).clamp(min=0).sqrt()
    # the mean and the sum of unit vectors, [*batch head 2 dim]: one product each, then one through the basis
    sums = torch.stack([share.expand_as(norms), w.unsqueeze(-2) / norms.clamp(min=1e-12)], -2) @ x
    if basis is not None:
        sums = sums @ basis
    return sums[..., 0, :], sums[..., 1, :], (norms.pow(2) * share).sum(-1), (norms * share).sum(-1)


def constancy(parts: Sequence[tuple[Tensor, ...]], keep: Bool[Tensor, "batch pos"]) -> Float[Tensor, "term head 5"]:
    """Per term (one :func:`reductions` each) and head: norm, rel_std_pos, cos_pos,
    rel_std_text, cos_text (see the result class), for all terms at once.

    Uses E||x - mean||^2 = E||x||^2 - ||mean||^2 and, for unit vectors u, mean pairwise
    cosine = (||sum u||^2 - n) / (n (n - 1)).
    """
    mean, unit_sum, sq_mean, norm_mean = (torch.stack(t).cpu() for t in zip(*parts, strict=True))  # [term batch ...]
    n = keep.sum(1).to(mean.dtype)  # [batch]
    mean_sq = mean.pow(2).sum(-1)
    spread = (sq_mean - mean_sq).clamp(min=0).sqrt() / mean_sq.sqrt().clamp(min=1e-12)
    pairs = (n * (n - 1))[:, None]
    cos = torch.where(pairs > 0, (unit_sum.pow(2).sum(-1) - n[:, None]) / pairs.clamp(min=1), float("nan"))
    texts = n > 0
    if not bool(texts.any()):
        return torch.full((*mean.shape[:1], mean.shape[2], 5), float("nan"))
    stats = torch.stack([norm_mean, spread, cos], -1)[:, texts]  # [term text head 3]
    if int(texts.sum()) < 2:  # across texts: undefined for one
        return torch.cat([stats.nanmean(1), torch.full((*stats.shape[:1], stats.shape[2], 2), float("nan"))], -1)
    text_means = mean[:, texts].double()
    grand = text_means.mean(1, keepdim=True)
    spread = (text_means - grand).pow(2).sum(-1).mean(1).sqrt() / grand[:, 0].norm(dim=-1).clamp(min=1e-12)
    across = torch.stack([spread if text_means.shape[1] > 1 else torch.full_like(spread, float("nan")),
                          _mean_cosine(text_means)], -1)
    return torch.cat([stats.nanmean(1).double(), across], -1).float()


def _mean_cosine(rows: Float[Tensor, "term n head d_model"]) -> Float[Tensor, "term head"]:
    """Mean cosine over distinct pairs (axis 1): (||sum u||^2 - n) / (n (n - 1)) for unit vectors u."""
    n = rows.shape[1]
    if n < 2:
        return torch.full((rows.shape[0], rows.shape[2]), float("nan"), dtype=rows.dtype)
    unit = rows / rows.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return (unit.sum(1).pow(2).sum(-1) - n) / (n * (n - 1))
