"""``lower_median``: the massive criterion's median, bit for bit the whole-row partition it replaced.

Rows from :data:`~massive_lens.core.median.BRACKET_FROM` values on are selected within a bracket
(:func:`~massive_lens.core.median.lower_median`); the answer must be the value ``numpy.partition``
of the whole row gives (the definition before, and ``torch.median``'s where there is no NaN), bit for
bit: random rows, rows shaped like a residual stream (a few massive dims), ties, all-equal rows, signed
zeros at the median, NaN and inf, odd and even lengths, and rows whose strided sample misleads the bracket.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from massive_lens.core.median import BRACKET_FROM, lower_median

LENGTHS = (BRACKET_FROM - 1, BRACKET_FROM, BRACKET_FROM + 1, 36_864, 73_727, 73_728)  # odd and even


def _whole(a: np.ndarray) -> np.ndarray:
    """The definition before: the lower median by a partition of the whole row."""
    k = (a.shape[-1] - 1) // 2
    return np.partition(a, k, axis=-1)[..., k]


def _same_bits(got: torch.Tensor, a: np.ndarray) -> None:
    want = _whole(a)
    assert got.dtype == torch.from_numpy(a).dtype and tuple(got.shape) == want.shape
    assert got.numpy().tobytes() == np.ascontiguousarray(want).tobytes(), (got, want)


def _residual_like(rng: np.random.Generator, n: int, dtype: type) -> np.ndarray:
    """|x| of a hidden state: a scale per dim (d_model 576), a few dims thousands of times larger."""
    width = 576
    scale = np.exp(rng.normal(0, 1, width))
    scale[rng.choice(width, 3, replace=False)] *= 3000
    return np.abs(rng.normal(0, 1, n) * np.resize(scale, n)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_random_and_residual_rows_match_the_whole_partition(n, dtype):
    rng = np.random.default_rng(n)
    for rows in ((3, n), (2, 2, n), (n,)):
        for a in (rng.normal(0, 1, rows).astype(dtype), np.abs(rng.standard_cauchy(rows)).astype(dtype),
                  _residual_like(rng, int(np.prod(rows)), dtype).reshape(rows)):
            _same_bits(lower_median(torch.from_numpy(a)), a)
            if a.ndim == 2:
                assert torch.equal(lower_median(torch.from_numpy(a)), torch.from_numpy(a).median(-1).values)


@pytest.mark.parametrize("n", LENGTHS)
def test_ties_equal_rows_zeros_nan_and_inf(n):
    rng = np.random.default_rng(7)
    cases = [
        np.round(rng.normal(0, 1, (2, n)), 1).astype(np.float32),  # a few dozen values, each many times
        np.full((2, n), 3.5, np.float32),  # all equal
        np.zeros((1, n), np.float32),
        np.where(rng.random((2, n)) < 0.5, -0.0, 0.0).astype(np.float32),  # the median a zero of either sign
        np.concatenate([np.zeros((1, n // 2 + 1)), rng.normal(0, 1, (1, n - n // 2 - 1))], 1).astype(np.float32),
        np.where(rng.random((2, n)) < 0.1, np.nan, rng.normal(0, 1, (2, n))).astype(np.float32),  # some NaN
        np.where(rng.random((2, n)) < 0.7, np.nan, rng.normal(0, 1, (2, n))).astype(np.float32),  # NaN at rank k
        np.where(rng.random((2, n)) < 0.3, np.inf, -np.abs(rng.normal(0, 1, (2, n)))).astype(np.float32),
        np.where(rng.random((2, n)) < 0.6, -np.inf, rng.normal(0, 1, (2, n))).astype(np.float64),
    ]
    for a in cases:
        _same_bits(lower_median(torch.from_numpy(a)), a)


def _sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every array ``numpy.partition`` is handed from now on."""
    sizes, partition = [], np.partition
    monkeypatch.setattr(np, "partition", lambda a, k, *args, **kw: sizes.append(a.size) or partition(a, k, *args, **kw))
    return sizes


def test_a_residual_row_is_selected_within_a_bracket(monkeypatch):
    """The point of the bracket: a hidden state's row is never partitioned whole (a few percent of it is)."""
    a = _residual_like(np.random.default_rng(1), 295_000, np.float32)[None]
    sizes = _sizes(monkeypatch)
    got = lower_median(torch.from_numpy(a))
    assert sizes and max(sizes) < a.size // 10
    monkeypatch.undo()
    _same_bits(got, a)


def _strided(n: int, up_to: int = 400) -> np.ndarray:
    """The positions every stride the bracket could sample with (odd, no factor below 11, up to ``up_to``) sees."""
    hit = np.zeros(n, dtype=bool)
    for step in (s for s in range(11, up_to, 2) if np.gcd(s, 210) == 1):
        hit[::step] = True
    return hit


@pytest.mark.parametrize("case", ["large", "small", "small, NaN elsewhere", "ends at rank k"])
def test_a_misleading_sample_still_gives_the_exact_median(monkeypatch, case):
    """Rows where the sample sees only large values, only small ones (with NaN among the rest: NaN ranks above
    every bracket), or one value tied at ranks up to k - 1 exactly (the bracket ends right below rank k): the
    bracket misses rank k, and the whole row decides."""
    rng = np.random.default_rng(3)
    for n in (BRACKET_FROM, 73_728, 295_000):
        a = rng.random(n).astype(np.float32)
        seen = _strided(n, 400 if case in ("large", "small") else 44)  # 44: fewer than half the positions
        a[seen] = (1 if case == "large" else -1) * (1e6 + rng.random(int(seen.sum())))
        if case == "small, NaN elsewhere":
            a[~seen & (rng.random(n) < 0.75)] = np.nan  # more NaN than ranks between the bracket and k
        if case == "ends at rank k":  # seen: all 2.0; k - seen values below it, the rest above
            k = (n - 1) // 2
            rest = np.flatnonzero(~seen)
            a[seen], a[rest[:k - int(seen.sum())]], a[rest[k - int(seen.sum()):]] = 2.0, 1.0, 3.0 + np.arange(
                len(rest) - k + int(seen.sum()))
        sizes = _sizes(monkeypatch)
        got = lower_median(torch.from_numpy(a)[None])
        assert sizes[-1] == n  # partitioned whole
        monkeypatch.undo()
        _same_bits(got, a[None])


def test_rows_whose_sample_is_biased_by_any_amount():
    """Many rows with the values at one stride (the sample's, for some rows) shifted by a random amount, some with
    NaN: brackets that hold rank k, that miss it, and that end right at it, each exact."""
    rng = np.random.default_rng(11)
    for _ in range(600):
        n = int(rng.integers(BRACKET_FROM, 3 * BRACKET_FROM))
        a = rng.normal(0, 1, n).astype(np.float32)
        step = int(rng.choice([s for s in range(11, 64, 2) if np.gcd(s, 210) == 1]))
        a[::step] += rng.normal(0, 2)
        if rng.random() < 0.3:
            a[rng.random(n) < rng.random() * 0.6] = np.nan
        _same_bits(lower_median(torch.from_numpy(a)), a)


def test_short_rows_and_other_devices_and_dtypes_as_before():
    a = np.random.default_rng(0).normal(0, 1, (5, 577)).astype(np.float32)
    _same_bits(lower_median(torch.from_numpy(a)), a)
    half = torch.from_numpy(np.tile(a, (1, 10))).half()  # not float32/64: torch's median, as before
    assert torch.equal(lower_median(half), half.median(-1).values)
