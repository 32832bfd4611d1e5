"""Number formatting for summaries, tables and reports: one definition of each style.

>>> num(24926.2), num(0.01234), pct(0.953), pct(0.0123), ratio(1.0634), ratio(2.06e7)
('24,926', '0.0123', '95%', '1.2%', '1.063', '2.06e+07')
"""

from __future__ import annotations

import math
from typing import Any


def num(value: float) -> str:
    """A measured value: thousands separators from 100 up, 3 significant digits below."""
    if math.isnan(value):
        return "nan"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.3g}"


def pct(value: float) -> str:
    """A share: one decimal below 10%, none above."""
    return "nan" if math.isnan(value) else f"{value:.1%}" if abs(value) < 0.1 else f"{value:.0%}"


def ratio(value: float) -> str:
    """A ratio near 1 (perplexity ratios): three decimals, or 3 significant digits when huge."""
    return f"{value:.3f}" if abs(value) < 1e4 else f"{value:.3g}"


def cell(value: Any) -> str:
    """A table cell: floats to 4 significant digits (whole numbers from 1e5), others as str."""
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def short(label: Any, width: int = 60) -> str:
    """A label on one line (runs of whitespace collapsed), cut to ``width`` characters."""
    text = " ".join(str(label).split())
    return text if len(text) < width else text[: width - 3] + "..."
