"""Quantization of a model with massive activations: the one home of the package's quantization.

- :func:`measure_outliers` (:class:`OutlierReport`): per-layer max inf-norm, top-1/median and
  kurtosis, the sink metric, and the loss gap under W8A8 (:mod:`massive_lens.quant.outliers`);
- :func:`quantize` (one setting) and :func:`quantize_grid` (several) return a
  :class:`Quantization`: W4A4, the KV cache, rotations, kept sinks (:mod:`massive_lens.quant.api`);
  settings by name (:class:`Setting`, the default :data:`GRID`);
- :func:`lowbit_grid` (:class:`LowBitGrid`): the plain round-to-nearest settings through
  :func:`fake_quantized`, the engine of the W8A8 above (:mod:`massive_lens.quant.fake`).

>>> from massive_lens import tiny_model
>>> grid = quantize_grid(tiny_model("llama"), "One. Two. Three. " * 40, settings=["W8A8"], seq_len=32, n_seqs=2)
>>> grid.to_frame().setting.tolist()
['W8A8']
"""

from massive_lens.quant.api import quantize, quantize_grid
from massive_lens.quant.fake import fake_quantized
from massive_lens.quant.outliers import lowbit_grid, measure_outliers
from massive_lens.quant.result import LowBitGrid, OutlierReport, Quantization
from massive_lens.quant.settings import GRID, Setting

__all__ = ["GRID", "LowBitGrid", "OutlierReport", "Quantization", "Setting", "fake_quantized", "lowbit_grid",
           "measure_outliers", "quantize", "quantize_grid"]
