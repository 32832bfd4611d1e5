"""When an activation is massive, and when attention makes a position a sink.

Sun et al. (2024) call a residual-stream activation *massive* when its magnitude is above
an absolute threshold (100) **and** about 1,000 times the median magnitude of its hidden
state. The definition is loose on purpose, so both thresholds (and what the median is taken
over) are fields of :class:`Criterion`, and :func:`massive_mask` is the one place that
applies it: detection, calibration and the interventions all call it, so they always agree.

Gu et al. (2024) measure *attention sinks* by the share of heads whose mean attention to the
first token exceeds 0.3, over the first 64 query positions (``T = 64`` in their paper):
:func:`first_token_mass` and :func:`sink_metric` are that metric, used everywhere.

>>> x = torch.ones(1, 3, 8); x[0, 0, 5] = 5000.0
>>> massive_mask(x, Criterion()).nonzero().tolist()
[[0, 0, 5]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.errors import MassiveLensError

SINK_THRESHOLD = 0.3  # Gu et al.: a head is a sink head when > 0.3 of its attention is on the first token
SINK_QUERIES = 64  # ... averaged over the first 64 query positions (their T)


@dataclass(frozen=True)
class Criterion:
    """When an activation counts as massive: ``|value| > abs_threshold`` and
    ``|value| / median > ratio_threshold``, the median taken over the whole hidden state of
    that layer and sequence (``median_over="hidden_state"``, non-pad positions only) or over
    each token's own vector (``"token"``).

    >>> Criterion(ratio_threshold=100).ratio_threshold
    100
    """

    abs_threshold: float | int = 100.0
    ratio_threshold: float | int = 1000.0
    median_over: str = "hidden_state"  # "hidden_state" or "token"

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


def median_scale(
    mag: Float[Tensor, "batch pos d_model"], criterion: Criterion, valid: Bool[Tensor, "batch pos"] | None = None,
) -> tuple[Float[Tensor, "batch _ _"], Float[Tensor, " batch"]]:
    """The median that ``|value|`` is compared with, broadcastable to ``mag``, and each
    sequence's median (over its non-pad positions) for reporting.

    >>> scale, median = median_scale(torch.arange(6.0).view(1, 2, 3), Criterion())
    >>> scale.shape, median.tolist()
    (torch.Size([1, 1, 1]), [2.0])
    """
    if valid is None:
        nan_mag = mag
    else:
        nan_mag = mag.masked_fill(~valid.to(mag.device)[..., None], float("nan"))
    if criterion.median_over == "hidden_state":
        median = nan_mag.flatten(1).nanmedian(1).values
        return median[:, None, None], median
    per_token = nan_mag.nanmedian(-1).values  # [batch pos]
    return per_token[..., None], per_token.nanmedian(-1).values


def massive_mask(
    resid: Float[Tensor, "batch pos d_model"], criterion: Criterion, valid: Bool[Tensor, "batch pos"] | None = None,
) -> Bool[Tensor, "batch pos d_model"]:
    """Which entries of a residual activation are massive under ``criterion`` (pads never are).

    >>> x = torch.ones(2, 2, 4); x[1, 1, 0] = -900.0
    >>> massive_mask(x, Criterion(ratio_threshold=100)).nonzero().tolist()
    [[1, 1, 0]]
    """
    mag = resid.abs().float()
    scale, _ = median_scale(mag, criterion, valid)
    massive = (mag > criterion.abs_threshold) & (mag > criterion.ratio_threshold * scale)
    if valid is not None:
        massive &= valid.to(massive.device)[..., None]
    return massive


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
