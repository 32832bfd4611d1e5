"""Low-bit quantization of a model with massive activations: settings, rotations, kept sinks.

:func:`quantize` (one setting) and :func:`quantize_grid` (several) return a
:class:`Quantization`; see :mod:`massive_lens.quant.api` for what each option means.
"""

from massive_lens.quant.api import quantize, quantize_grid
from massive_lens.quant.result import Quantization
from massive_lens.quant.settings import GRID, Setting

__all__ = ["GRID", "Quantization", "Setting", "quantize", "quantize_grid"]
