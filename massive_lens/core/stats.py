"""The two outlier statistics of a hidden state: kurtosis and top-1/median.

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

>>> import torch
>>> x = torch.zeros(1, 3, 8); x[0, 0, 2] = 100.0; x[..., 5] += 1.0
>>> round(float(kurtosis(x[0, 1])), 4)  # one entry stands out among 8: (n^2 - 3n + 3) / (n - 1)
6.1429
>>> top1_median(x.abs())[1].tolist()  # the median |value| here is 0: a ratio divides by MEDIAN_FLOOR instead
[0.0]
"""

from __future__ import annotations

from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.criterion import Criterion, median_scale

MEDIAN_FLOOR = 1e-12  # the smallest median a ratio divides by


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
