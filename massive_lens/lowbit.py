"""Deprecated: round-to-nearest fake quantization lives in :mod:`massive_lens.quant.fake` (issue 38).

Each old name (``fake_quantized``, ``fake_quant_weight``, ``fake_quant_activation``,
``fake_quant_tokens``, ``fake_quant``, ``rtn``, ``GRANULARITIES``, ``FULL``) still works and warns
(``DeprecationWarning``) once per use, naming its new home.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from massive_lens.lowbit import rtn
>>> rtn.__module__, "massive_lens.quant.fake.rtn" in str(caught[0].message)
('massive_lens.quant.fake', True)
"""

from __future__ import annotations

from typing import Any

from massive_lens.quant import fake, settings
from massive_lens.quant.deprecated import forward

MOVED = {name: (fake, name) for name in ("fake_quantized", "fake_quant_weight", "fake_quant_activation",
                                         "fake_quant_tokens", "fake_quant", "rtn", "FULL")}
MOVED["GRANULARITIES"] = (settings, "GRANULARITIES")


def __getattr__(name: str) -> Any:
    return forward(__name__, MOVED, name)
