"""One attention layer as a fused kernel saw it, and the attention entries it gives without the pattern.

A query's attention to key ``j`` is ``exp(q . k_j * scale - LSE(q))``, where ``LSE(q)`` is the
log of the softmax's denominator, which fused kernels return (:mod:`massive_lens.core.lse` runs
the model on one). :class:`LayerAttention` holds a layer's ``q``, ``k``, ``v``, output and LSE and
computes from them only what an analysis needs: the attention on a few key columns
(:meth:`LayerAttention.columns`), each key's attention from the band of queries after it (the sink
rule's test, :meth:`LayerAttention.band`), and the attention that goes to a learned sink logit
(:attr:`LayerAttention.null_mass`): linear memory in the length, and no second O(n^2) pass.

>>> q = k = v = torch.zeros(1, 1, 3, 4)  # equal scores: each query spreads its attention evenly
>>> lse = torch.log(torch.arange(1.0, 4.0))[None, None]  # causal: query i sees i + 1 keys
>>> att = LayerAttention(0, q, k, v, v, lse, 0.5, None, True)
>>> [round(p, 4) for p in att.columns([0])[0, 0, :, 0].tolist()]
[1.0, 0.5, 0.3333]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.band_masks import band_blocks
from massive_lens.core.criterion import SINK_QUERIES

__all__ = ["BAND_BLOCK", "MAX_BLOCK", "LayerAttention", "rest_lse"]

BAND_BLOCK = 64  # keys per block of the band reduction
MAX_BLOCK = 512  # keys per block of max_attention (queries per block of rest_lse's exact rows)
NEAR_ONE = 1e-3  # rest_lse: where the columns take more than 1 - this, the other keys' log-sum-exp from their scores


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer as the kernel saw it: ``q [batch head query d_head]`` (after rotary),
    ``k``/``v [batch kv_head key d_head]``, ``z [batch head query d_head]`` (the heads' output),
    ``lse [batch head query]`` (float32), the score ``scale``, and the ``mask`` the kernel was
    given (None: causal when ``causal``, else none; bool: True attends; float: added). ``sinks``:
    the learned sink logit per head ``[head]`` (float32; gpt-oss's ``s_aux``), already in ``lse``.
    ``rotary``: the rotary ``(cos, sin)`` the layer's module was called with (``[batch|1 pos rotary_dim]``,
    as the eager path's ``attn.hook_cos``/``hook_sin`` show them; None without)."""

    layer: int
    q: Tensor
    k: Tensor
    v: Tensor
    z: Tensor
    lse: Tensor
    scale: float
    mask: Tensor | None
    causal: bool
    sinks: Tensor | None = None
    rotary: tuple[Tensor, Tensor] | None = None

    @property
    def null_mass(self) -> Float[Tensor, "batch head query"] | None:
        """The attention each query gives to the learned sink logit, ``exp(s - LSE)`` (None: no sink)."""
        return None if self.sinks is None else _softmax_entries(self.sinks[None, :, None], self.lse)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q.shape[1] // self.k.shape[1]

    def columns(self, cols: Sequence[int] | Tensor) -> Float[Tensor, "batch head query col"]:
        """The attention every query gives to the key positions ``cols`` (float32), exactly the
        pattern's columns."""
        out = self.scores(cols).sub_(self.lse[..., None]).exp_()  # exp(score - LSE), in place
        # a masked score or an infinite LSE gave 0, as the rule says, where the sum is finite: the entries are never
        # negative and finite ones at most about 1, so it is finite exactly when each is (one pass, isfinite's three)
        if math.isfinite(float(out.sum())):
            return out
        return _softmax_entries(self.scores(cols), self.lse)  # a NaN or inf reached it: the entries' own rule

    def scores(self, cols: Sequence[int] | Tensor) -> Float[Tensor, "batch head query col"]:
        """Every query's attention score (logit, float32) on the key positions ``cols``, the mask's
        bias added (``-inf`` where a query does not see the key)."""
        cols = torch.as_tensor(cols, dtype=torch.long, device=self.q.device).flatten()
        b, h, n, d = self.q.shape
        k = self.k[:, :, cols].float()  # [batch kv_head col d_head]
        q = self.q.float().reshape(b, self.k.shape[1], self.group, n, d)
        scores = (q @ k[:, :, None].transpose(-1, -2)).reshape(b, h, n, len(cols)).mul_(self.scale)
        qi = torch.arange(n, device=scores.device)[:, None]
        return scores.add_(self._bias(qi, cols[None, :]))

    def rest_lse(self, cols: Sequence[int] | Tensor) -> Float[Tensor, "batch head query"]:
        """Each query's log-sum-exp over the keys it sees other than ``cols`` (float32; ``-inf`` where
        it sees no other): ``LSE + log(1 - p_cols)``, in float64, where ``p_cols <= 1 - NEAR_ONE`` (the
        kernel's LSE is float32: the result carries its error over ``1 - p_cols``, at most ~1e-3); where the
        columns take more (``1 - p_cols`` at or below the LSE's precision), from the other keys' scores,
        for those queries only (a learned sink logit counted, as in the LSE)."""
        cols = torch.as_tensor(cols, dtype=torch.long, device=self.q.device).flatten()
        p = self.columns(cols).double().sum(-1).clamp(max=1.0)
        out = (self.lse.double() + torch.log1p(-p)).float()
        near = p > 1 - NEAR_ONE
        for b, h in near.any(-1).nonzero().tolist():
            queries = near[b, h].nonzero().flatten()
            out[b, h, queries] = self._rest_rows(b, h, queries, cols)
        return out

    def _rest_rows(self, b: int, h: int, queries: Tensor, cols: Tensor) -> Tensor:
        """:meth:`rest_lse` of ``queries`` of batch row ``b``, head ``h`` from their scores on every key."""
        k = self.k[b, h // self.group].float()  # [key d_head]
        keys = torch.arange(k.shape[0], device=k.device)
        out = []
        for start in range(0, len(queries), MAX_BLOCK):
            qi = queries[start: start + MAX_BLOCK]
            bias = self._bias(qi[:, None], keys[None, :])
            if bias.ndim == 4:  # a mask [batch|1 head|1 query key]
                bias = bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1)]
            scores = (self.q[b, h, qi].float() @ k.T).mul_(self.scale) + bias
            scores[:, cols] = float("-inf")
            out.append(torch.logsumexp(scores, -1))
        rest = torch.cat(out)
        return rest if self.sinks is None else torch.logaddexp(rest, self.sinks[h].to(rest.device))

    def max_attention(self, queries: Sequence[int] | Tensor | None = None) -> Float[Tensor, "batch head query"]:
        """Each query's largest attention on any one key (float32), ``exp(max_j (s_j + bias_j) - LSE)``
        taken over blocks of :data:`MAX_BLOCK` keys: the pattern's ``amax(-1)``, at the query
        positions ``queries`` (None: every query; a causal kernel skips the keys after them)."""
        b, h, n, d = self.q.shape
        dev, keys = self.q.device, self.k.shape[2]
        qi = torch.arange(n, device=dev) if queries is None else \
            torch.as_tensor(queries, dtype=torch.long, device=dev).flatten()
        q = self.q[:, :, qi].float().reshape(b, self.k.shape[1], self.group, len(qi), d)
        best = torch.full((b, h, len(qi)), float("-inf"), device=dev)
        causal = self.mask is None and self.causal and bool((qi[1:] >= qi[:-1]).all())  # sorted: skip what is masked
        for start in range(0, min(keys, int(qi.max()) + 1) if causal and len(qi) else keys, MAX_BLOCK):
            first = int(torch.searchsorted(qi, start)) if causal else 0  # the queries before start see none of it
            ki = torch.arange(start, min(start + MAX_BLOCK, keys), device=dev)
            k = self.k[:, :, ki].float()[:, :, None]  # [batch kv_head 1 key d_head]
            scores = (q[:, :, :, first:] @ k.transpose(-1, -2)).reshape(b, h, len(qi) - first, len(ki)) * self.scale
            scores = scores + self._bias(qi[first:, None], ki[None, :])
            best[..., first:] = torch.maximum(best[..., first:], scores.amax(-1))
        return _softmax_entries(best, self.lse[:, :, qi])

    def band(self, valid: Bool[Tensor, "batch pos"]
             ) -> tuple[Float[Tensor, "batch head pos"], Float[Tensor, "batch pos"]]:
        """Per head, each key's mean attention from the (up to ``SINK_QUERIES``) real queries
        after it, and how many such queries each key has: exactly
        :func:`~massive_lens.core.criterion.key_attention` of the pattern, from a band of
        ``SINK_QUERIES`` diagonals (linear in the length)."""
        b, h, n, d = self.q.shape
        dev, w, blk, kv = self.q.device, SINK_QUERIES, BAND_BLOCK, self.k.shape[1]
        nb = -(-n // blk)
        q = torch.nn.functional.pad(self.q.float(), (0, 0, 0, nb * blk + w - n))
        lse = torch.nn.functional.pad(self.lse.float(), (0, nb * blk + w - n), value=float("inf"))
        k = torch.nn.functional.pad(self.k.float(), (0, 0, 0, nb * blk - n))
        # [b kv group nb d blk+w]: each key block's queries, the query heads of a kv head together (no copy of k)
        qw = q.unfold(2, blk + w, blk).reshape(b, kv, self.group, nb, d, blk + w)
        scores = torch.einsum("bgrnds,bgnkd->bgrnsk", qw, k.reshape(b, kv, nb, blk, d)).mul_(self.scale)
        band, count, outside = band_blocks(valid, n, dev, span=w, block=blk)  # [b 1 1 nb s k], [b pos], its complement
        lse = lse.unfold(2, blk + w, blk).reshape(b, kv, self.group, nb, blk + w, 1)
        if self.mask is None and self.causal:  # every key of the band is before its query: no bias, one select
            p = (scores - lse).exp_().masked_fill_(outside, 0.0)  # one buffer, written in place
            mass = p.sum(4).reshape(b, h, nb * blk)[..., :n]
            if bool(torch.isfinite(mass).all()):  # else a NaN or inf reached the band: the entries' own rule
                return mass / count.clamp(min=1)[:, None], count.clone()  # the caller's own count
        qi = (torch.arange(nb, device=dev)[:, None] * blk + torch.arange(blk + w, device=dev))[:, :, None]
        ki = (torch.arange(nb, device=dev)[:, None] * blk + torch.arange(blk, device=dev))[:, None, :]
        bias = self._bias(qi.clamp(max=n - 1), ki.clamp(max=n - 1))  # [b|1 h|1 nb s k] or [nb s k]
        if bias.ndim == 5:
            bias = bias.reshape(bias.shape[0], kv if bias.shape[1] == h else 1, -1, *bias.shape[2:])
        p = _softmax_entries(scores + bias, lse) * band
        mass = p.sum(4).reshape(b, h, nb * blk)[..., :n]
        return mass / count.clamp(min=1)[:, None], count.clone()

    def _bias(self, qi: Tensor, ki: Tensor) -> Tensor:
        """The mask's additive bias at query positions ``qi`` and key positions ``ki``
        (broadcast together), shaped to add to ``[batch head ...]`` scores."""
        if self.mask is None:
            if not self.causal:
                return torch.zeros((), device=self.q.device)
            return torch.where(ki <= qi, 0.0, float("-inf")).to(self.q.device)
        m = self.mask[:, :, qi, ki]  # [batch|1 head|1 ...]
        return torch.where(m, 0.0, float("-inf")) if m.dtype == torch.bool else m.float()


def _softmax_entries(scores: Tensor, lse: Tensor) -> Tensor:
    """``exp(score - LSE)``: 0 where the score is masked, or the query saw no key at all."""
    lse = lse if lse.ndim == scores.ndim else lse[..., None]
    out = torch.exp(scores - lse)
    return torch.where(torch.isfinite(lse) & torch.isfinite(scores), out, torch.zeros((), device=out.device))


def rest_lse(scores: Tensor, keys: Tensor | None, cols: Sequence[int] | Tensor) -> Float[Tensor, "batch head query"]:
    """From full causal ``scores [batch head query key]``: each query's log-sum-exp (float32) over the
    keys it sees (``keys [batch key]`` the real positions; None: all) other than ``cols``.

    >>> s = torch.zeros(1, 1, 3, 3)
    >>> [round(x, 4) for x in rest_lse(s, None, [0])[0, 0].exp().tolist()]  # query i sees i other keys
    [0.0, 1.0, 2.0]
    """
    n = scores.shape[-1]
    real = torch.ones(scores.shape[0], n, dtype=torch.bool) if keys is None else keys
    seen = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()[None, None] \
        & real.to(scores.device)[:, None, None, :]
    seen[..., torch.as_tensor(cols, dtype=torch.long, device=scores.device)] = False
    x = scores.detach().float().masked_fill(~seen, float("-inf"))
    return torch.logsumexp(x, -1)
