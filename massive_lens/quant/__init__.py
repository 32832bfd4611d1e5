"""Quantization of a model with massive activations: the one home of the package's quantization.

- :func:`measure_outliers` (:class:`OutlierReport`): per-layer max inf-norm, top-1/median and
  kurtosis, the sink metric, and the loss gap under W8A8 (:mod:`massive_lens.quant.outlier_stats`);
- :func:`quantize` (one setting) and :func:`quantize_grid` (several) return a
  :class:`Quantization`: W4A4, the KV cache, rotations, kept sinks (:mod:`massive_lens.quant.api`);
  settings by name (:class:`Setting`, the default :data:`GRID`);
- :func:`lowbit_grid` (:class:`LowBitGrid`): the plain round-to-nearest settings through
  :func:`fake_quantized`, the engine of the W8A8 above (:mod:`massive_lens.quant.fake`);
- :func:`granularity_table` (:class:`GranularityTable`): every setting per granularity with
  ``D_sink``, the damage the sinks cause (:mod:`massive_lens.quant.granularity`);
  :func:`fewest_float16` (:class:`Float16Search`): the fewest modules to keep in full precision,
  :func:`layer_damage` (:mod:`massive_lens.quant.float16`); :func:`sink_predictor`
  (:class:`SinkPredictor`): sink mass, dispersion and damage per layer, rank-correlated
  (:mod:`massive_lens.quant.predictor`).

>>> from massive_lens import tiny_model
>>> grid = quantize_grid(tiny_model("llama"), "One. Two. Three. " * 40, settings=["W8A8"], seq_len=32, n_seqs=2)
>>> grid.to_frame().setting.tolist()
['W8A8']
"""

from massive_lens.quant.api import quantize, quantize_grid
from massive_lens.quant.fake import fake_quantized
from massive_lens.quant.findings import Float16Search, GranularityTable, SinkPredictor
from massive_lens.quant.float16 import fewest_float16, layer_damage
from massive_lens.quant.granularity import granularity_table
from massive_lens.quant.outlier_stats import lowbit_grid, measure_outliers
from massive_lens.quant.predictor import sink_predictor
from massive_lens.quant.result import LowBitGrid, OutlierReport, Quantization
from massive_lens.quant.settings import GRID, Setting

__all__ = ["GRID", "Float16Search", "GranularityTable", "LowBitGrid", "OutlierReport", "Quantization", "Setting",
           "SinkPredictor", "fake_quantized", "fewest_float16", "granularity_table", "layer_damage", "lowbit_grid",
           "measure_outliers", "quantize", "quantize_grid", "sink_predictor"]
