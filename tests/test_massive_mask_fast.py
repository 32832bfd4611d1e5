"""massive_mask skips the median where few entries pass (core.few_massive): the mask must be
exactly the one the median gives, for any thresholds, ties, NaN and several sequences."""

from __future__ import annotations

import torch

from massive_lens.core.criterion import Criterion, massive_mask, median_scale
from massive_lens.core.few_massive import few_massive


def _by_median(x: torch.Tensor, criterion: Criterion) -> torch.Tensor:
    mag = x.abs().float()
    return criterion.passes(mag, median_scale(mag, criterion)[0])


def test_mask_equals_the_medians_on_random_states():
    gen = torch.Generator().manual_seed(0)
    for trial in range(400):
        b, n, d = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (3, 12, 30))
        x = torch.randn(b, n, d, generator=gen) * float(torch.rand(1, generator=gen)) * 3
        for _ in range(int(torch.randint(0, 9, (1,), generator=gen))):  # a few large entries, some tied
            i = [int(torch.randint(0, s, (1,), generator=gen)) for s in (b, n, d)]
            x[i[0], i[1], i[2]] = float(torch.randint(40, 3000, (1,), generator=gen)) * (1 if trial % 2 else -1)
        if trial % 5 == 0:
            x[..., 0] = 900.0  # many pass: more than the fast path tests
        if trial % 7 == 0:
            x[0, 0, 0] = float("nan")
        criterion = Criterion(abs_threshold=float(torch.randint(0, 200, (1,), generator=gen)),
                              ratio_threshold=float(torch.randint(1, 1500, (1,), generator=gen)))
        assert torch.equal(massive_mask(x, criterion), _by_median(x, criterion)), (trial, criterion)


def test_the_boundary_of_the_ratio_is_exact():
    """An entry exactly at ratio x median is not massive, the next float above it is."""
    x = torch.ones(1, 4, 8)
    x[0, 0, 0] = 1000.0
    x[0, 1, 0] = torch.nextafter(torch.tensor(1000.0), torch.tensor(2000.0))
    assert massive_mask(x, Criterion()).nonzero().tolist() == [[0, 1, 0]]
    assert torch.equal(massive_mask(x, Criterion()), _by_median(x, Criterion()))


def test_mask_equals_the_medians_in_float64_with_thresholds_float32_cannot_hold(monkeypatch):
    """Thresholds rounded as the median's path rounds them; a row with more candidates than
    ``MAX_CANDIDATES`` leaves the mask to the median."""
    gen = torch.Generator().manual_seed(1)
    decided = 0
    for trial in range(300):
        x = torch.randn(2, 6, 24, generator=gen).abs() * 0.3
        for _ in range(int(torch.randint(0, 12, (1,), generator=gen))):
            i = [int(torch.randint(0, s, (1,), generator=gen)) for s in x.shape]
            x[i[0], i[1], i[2]] = float(torch.rand(1, generator=gen)) * 400
        x = x.double() if trial % 2 else x
        for criterion in (Criterion(abs_threshold=100.3, ratio_threshold=1000.1),
                          Criterion(abs_threshold=0.1, ratio_threshold=1.7)):
            fast = few_massive(x, criterion)
            decided += fast is not None
            exact = criterion.passes(x, median_scale(x, criterion)[0])  # in x's own dtype
            assert fast is None or torch.equal(fast, exact), (trial, criterion)
    assert decided > 500
    monkeypatch.setattr("massive_lens.core.few_massive.MAX_CANDIDATES", 2)
    x = torch.ones(1, 4, 8)
    x[0, :3, 0] = 5000.0
    assert few_massive(x, Criterion()) is None
    assert torch.equal(massive_mask(x, Criterion()), _by_median(x, Criterion()))


def test_the_boundary_is_exact_in_float64_for_a_ratio_float32_cannot_hold():
    x = torch.full((1, 4, 8), 0.3, dtype=torch.float64)
    at = torch.tensor(1000.1, dtype=torch.float64) * 0.3  # the threshold as the median's path computes it
    x[0, 0, 0], x[0, 1, 0] = at, torch.nextafter(at, at * 2)
    criterion = Criterion(abs_threshold=100, ratio_threshold=1000.1)
    assert few_massive(x, criterion).nonzero().tolist() == [[0, 1, 0]]


def test_the_boundary_of_abs_threshold_float32_cannot_hold():
    """Entries on either side of an ``abs_threshold`` float32 rounds down (100.1) or up (100.3): the float32
    neighbours of the threshold, compared as the rule compares them (in the magnitudes' dtype)."""
    for threshold in (100.1, 100.3, 100.0):
        t = torch.tensor(threshold, dtype=torch.float64)
        below = t.float() if t.float().double() <= t else torch.nextafter(t.float(), torch.tensor(0.0))
        above = torch.nextafter(below, torch.tensor(1e9))
        x = torch.full((1, 4, 8), 0.01)
        x[0, 0, 0], x[0, 1, 1], x[0, 2, 2] = below, above, torch.nextafter(above, torch.tensor(1e9))
        criterion = Criterion(abs_threshold=threshold, ratio_threshold=1.5)
        exact = _by_median(x, criterion)
        assert exact[0, 2, 2] and not exact[0, 0, 0], threshold
        assert torch.equal(few_massive(x, criterion), exact), threshold


def test_passes_compares_as_torch_does_with_or_without_grad():
    """Criterion.passes compares in NumPy on the CPU: the same mask as torch's comparison, in float32 and
    float64, and torch's own where an input needs grad (NumPy cannot read it)."""
    gen = torch.Generator().manual_seed(2)
    criterion = Criterion(abs_threshold=100.3, ratio_threshold=1000.1)
    for dtype in (torch.float32, torch.float64):
        mag = (torch.rand(2, 9, 16, generator=gen, dtype=dtype) * 300).abs()
        scale = torch.rand(2, 1, 1, generator=gen, dtype=dtype) * 0.2
        want = mag > (criterion.ratio_threshold * scale).clamp(min=criterion.abs_threshold)
        assert torch.equal(criterion.passes(mag, scale), want)
        assert torch.equal(criterion.passes(mag.clone().requires_grad_(), scale), want)
        assert torch.equal(criterion.passes(mag, scale.clone().requires_grad_()), want)
