"""Is sink mass a predictor of quantization damage? Per layer, against dispersion.

:func:`sink_predictor` measures, per layer of one model: the **sink mass** (the mean over heads
of the attention to the first token, :func:`~massive_lens.quant.measure_outliers`), the
**dispersion** (the largest column dispersion of the layer's quantized weights and inputs) and
**underflow** (:mod:`massive_lens.quant.dispersion`), and the **damage** (the loss gap with only
that layer quantized, :func:`~massive_lens.quant.float16.layer_damage`); then Spearman's rank
correlation of each predictor with the damage, with a 95% interval and a permutation p-value.

>>> from massive_lens import tiny_model
>>> p = sink_predictor(tiny_model("llama"), "One. Two. Three. " * 40, seq_len=32, n_seqs=2)
>>> list(zip(p.correlations.x, p.correlations.y))[:2]
[('sink_mass', 'damage'), ('dispersion', 'damage')]
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from massive_lens.core.corpora import Corpus
from massive_lens.core.stats import spearman_interval
from massive_lens.quant.findings import SinkPredictor
from massive_lens.quant.float16 import layer_damage
from massive_lens.quant.outlier_stats import measure_outliers
from massive_lens.quant.settings import Setting

PREDICTORS = ("sink_mass", "dispersion", "underflow")


def sink_predictor(model: Any, corpus: Corpus = None, *, setting: str | Setting = "W8A8@tensor", seq_len: int = 128,
                   n_seqs: int = 8, calibration: Any = None) -> SinkPredictor:
    """Per-layer sink mass, dispersion, underflow and damage, and their rank correlations.

    Args:
        model: as :func:`~massive_lens.quant.quantize_grid`.
        corpus: evaluation text (the same sequences for every measurement).
        setting: the setting of the damage (default ``W8A8@tensor``; no rotation).
        seq_len: tokens per sequence.
        n_seqs: evaluation sequences (as many calibrate).
        calibration: other text for the static ranges.

    Returns:
        A :class:`~massive_lens.quant.findings.SinkPredictor`.

    Raises:
        MassiveLensError: for fewer than 4 layers (a rank correlation needs 4 pairs), or as
            :func:`~massive_lens.quant.float16.layer_damage`.
    """
    spec = setting if isinstance(setting, Setting) else Setting.parse(setting)
    per_channel = spec.granularity != "tensor"  # the weights' scales of the damage's setting
    report = measure_outliers(model, corpus, seq_len=seq_len, n_seqs=n_seqs, calibration=calibration,
                              per_channel=per_channel)
    damage = layer_damage(model, corpus, setting=setting, seq_len=seq_len, n_seqs=n_seqs, calibration=calibration)
    tensors = report.tensors
    per_layer = tensors[tensors.layer >= 0].groupby("layer").agg(dispersion=("col_dispersion", "max"),
                                                                 underflow=("underflow", "max"))
    frame = (report.frame[["layer", "sink_mass"]].merge(per_layer.reset_index(), on="layer")
             .merge(damage, on="layer"))
    rows = [dict(x=x, y="damage", **spearman_interval(frame[x].to_numpy(), frame.damage.to_numpy()))
            for x in PREDICTORS]
    rows.append(dict(x="sink_mass", y="dispersion",
                     **spearman_interval(frame.sink_mass.to_numpy(), frame.dispersion.to_numpy())))
    return SinkPredictor(model_name=report.model_name, setting=spec.name, frame=frame, correlations=pd.DataFrame(rows))
