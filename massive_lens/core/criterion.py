"""When an activation is massive, and when attention makes a position a sink.

Sun et al. (2024) call a residual-stream activation *massive* when its magnitude is above
an absolute threshold (100) **and** about 1,000 times the median magnitude of its hidden
state. The definition is loose on purpose, so both thresholds (and what the median is taken
over) are fields of :class:`Criterion`, and :func:`massive_mask` is the one place that
applies it: detection, calibration and the interventions all call it, so they always agree.

Gu et al. (2024) measure *attention sinks* by the share of heads whose mean attention to the
first token exceeds 0.3, over the first 64 query positions (``T = 64`` in their paper):
:func:`first_token_mass` and :func:`sink_metric` are that metric, used everywhere.

Which positions *are* sinks is decided here too, once (:class:`SinkRule`, :class:`SinkEvidence`):
a position is a sink when it draws attention as one (a large share of all heads put more
than 0.3 of their attention on it, Gu et al.'s per-head test applied to that position) or
when it carries a massive activation that persists across layers. A dim that crosses the
massive criterion at one early layer does not make its positions sinks, and neither does an
outlier dimension (below): the persistence test counts token-specific entries only.

Two different phenomena pass the massive criterion: token-specific massive activations and
*outlier dimensions*. :mod:`massive_lens.core.outliers` holds the one rule that tells them apart
(per dimension, over the layers of a run); its names are importable from here too.

>>> x = torch.ones(1, 3, 8); x[0, 0, 5] = 5000.0
>>> massive_mask(x, Criterion()).nonzero().tolist()
[[0, 0, 5]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core import sparse_bool
from massive_lens.core.band_masks import key_blocks
from massive_lens.core.few_massive import few_massive
from massive_lens.core.median import lower_median
from massive_lens.core.outliers import (  # noqa: F401  (the rule's names, importable from the criterion too)
    OUTLIER_DIM_MIN_TOKENS,
    OUTLIER_DIM_SHARE,
    SCOPES,
    OutlierTally,
    outlier_dims,
    outlier_scope,
    token_specific,
)
from massive_lens.errors import MassiveLensError

SINK_THRESHOLD = 0.3  # Gu et al.: a head is a sink head when > 0.3 of its attention is on the first token
SINK_QUERIES = 64  # ... averaged over the first 64 query positions (their T)
KEY_BLOCK = 256  # keys reduced at once by key_attention
SINK_HEAD_SHARE = 0.3  # a position is a sink when >= 30% of all heads are sink heads for it ...
SINK_PERSISTENCE = 0.5  # ... or it is massive in >= half the layers from its sequence's first massive layer on
SINK_MIN_LAYERS = 2  # ... and in at least two layers (one layer is a crossing, not a sink)
SINK_MIN_QUERIES = 8  # the attention test needs this many later queries; nearer the end only persistence counts
OUTLIER_CHOICES = ("include", "exclude")  # Criterion.outliers


@dataclass(frozen=True)
class Criterion:
    """When an activation counts as massive: ``|value| > abs_threshold`` and
    ``|value| / median > ratio_threshold``, the median taken over the whole hidden state of
    that layer and sequence (``median_over="hidden_state"``, non-pad positions only) or over
    each token's own vector (``"token"``). ``outliers``: whether the entries of outlier
    dimensions (:func:`outlier_dims`) count, ``"include"`` (the default; detection labels
    them) or ``"exclude"`` (the interventions' default: they never target them).

    >>> Criterion(ratio_threshold=100).ratio_threshold
    100
    """

    abs_threshold: float | int = 100.0
    ratio_threshold: float | int = 1000.0
    median_over: str = "hidden_state"  # "hidden_state" or "token"
    outliers: str = field(default="include", repr=False)  # "include" or "exclude" outlier-dimension entries

    def __post_init__(self) -> None:
        for name in ("abs_threshold", "ratio_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise MassiveLensError(f"Criterion.{name} must be a finite number >= 0, got {value!r}")
        if self.ratio_threshold < 1:
            raise MassiveLensError(
                f"Criterion.ratio_threshold={self.ratio_threshold} is below 1, which would call "
                "values smaller than the median massive; the paper uses 1000"
            )
        if self.abs_threshold == 0 and self.ratio_threshold <= 1:
            raise MassiveLensError("Criterion with both thresholds at their minimum marks everything massive")
        if self.median_over not in ("hidden_state", "token"):
            raise MassiveLensError(f"median_over must be 'hidden_state' or 'token', got {self.median_over!r}")
        if self.outliers not in OUTLIER_CHOICES:
            raise MassiveLensError(f"outliers must be 'include' or 'exclude', got {self.outliers!r}")

    def passes(self, mag: Tensor, scale: Tensor) -> Tensor:
        """The rule itself, on magnitudes and their median scale (from :func:`median_scale`):
        ``|x| > abs_threshold`` and ``|x| > ratio_threshold * median``. Written once here;
        :func:`massive_mask` and the in-hook reducers call it.

        Args:
            mag: the magnitudes ``|x|``.
            scale: the median they are compared with, broadcastable to ``mag``.

        Returns:
            A bool tensor shaped like ``mag``: which entries pass (before any outlier-dimension rule).
        """
        bound = (self.ratio_threshold * scale).clamp(min=self.abs_threshold)  # both, in one comparison
        if mag.device.type == bound.device.type == "cpu" and not (mag.requires_grad or bound.requires_grad) and \
                mag.dtype == bound.dtype in (torch.float32, torch.float64):  # NumPy's: ~10x faster on one thread
            return torch.from_numpy(np.greater(mag.numpy(), bound.numpy()))
        return mag > bound


def as_criterion(criterion: Any) -> Criterion:
    """``criterion`` itself, or ``Criterion()`` for None; anything else (a name, a number) is an error.

    >>> as_criterion(None) == Criterion()
    True
    """
    if criterion is None:
        return Criterion()
    if not isinstance(criterion, Criterion):
        raise MassiveLensError(f"criterion must be a massive_lens.Criterion (e.g. Criterion(abs_threshold=100, "
                               f"ratio_threshold=1000)) or None for the default, got {type(criterion).__name__} "
                               f"{criterion!r}")
    return criterion


def as_rule(rule: Any) -> SinkRule:
    """``rule`` itself, or ``SinkRule()`` for None; anything else (a name, a number) is an error.

    >>> as_rule(None) == SinkRule()
    True
    """
    if rule is None:
        return SinkRule()
    if not isinstance(rule, SinkRule):
        raise MassiveLensError(f"rule must be a massive_lens SinkRule (e.g. SinkRule(threshold=0.3)) or None for "
                               f"the default, got {type(rule).__name__} {rule!r}")
    return rule


def median_scale(
    mag: Float[Tensor, "batch pos d_model"], criterion: Criterion, valid: Bool[Tensor, "batch pos"] | None = None,
) -> tuple[Float[Tensor, "batch _ _"], Float[Tensor, " batch"]]:
    """The median that ``|value|`` is compared with, broadcastable to ``mag``, and each
    sequence's median (over its non-pad positions) for reporting.

    >>> scale, median = median_scale(torch.arange(6.0).view(1, 2, 3), Criterion())
    >>> scale.shape, median.tolist()
    (torch.Size([1, 1, 1]), [2.0])
    """
    if valid is None or bool(valid.all()):
        nan_mag, median = mag, lower_median  # no pads: a selection, not a sort
    else:
        nan_mag = mag.masked_fill(~valid.to(mag.device)[..., None], float("nan"))
        median = _nanmedian
    if criterion.median_over == "hidden_state":
        per_sequence = median(nan_mag.flatten(1))
        return per_sequence[:, None, None], per_sequence
    per_token = median(nan_mag)  # [batch pos]
    return per_token[..., None], _nanmedian(per_token)


def _nanmedian(x: Tensor) -> Tensor:
    return x.nanmedian(-1).values


def massive_mask(
    resid: Float[Tensor, "batch pos d_model"], criterion: Criterion, valid: Bool[Tensor, "batch pos"] | None = None,
) -> Bool[Tensor, "batch pos d_model"]:
    """Which entries of a residual activation are massive under ``criterion`` (pads never are).

    >>> x = torch.ones(2, 2, 4); x[1, 1, 0] = -900.0
    >>> massive_mask(x, Criterion(ratio_threshold=100)).nonzero().tolist()
    [[1, 1, 0]]
    """
    mag = resid.abs().float()
    every = valid is None or bool(valid.all())
    massive = few_massive(mag, criterion) if every else None
    if massive is None:
        massive = criterion.passes(mag, median_scale(mag, criterion, valid)[0])
    if not every:
        massive &= valid.to(massive.device)[..., None]
    return token_specific(massive, valid) if criterion.outliers == "exclude" else massive


def first_token_mass(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"], valid: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, " head_index"]:
    """Per head, the mean attention to the first token over the first ``SINK_QUERIES`` real
    query positions of every sequence (Gu et al.'s alpha).

    >>> p = torch.zeros(1, 2, 3, 3); p[:, 0, :, 0] = 1.0; p[:, 1, :, 1:] = 0.5
    >>> first_token_mass(p).tolist()
    [1.0, 0.0]
    """
    n = min(SINK_QUERIES, pattern.shape[-2])
    p = pattern[:, :, :n, 0].float()
    if valid is None:
        return p.mean((0, 2))
    w = valid[:, :n].to(p.device, p.dtype)
    return torch.einsum("bhq,bq->h", p, w) / w.sum().clamp(min=1)


def sink_metric(mass: Float[Tensor, " head"], threshold: float = SINK_THRESHOLD) -> float:
    """Share of heads whose :func:`first_token_mass` exceeds ``threshold`` (Gu et al., 2024).

    >>> sink_metric(torch.tensor([0.9, 0.1, 0.5, 0.2]))
    0.5
    """
    if not 0 < threshold < 1:
        raise MassiveLensError(f"threshold is an attention share in (0, 1), got {threshold}")
    return float((mass > threshold).float().mean()) if mass.numel() else float("nan")


def first_norm_ratio(norms: Float[Tensor, "*batch pos"]) -> Float[Tensor, "*batch"]:
    """The first token's residual norm over the (lower) median norm of the other positions, per
    sequence: how far a sink's hidden state stands out (the compression valley, trained models).

    >>> first_norm_ratio(torch.tensor([[40.0, 1.0, 2.0, 4.0]])).tolist()
    [20.0]
    """
    return norms[..., 0] / norms[..., 1:].median(-1).values.clamp(min=1e-12)

@dataclass(frozen=True)
class SinkRule:
    """When a position counts as an attention sink.

    A position is a sink when it **draws attention as one**: at least ``head_share`` of all
    heads (every layer) give it more than ``threshold`` of their attention, averaged over the
    (up to ``SINK_QUERIES``) real query positions after it, Gu et al.'s per-head test applied
    to that position (positions with fewer than ``min_queries`` later queries are not judged
    this way); **or** when it **carries a persistent massive activation**: some dim is massive
    there (under the :class:`Criterion`) in at least ``persistence`` of the layers from its
    sequence's first massive layer to the last one, and in at least ``min_layers`` layers.
    A dim that crosses the criterion at one early layer makes no sink.

    >>> SinkRule().head_share, SinkRule(persistence=0.8).persistence
    (0.3, 0.8)
    """

    threshold: float | int = SINK_THRESHOLD
    head_share: float | int = SINK_HEAD_SHARE
    persistence: float | int = SINK_PERSISTENCE
    min_layers: int = SINK_MIN_LAYERS
    min_queries: int = SINK_MIN_QUERIES

    def __post_init__(self) -> None:
        for name in ("threshold", "head_share", "persistence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise MassiveLensError(f"SinkRule.{name} is a share in (0, 1], got {value!r}")
        if self.threshold >= 1:
            raise MassiveLensError(f"SinkRule.threshold is an attention share in (0, 1), got {self.threshold}")
        for name in ("min_layers", "min_queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MassiveLensError(f"SinkRule.{name} must be an integer >= 1, got {value!r}")

    def __str__(self) -> str:
        return (f"sink = >= {self.head_share:.0%} of heads put > {self.threshold:g} of their attention on it, "
                f"or massive in >= {self.persistence:.0%} of the layers from the first massive one "
                f"(>= {self.min_layers})")


def key_attention(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"], valid: Bool[Tensor, "batch pos"] | None = None,
) -> tuple[Float[Tensor, "batch head_index key_pos"], Float[Tensor, "batch key_pos"]]:
    """Per head, each key's mean attention from the (up to ``SINK_QUERIES``) real query
    positions after it, and how many such queries each key has.

    >>> p = torch.zeros(1, 1, 3, 3); p[0, 0, :, 0] = 1.0
    >>> mass, n = key_attention(p)
    >>> mass[0, 0].tolist(), n[0].tolist()
    ([1.0, 0.0, 0.0], [2.0, 1.0, 0.0])
    """
    n = pattern.shape[-1]
    blocks, count = key_blocks(pattern.shape[0], n, pattern.device, valid, span=SINK_QUERIES, block=KEY_BLOCK)
    mass = torch.empty(*pattern.shape[:2], n, device=pattern.device)
    for k0, k1, q1, band in blocks:  # a block of keys and the queries that see them
        mass[..., k0:k1] = (pattern[:, :, k0:q1, k0:k1].float() * band[:, None]).sum(2)  # 20x faster than einsum
    return mass / count.clamp(min=1)[:, None], count.clone()  # the caller's own count: the kept one stays as it is


class SinkEvidence:
    """What decides which positions are sinks, gathered layer by layer during one forward
    pass (:meth:`add_resid` for every layer's ``resid_post``, :meth:`add_pattern` for every
    layer's attention pattern), then judged by a :class:`SinkRule` (:meth:`mask`).

    >>> ev = SinkEvidence(torch.ones(1, 4, dtype=torch.bool), n_layers=3)
    >>> x = torch.ones(1, 4, 8); x[0, 0, 2] = 5000.0
    >>> for layer in range(3):
    ...     y = x.clone(); y[0, 3, 5] = 5000.0 if layer == 0 else 1.0  # position 3: one layer only
    ...     _ = ev.add_resid(layer, y)
    >>> ev.mask().tolist()
    [[True, False, False, False]]
    """

    def __init__(self, valid: Bool[Tensor, "batch pos"], n_layers: int, rule: SinkRule | None = None,
                 criterion: Criterion | None = None, outliers: OutlierTally | None = None):
        self.valid, self.n_layers = valid.cpu(), n_layers
        self.all_valid = bool(self.valid.all())  # no pads: nothing to mask
        self.rule, self.criterion = as_rule(rule), as_criterion(criterion)
        self.outliers = outliers or OutlierTally()  # the run's outlier dimensions (shared by a caller's batches)
        batch, pos = valid.shape
        self.sink_heads = torch.zeros(batch, pos)  # heads (over all layers) that are sink heads for the key
        self.n_heads = 0
        self._entries: list[tuple[int, Tensor]] = []  # layer, [n 3] (seq, pos, dim) massive entries
        self._every = self.criterion if self.criterion.outliers == "include" else Criterion(  # every entry counted
            self.criterion.abs_threshold, self.criterion.ratio_threshold, self.criterion.median_over)

    def add_resid(self, layer: int, resid: Float[Tensor, "batch pos d_model"]) -> None:
        """Count the massive entries of ``layer``'s residual stream (see :meth:`add_massive`)."""
        self.add_massive(layer, massive_mask(resid, self._every, self.valid))

    def add_massive(self, layer: int, massive: Bool[Tensor, "batch pos d_model"]) -> None:
        """Count ``layer``'s massive entries (every one, found by the caller with
        :func:`massive_mask`): which of them are token-specific, and so mark positions, is
        decided over the run by :attr:`outliers` when the sinks are asked for."""
        massive = massive.cpu() if self.all_valid else massive.cpu() & self.valid[..., None]
        flags = self.outliers.add(layer, massive, None if self.all_valid else self.valid)
        idx = sparse_bool.nonzero(massive)
        if bool(flags.any()):  # this layer's outlier dims never count
            idx = idx[~flags[idx[:, 0], idx[:, 2]]]
        self._entries.append((layer, idx))

    def _massive(self) -> tuple[Tensor, Tensor]:
        layers = torch.zeros(self.valid.shape, dtype=torch.long)
        first = torch.full(self.valid.shape, self.n_layers, dtype=torch.long)
        for layer, idx in self._entries:
            kept = idx[~self.outliers.at(layer)[idx[:, 2]]]
            hit = torch.zeros_like(self.valid)
            hit[kept[:, 0], kept[:, 1]] = True
            layers += hit.long()
            first = torch.where(hit, first.clamp(max=layer), first)
        return layers, first

    @property
    def massive_layers(self) -> Int[Tensor, "batch pos"]:
        """Per position, the layers where it has a token-specific massive entry."""
        return self._massive()[0]

    @property
    def first_massive(self) -> Int[Tensor, "batch pos"]:
        """Per position, the first such layer (``n_layers``: none)."""
        return self._massive()[1]

    def add_pattern(self, pattern: Float[Tensor, "batch head_index query_pos key_pos"]) -> None:
        """Count, per key position, the heads of this layer that are sink heads for it."""
        self.add_key_attention(*key_attention(pattern, self.valid))

    def add_key_attention(self, mass: Float[Tensor, "batch head_index pos"], count: Float[Tensor, "batch pos"]) -> None:
        """:meth:`add_pattern` from the layer's :func:`key_attention`, for a caller that computed it."""
        judged = (count >= self.rule.min_queries).cpu()
        self.sink_heads += ((mass > self.rule.threshold).sum(1).cpu() * judged).float()
        self.n_heads += mass.shape[1]

    @property
    def head_share(self) -> Float[Tensor, "batch pos"]:
        """Share of all heads seen that are sink heads for each position."""
        return self.sink_heads / max(self.n_heads, 1)

    @property
    def by_attention(self) -> Bool[Tensor, "batch pos"]:
        """Positions that draw attention as sinks."""
        return (self.head_share >= self.rule.head_share) & self.valid if self.n_heads else \
            torch.zeros_like(self.valid)

    @property
    def by_massive(self) -> Bool[Tensor, "batch pos"]:
        """Positions whose massive activation persists across layers."""
        layers, first = self._massive()
        start = first.min(-1, keepdim=True).values  # the sequence's first massive layer
        span = (self.n_layers - start).clamp(min=1)
        need = torch.maximum(torch.full_like(span, self.rule.min_layers), (self.rule.persistence * span).ceil().long())
        return (layers >= need) & (layers > 0) & self.valid

    def mask(self) -> Bool[Tensor, "batch pos"]:
        """The sinks: positions that draw attention as one or carry a persistent massive activation."""
        return self.by_attention | self.by_massive
