"""The package's statistics, each defined once: the two outlier statistics of a hidden state
(kurtosis, top-1/median), the 95% intervals of a mean (bootstrap, normal, Student t), Spearman's
rank correlation with its interval, and the relative error of a recomputed tensor.

A quantizer stretched over a few huge values leaves few levels for the rest; two numbers say
how far a hidden state is from that:

* **kurtosis** of one vector, *non-excess* (a Gaussian gives 3): ``E[(x - mean)^4] / var^2``
  over its entries (the ``d_model`` entries of one token's residual, say). A vector with one
  massive entry among ``n`` has kurtosis near ``n``. Bondarenko et al. (2023) average it over tokens.
* **top-1/median** of one sequence (Sun et al. 2024): the largest ``|value|`` over the
  sequence's entries (every position and dim) over their median ``|value|``, the lower median
  as the massive criterion takes it (:func:`~massive_lens.core.criterion.median_scale`).

Every result that reports either calls these; results differ only in how they aggregate
(mean over tokens or sequences, largest over layers or inputs), which their columns say.

Intervals: :func:`bootstrap_mean` over sequences (a paired comparison resamples the per-sequence
difference), :func:`normal_interval` (``mean +- 1.96 sd / sqrt(n)``), :func:`t_interval` over a few
seeds or draws (:func:`t95`, the one Student-t table), :func:`spearman_interval` (Fisher z).
:func:`rel_error` is the one yardstick of a check that recomputes what a hook saw.

>>> import torch
>>> x = torch.zeros(1, 3, 8); x[0, 0, 2] = 100.0; x[..., 5] += 1.0
>>> round(float(kurtosis(x[0, 1])), 4)  # one entry stands out among 8: (n^2 - 3n + 3) / (n - 1)
6.1429
>>> top1_median(x.abs())[1].tolist()  # the median |value| here is 0: a ratio divides by MEDIAN_FLOOR instead
[0.0]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.criterion import Criterion, median_scale
from massive_lens.errors import MassiveLensError

MEDIAN_FLOOR = 1e-12  # the smallest median a ratio divides by
BOOTSTRAP_RESAMPLES = 2000
# two-sided 95% Student-t quantiles by degrees of freedom; past the table 1.96 + 2.5 / dof (within 0.02)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def kurtosis(x: Float[Tensor, "*rows d"]) -> Float[Tensor, "*rows"]:
    """Non-excess kurtosis over the last axis (a Gaussian gives 3; a constant row gives 0).

    Args:
        x: the vectors, one per row of the last axis (computed in ``x``'s dtype).

    Returns:
        One kurtosis per row.

    >>> import torch
    >>> kurtosis(torch.tensor([[1.0, -1.0, 1.0, -1.0]])).tolist()
    [1.0]
    """
    centered = x - x.mean(-1, keepdim=True)
    return centered.pow(4).mean(-1) / centered.pow(2).mean(-1).pow(2).clamp(min=1e-24)


def top1_median(mag: Float[Tensor, "batch pos d_model"], valid: Bool[Tensor, "batch pos"] | None = None
                ) -> tuple[Float[Tensor, " batch"], Float[Tensor, " batch"], Float[Tensor, " batch"]]:
    """Per sequence: the top-1 ``|value|``, the median ``|value|`` and top-1/median.

    Args:
        mag: ``|values|`` of each sequence's hidden state.
        valid: the positions that count (None: all); a sequence with none gives NaN.

    Returns:
        ``(top1, median, ratio)``, one each per sequence; the ratio divides by the median
        floored at :data:`MEDIAN_FLOOR`.

    >>> import torch
    >>> mag = torch.tensor([[[1.0, 2.0], [3.0, 40.0]]])
    >>> [t.tolist() for t in top1_median(mag)]
    [[40.0], [2.0], [20.0]]
    """
    median = median_scale(mag, Criterion(median_over="hidden_state"), valid)[1]
    if valid is None:
        top = mag.flatten(1).amax(1)
    else:  # |values| are >= 0: a left-out entry counts as 0, a sequence with none as NaN
        keep = valid.to(mag.device)
        top = mag.masked_fill(~keep[..., None], 0.0).flatten(1).amax(1).masked_fill(~keep.any(1), float("nan"))
    return top, median, top / median.clamp(min=MEDIAN_FLOOR)


def rel_error(a: Tensor, b: Tensor) -> float:
    """The largest ``|a - b|`` over the largest ``|b|``: how far a recomputation ``a`` is from what
    was measured, ``b`` (its largest entry floored at 1e-12).

    >>> import torch
    >>> rel_error(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]))  # doctest: +NUMBER
    0.05
    """
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def bootstrap_mean(values: Float[Tensor, " seq"], seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the mean of ``values`` (2,000 resamples, fixed seed); one value: no width.

    >>> import torch
    >>> low, high = bootstrap_mean(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    >>> 1.0 <= low < 2.5 < high <= 4.0
    True
    """
    if len(values) < 2:
        return float(values.mean()), float(values.mean())
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(values), (BOOTSTRAP_RESAMPLES, len(values)), generator=gen)
    means = values.double()[idx].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def normal_interval(values: Tensor) -> tuple[float, float]:
    """95% interval of a mean, normal approximation (``mean +- 1.96 sd / sqrt(n)``); paired where
    ``values`` are per-sequence ratios or differences. One value: no width.

    >>> import torch
    >>> [round(x, 3) for x in normal_interval(torch.tensor([1.0, 3.0]))]
    [0.04, 3.96]
    """
    v = values.double()
    half = 1.96 * float(v.std()) / len(v) ** 0.5 if len(v) > 1 else 0.0
    return float(v.mean()) - half, float(v.mean()) + half


def t95(dof: int) -> float:
    """The two-sided 95% Student-t quantile with ``dof`` degrees of freedom (:data:`T95`; past it
    ``1.96 + 2.5 / dof``).

    >>> t95(4), round(t95(50), 3)
    (2.776, 2.01)
    """
    return T95.get(dof, 1.96 + 2.5 / dof)


def t_interval(values: Sequence[float | int]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval of ``values`` (NaN dropped; one value: no interval).

    >>> [round(x, 3) for x in t_interval([1.0, 2.0, 3.0, float("nan")])]
    [2.0, -0.484, 4.484]
    """
    x = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), float(x[0]), float(x[0])
    half = t95(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def finite_numbers(values: Any, what: str) -> np.ndarray:
    """``values`` as a flat float array, refused (naming ``what``) when empty or not all finite numbers.

    >>> finite_numbers([1, 2.5], "x").tolist()
    [1.0, 2.5]
    """
    arr = np.asarray(values, dtype=float).ravel() if not isinstance(values, str) else np.array([])
    if arr.size == 0 or not np.isfinite(arr).all():
        raise MassiveLensError(f"{what} must be a non-empty sequence of finite numbers, got {values!r}")
    return arr


def spearman_interval(x: Sequence[float | int] | np.ndarray, y: Sequence[float | int] | np.ndarray, *,
                      level: float = 0.95) -> dict[str, float]:
    """Spearman's rank correlation of paired values, with a Fisher-z interval (standard error
    ``sqrt((1 + ρ²/2) / (n - 3))``, Bonett and Wright 2000) and a two-sided permutation p-value
    (exact over all orderings for n <= 8, else 20,000 random ones, seed 0).

    Args:
        x: the first values (e.g. γ per layer).
        y: the paired values (e.g. the dead share per layer).
        level: the interval's coverage (default 0.95).

    Returns:
        ``{"rho", "low", "high", "p", "n"}``.

    Raises:
        MassiveLensError: for fewer than 4 pairs, unequal lengths, or a ``level`` outside (0, 1).

    >>> r = spearman_interval([1, 2, 3, 4, 5], [2, 1, 4, 3, 5])
    >>> round(r["rho"], 2), r["low"] < r["rho"] < r["high"], r["n"]
    (0.8, True, 5)
    """
    a, b = finite_numbers(x, "x"), finite_numbers(y, "y")
    if len(a) != len(b) or len(a) < 4:
        raise MassiveLensError(f"spearman_interval needs at least 4 pairs of equal length; got {len(a)} and {len(b)}")
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise MassiveLensError(f"level is a coverage in (0, 1), e.g. 0.95; got {level!r}")
    ra, rb = pd.Series(a).rank().to_numpy(), pd.Series(b).rank().to_numpy()

    def rho_of(r: np.ndarray) -> float:
        return float(np.corrcoef(ra, r)[0, 1]) if np.ptp(ra) and np.ptp(r) else float("nan")

    rho, n = rho_of(rb), len(a)
    z = math.atanh(max(min(rho, 0.999999), -0.999999)) if math.isfinite(rho) else float("nan")
    half = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5 + level / 2))) * math.sqrt(
        (1 + rho**2 / 2) / max(n - 3, 1)) if math.isfinite(rho) else float("nan")
    if n <= 8:
        perms = (np.array(p) for p in itertools.permutations(rb))
    else:
        rng = np.random.default_rng(0)
        perms = (rng.permutation(rb) for _ in range(20_000))
    null = np.array([rho_of(p) for p in perms])
    p_value = float((np.abs(null) >= abs(rho) - 1e-12).mean()) if math.isfinite(rho) else float("nan")
    return dict(rho=rho, low=math.tanh(z - half), high=math.tanh(z + half), p=p_value, n=n)
