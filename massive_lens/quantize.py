"""Deprecated: quantization lives in :mod:`massive_lens.quant` (issue 38); this module only forwards.

Each old name still works and warns (``DeprecationWarning``) once per use, naming its new home:

=========================  ==================================================
old ``massive_lens.quantize``  new
=========================  ==================================================
``measure_outliers``       ``massive_lens.measure_outliers`` (``massive_lens.quant``)
``OutlierReport``          ``massive_lens.quant.OutlierReport``
``lowbit_grid``            ``massive_lens.quant.lowbit_grid``
``LowBitGrid``             ``massive_lens.quant.LowBitGrid``
``GRID``                   ``massive_lens.quant.settings.ROUND_TO_NEAREST``
``parse_bits``             ``massive_lens.quant.settings.parse_bits``
``fake_quantized``, ...    ``massive_lens.quant.fake``
=========================  ==================================================

Results saved by the old module load as the new classes (:func:`massive_lens.load`).

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from massive_lens.quantize import GRID
>>> GRID, "massive_lens.quant.settings.ROUND_TO_NEAREST" in str(caught[0].message)
(('W8A8', 'W4A16', 'W4A4'), True)
"""

from __future__ import annotations

from typing import Any

from massive_lens.quant import fake, outlier_stats, result, settings
from massive_lens.quant.deprecated import forward

MOVED = {  # old name -> (module, name there)
    "measure_outliers": (outlier_stats, "measure_outliers"), "lowbit_grid": (outlier_stats, "lowbit_grid"),
    "OutlierReport": (result, "OutlierReport"), "LowBitGrid": (result, "LowBitGrid"),
    "GRID": (settings, "ROUND_TO_NEAREST"), "parse_bits": (settings, "parse_bits"),
    "fake_quantized": (fake, "fake_quantized"), "fake_quant_weight": (fake, "fake_quant_weight"),
    "fake_quant_activation": (fake, "fake_quant_activation"),
}


def __getattr__(name: str) -> Any:
    return forward(__name__, MOVED, name)
