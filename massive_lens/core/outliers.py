"""Token-specific massive activations and outlier dimensions: the one rule that tells them apart.

Two different phenomena pass the massive criterion. A **token-specific** massive activation
sits on a few tokens (the first token, the first delimiter) and is what Sun et al. describe.
An **outlier dimension** passes it at most tokens of a layer, typically because that layer's
median is tiny: it is a property of the dim, not of a token. The rule has two steps, both here:

- at one layer (:func:`outlier_dims`): a dim massive at >= ``OUTLIER_DIM_SHARE`` of a
  sequence's real tokens, and at >= ``OUTLIER_DIM_MIN_TOKENS`` of them, is an outlier
  dimension of that layer;
- over a run (:func:`outlier_scope`, :class:`OutlierTally`): a dim that is an outlier
  dimension at *any* layer of the run is one at *every* layer of the run where it is massive
  at >= ``OUTLIER_DIM_MIN_TOKENS`` tokens of a sequence.

A third case needs the magnitudes, not only the mask (:func:`channel_dims`): a *channel* that
is large at most tokens of a layer, and passes the rule at only a few of them (a spike at a
few commas of an early layer, at 1,200-2,100 where the channel sits at hundreds). Counted
alone, those few entries look token-specific, and a hand-over mask would leave ordinary
tokens out. A massive entry stands out from its own dim: a token-specific one is far above
the dim's value at the other tokens (SmolLM2's massive dims sit at 0.3-4% of their massive
value at the median token). So a dim whose ``|value|``, over the batch's real tokens (every
sequence together), reaches ``CHANNEL_SHARE`` (a tenth) of its massive entries' median at
>= ``OUTLIER_DIM_SHARE`` of them is an outlier dimension at that layer, and, by the run rule,
wherever else it spreads.

Why the second step. Decided layer by layer, a dim that is massive at most tokens of its
early layers but dips just under the share at one (massive at 40% of the tokens, say) would
count as token-specific there, and the masks, the interventions and trace_origin would then
act on ordinary words. Those entries show the same spread, not a token that stands out, so
they are the outlier dimension's. Where the same dim is massive at fewer tokens (the first
token, a delimiter: the token-specific pattern) its entries stay token-specific: a real
massive-activation dim that spreads at one layer keeps its headline at the others, which
"an outlier at any layer is one at every layer" would lose.

A *run* is what one call reads: every layer and sequence of
:func:`~massive_lens.find_massive`'s texts (so ``exclusion_mask`` and ``trace_origin``, which
call it), one batch of ``scan_corpus``, the whole calibration text of ``calibrate`` (whose
choice the interventions and ``compression_valley`` use), one batch of the sink rule
(:class:`~massive_lens.core.criterion.SinkEvidence`, so the sink census). Every result labels
its entries with a ``scope``: ``"token"`` or ``"outlier_dim"`` (:data:`SCOPES`), taken from an
:class:`OutlierTally`; :func:`token_specific` is the one-layer form, for a caller that sees a
single layer (an edit inside a forward pass, a candidate search).

>>> tally = OutlierTally()
>>> spread = torch.zeros(1, 10, 2, dtype=torch.bool); spread[0, :, 0] = True  # dim 0 at every token
>>> dip = torch.zeros(1, 10, 2, dtype=torch.bool); dip[0, :4, 0] = True; dip[0, 0, 1] = True
>>> _ = tally.add(0, spread); _ = tally.add(1, dip)
>>> tally.token(1, dip).nonzero().tolist()  # the dip is the outlier dimension's; dim 1 at the first token is not
[[0, 0, 1]]
"""

from __future__ import annotations

import math

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core import sparse_bool

OUTLIER_DIM_SHARE = 0.5  # a dim massive at >= half of a sequence's real tokens at one layer is an outlier dimension ...
OUTLIER_DIM_MIN_TOKENS = 4  # ... if that is at least 4 tokens (BOS and a delimiter in a 3-token text are not one)
CHANNEL_SHARE = 0.1  # a dim at >= a tenth of its massive entries' median at most tokens is a channel, not a token
SCOPES = ("token", "outlier_dim")  # the two scopes of a massive entry, token-specific first


def token_specific(massive: Bool[Tensor, "batch pos d_model"], valid: Bool[Tensor, "batch pos"] | None = None
                   ) -> Bool[Tensor, "batch pos d_model"]:
    """``massive`` without the entries of this layer's own outlier dimensions (:func:`outlier_dims`;
    ``massive`` itself, not a copy, where there are none): the one-layer form, for a caller that sees a
    single layer (an edit inside a forward pass, a candidate search). Over a run, :class:`OutlierTally` decides.

    >>> m = torch.zeros(1, 6, 3, dtype=torch.bool); m[0, :, 1] = True; m[0, 0, 2] = True
    >>> token_specific(m).nonzero().tolist()
    [[0, 0, 2]]
    """
    flags = outlier_dims(sparse_bool.count(massive, 1), _n_tokens(massive, valid))
    return massive & ~flags[:, None, :] if bool(flags.any()) else massive  # (itself where no dim is one)


def _n_tokens(massive: Tensor, valid: Tensor | None) -> Tensor:
    return torch.full(massive.shape[:1], massive.shape[1], device=massive.device) if valid is None \
        else valid.to(massive.device).sum(1)


def outlier_dims(count: Int[Tensor, "batch d_model"], n_tokens: Int[Tensor, " batch"]) -> Bool[Tensor, "batch d_model"]:
    """Which dims are *outlier dimensions* at one layer: massive at ``count`` of the ``n_tokens``
    real tokens of each sequence, at least ``OUTLIER_DIM_SHARE`` of them and at least
    ``OUTLIER_DIM_MIN_TOKENS``. Over a run, :func:`outlier_scope` extends them to the layers
    where they dip under the share.

    >>> outlier_dims(torch.tensor([[9, 1, 3]]), torch.tensor([10])).tolist()
    [[True, False, False]]
    """
    # the least count that passes both, per sequence: the share's product rounded as float32 (as it is compared)
    need = [max(math.ceil(np.float32(OUTLIER_DIM_SHARE) * np.float32(n)), OUTLIER_DIM_MIN_TOKENS)
            for n in n_tokens.tolist()]
    if len(set(need)) == 1:  # one bound for every sequence: one comparison
        return count >= need[0]
    return count >= torch.tensor(need, device=count.device)[:, None]


def channel_dims(mag: Float[Tensor, "batch pos d_model"], massive: Bool[Tensor, "batch pos d_model"],
                 valid: Bool[Tensor, "batch pos"] | None = None, count: Int[Tensor, "batch d_model"] | None = None
                 ) -> Bool[Tensor, " d_model"]:
    """Which dims massive somewhere at this layer are *channels* large at most of the batch's
    tokens: ``|value| >= CHANNEL_SHARE`` x the median ``|value|`` of the dim's massive entries
    at >= ``OUTLIER_DIM_SHARE`` of the real tokens of every sequence together (and at least
    ``OUTLIER_DIM_MIN_TOKENS`` of them). Their massive entries are the channel's tail, not
    tokens that stand out (see the module docstring). ``mag`` is ``|x|``; ``count``: ``massive``'s
    entries per dim, where the caller has them.

    >>> mag = torch.full((1, 8, 2), 0.5); mag[0, :, 0] = 300.0; mag[0, 2, 0] = 2000.0; mag[0, 0, 1] = 5000.0
    >>> massive = mag > 1000
    >>> channel_dims(mag, massive).tolist()  # dim 0 spikes once on a channel at 300; dim 1 stands out
    [True, False]
    """
    dims = (sparse_bool.any_along(massive.flatten(0, 1), 0) if count is None else count.any(0)).nonzero().flatten()
    out = torch.zeros(mag.shape[-1], dtype=torch.bool)
    if not len(dims):
        return out
    x, hit = mag[..., dims], massive[..., dims]
    if valid is None:  # every position real: no gather
        x, hit = x.flatten(0, 1), hit.flatten(0, 1)  # [n_tokens k]
    else:
        real = valid.to(mag.device)
        x, hit = x[real], hit[real]
    spikes = x.masked_fill(~hit, float("nan")).nanmedian(0).values  # the median massive |value| of each dim
    large = (x >= CHANNEL_SHARE * spikes).sum(0)
    out[dims.cpu()] = ((large >= OUTLIER_DIM_SHARE * len(x)) & (large >= OUTLIER_DIM_MIN_TOKENS)).cpu()
    return out


def outlier_scope(outlier: Bool[Tensor, "layer d_model"], spread: Bool[Tensor, "layer d_model"]
                  ) -> Bool[Tensor, "layer d_model"]:
    """The run rule: at which layers each dim's entries are outlier-dimension entries.

    ``outlier[l, d]``: ``d`` is an outlier dimension at layer ``l`` (:func:`outlier_dims`, in
    some sequence of the run); ``spread[l, d]``: ``d`` is massive at >= ``OUTLIER_DIM_MIN_TOKENS``
    tokens of some sequence at layer ``l``. A dim that is an outlier dimension at any layer of
    the run is one at every layer where it is spread (see the module docstring for why); a dim
    that never is one has token-specific entries everywhere.

    >>> outlier = torch.tensor([[True, False], [False, False], [False, False]])
    >>> spread = torch.tensor([[True, False], [True, True], [False, True]])  # dim 0 dips at layer 1
    >>> outlier_scope(outlier, spread).tolist()
    [[True, False], [True, False], [False, False]]
    """
    return (spread | outlier) & outlier.any(0, keepdim=True)


class OutlierTally:
    """Which dims are outlier dimensions over one run, gathered layer by layer
    (:meth:`add`), then judged by :func:`outlier_scope` (:meth:`at`, :attr:`dims`): the one
    place every consumer takes the scope of a massive entry from.

    >>> tally = OutlierTally()
    >>> m = torch.zeros(1, 10, 3, dtype=torch.bool); m[0, :, 1] = True  # dim 1: every token of layer 0
    >>> _ = tally.add(0, m)
    >>> m = torch.zeros(1, 10, 3, dtype=torch.bool); m[0, :4, 1] = True; m[0, 0, 2] = True  # dim 1 dips
    >>> _ = tally.add(1, m)
    >>> tally.at(1).tolist(), tally.dims.nonzero().flatten().tolist()
    ([False, True, False], [1])
    """

    def __init__(self) -> None:
        self.outlier: dict[int, Tensor] = {}  # layer -> bool [d_model]: an outlier dimension there (some sequence)
        self.spread: dict[int, Tensor] = {}  # layer -> bool [d_model]: massive at >= MIN_TOKENS tokens of a sequence
        self._scope: dict[int, Tensor] | None = None  # at()'s rows, judged once until the next add()

    def add(self, layer: int, massive: Bool[Tensor, "batch pos d_model"],
            valid: Bool[Tensor, "batch pos"] | None = None,
            mag: Float[Tensor, "batch pos d_model"] | None = None,
            count: Int[Tensor, "batch d_model"] | None = None) -> Bool[Tensor, "batch d_model"]:
        """Count one layer's massive entries (all of them, pads already left out; ``count``: that count
        per dim where the caller has it); returns the dims that are outlier dimensions at this layer,
        per sequence (:func:`outlier_dims`), and, given the magnitudes ``mag`` (``|x|``), in every
        sequence the channels large at most of the batch's tokens (:func:`channel_dims`)."""
        count = sparse_bool.count(massive, 1) if count is None else count
        flags = outlier_dims(count, _n_tokens(massive, valid))
        if mag is not None:
            flags = flags | channel_dims(mag, massive, valid, count).to(flags.device)[None, :]
        for table, now in ((self.outlier, flags.any(0)), (self.spread, (count >= OUTLIER_DIM_MIN_TOKENS).any(0))):
            now = now.cpu()
            table[layer] = table[layer] | now if layer in table else now
        self._scope = None
        return flags

    @property
    def dims(self) -> Bool[Tensor, " d_model"]:
        """Dims that are outlier dimensions at some layer of the run."""
        return torch.stack(list(self.outlier.values())).any(0) if self.outlier else torch.zeros(0, dtype=torch.bool)

    def at(self, layer: int) -> Bool[Tensor, " d_model"]:
        """Dims whose massive entries at ``layer`` have ``scope == "outlier_dim"`` (:func:`outlier_scope`)."""
        if layer not in self.spread:
            return torch.zeros_like(self.dims)
        if self._scope is None:  # every layer's row at once: a caller asks layer by layer
            layers = sorted(self.spread)
            scope = outlier_scope(torch.stack([self.outlier[x] for x in layers]),
                                  torch.stack([self.spread[x] for x in layers]))
            self._scope = dict(zip(layers, scope, strict=True))
        return self._scope[layer]

    def token(self, layer: int, massive: Bool[Tensor, "batch pos d_model"]) -> Bool[Tensor, "batch pos d_model"]:
        """``massive`` (of ``layer``) without the entries of outlier dimensions there."""
        return massive & ~self.at(layer).to(massive.device)
