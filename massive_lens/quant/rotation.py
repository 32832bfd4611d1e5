"""Orthogonal rotations of a hidden vector: random orthogonal and randomized Hadamard.

A rotation ``Q`` (``Q Q^T = I``) of the residual stream changes no output of a pre-RMSNorm
model once it is fused into the weights (QuaRot, Ashkboos et al. 2024), but it spreads each
massive activation over every dimension, so a quantizer sees a flatter vector. Two kinds:

* ``"orthogonal"``: the Q factor of a Gaussian matrix (signs fixed), dense;
* ``"hadamard"``: ``diag(s) H / sqrt(n)`` with random signs ``s`` and a Hadamard matrix ``H``
  of order ``n``, built as a Kronecker product ``H_m (x) H_{2^k}`` (Sylvester for the power of
  two, Paley I or II for ``m``: orders ``q + 1`` and ``2 (q + 1)`` for a prime ``q``), and applied
  through the product without forming ``H``: ``O(n (m + 2^k))`` per vector, not ``O(n^2)``.

>>> r = Rotation("hadamard", 12, seed=0)
>>> x = torch.randn(3, 12)
>>> bool(torch.allclose(r.apply_t(r.apply(x)), x, atol=1e-5))
True
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from massive_lens.errors import MassiveLensError

KINDS = ("orthogonal", "hadamard")


def _prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> Tensor:
    """``Q[i, j] = chi(j - i)``, chi the quadratic character mod the prime ``q``."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


@functools.lru_cache(maxsize=32)
def _paley(m: int) -> Tensor | None:
    """A Hadamard matrix of order ``m`` by Paley's constructions, or None when neither applies."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if m == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    q = m - 1
    if _prime(q) and q % 4 == 3:  # Paley I: I + [[0, 1^T], [-1, Q]]
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s
    q = m // 2 - 1
    if m % 2 == 0 and _prime(q) and q % 4 == 1:  # Paley II from the symmetric conference matrix
        c = torch.zeros(m // 2, m // 2, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        two = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, one) + torch.kron(torch.eye(m // 2, dtype=torch.float64), two)
    return None


def _sylvester(n: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_factors(n: int) -> tuple[Tensor, Tensor]:
    """``(H_m, H_{2^k})`` with ``m 2^k = n`` and ``H_m (x) H_{2^k}`` a Hadamard matrix of order ``n``.

    >>> [f.shape[0] for f in hadamard_factors(576)]
    [36, 16]

    Raises:
        MassiveLensError: when no ``m`` that divides ``n`` by a power of two has a Paley construction.
    """
    k = (n & -n).bit_length() - 1  # the largest power of two dividing n
    for j in range(k, -1, -1):
        small = _paley(n >> j)
        if small is not None:
            return small, _sylvester(1 << j)
    raise MassiveLensError(f"no Hadamard matrix of order {n} from Sylvester and Paley constructions; "
                           "use rotation='orthogonal' for this model")


class Rotation:
    """One rotation ``Q`` of width ``n``: :meth:`apply` is ``x @ Q``, :meth:`apply_t` is ``x @ Q^T``
    (on the last axis, computed in float32 and returned in ``x``'s dtype)."""

    def __init__(self, kind: str, n: int, *, seed: int = 0) -> None:
        if kind not in KINDS:
            raise MassiveLensError(f"rotation must be None, 'orthogonal' or 'hadamard', got {kind!r}")
        gen = torch.Generator().manual_seed(seed)
        self.kind, self.n = kind, n
        if kind == "orthogonal":
            q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
            self.matrix = (q * torch.sign(torch.diagonal(r))).float()
        else:
            self.signs = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).float()
            a, b = hadamard_factors(n)
            scale = float(n) ** -0.5
            self.a, self.b = (a * scale**0.5).float(), (b * scale**0.5).float()

    def _kron(self, x: Tensor, transpose: bool) -> Tensor:
        a, b = (self.a.to(x.device), self.b.to(x.device))
        if transpose:
            a, b = a.T, b.T
        grid = x.unflatten(-1, (a.shape[0], b.shape[0]))
        return torch.einsum("...pq,pi,qj->...ij", grid, a, b).flatten(-2)

    def apply(self, x: Tensor) -> Tensor:
        """``x @ Q``."""
        y = x.float()
        if self.kind == "orthogonal":
            return (y @ self.matrix.to(y.device)).to(x.dtype)
        return self._kron(y * self.signs.to(y.device), transpose=False).to(x.dtype)

    def apply_t(self, x: Tensor) -> Tensor:
        """``x @ Q^T``."""
        y = x.float()
        if self.kind == "orthogonal":
            return (y @ self.matrix.to(y.device).T).to(x.dtype)
        return (self._kron(y, transpose=True) * self.signs.to(y.device)).to(x.dtype)
