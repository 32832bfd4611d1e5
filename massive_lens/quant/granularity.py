"""Quantization damage by granularity, and how much of it the sinks cause: ``D_sink``.

:func:`granularity_table` runs, through :func:`~massive_lens.quant.quantize_grid`'s engine (one
:class:`~massive_lens.quant.run.Run`, the same sequences and full-precision pass), each base
setting (``W8A8``, ``W4A4``) at every activation granularity (``tensor``: static per tensor,
``channel``: static per input channel, ``token``: dynamic per token, ``group``: dynamic per token
in groups; the weight granularity follows, :class:`~massive_lens.quant.simulate.Bits`), the
asymmetric per-group baseline (``@group+asym``) and the rotated setting (``+hadamard``), each
beside its twin with the sinks kept in full precision (``+kvsink``). Then

``D_sink = gap(all quantized) - gap(sinks kept in full precision)``,

per sequence (both gaps share the sequence's full-precision loss, so it is the paired difference
of the two quantized losses), averaged with a 95% bootstrap interval over sequences, in nats and
in perplexity points. A setting (or its kept twin) whose perplexity exceeds ten times the
reference is flagged ``destroyed`` and left out of the per-tensor / per-token ratio.

>>> from massive_lens import tiny_model
>>> t = granularity_table(tiny_model("llama"), "One. Two. Three. " * 40, bases=["W8A8"], extra=[],
...                       granularities=["tensor", "token"], seq_len=32, n_seqs=2)
>>> t.to_frame().setting.tolist()
['W8A8@tensor', 'W8A8@token']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pandas as pd
import torch

from massive_lens.core.corpora import Corpus
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.quant.api import evaluate_grid, prepare_grid
from massive_lens.quant.findings import GranularityTable
from massive_lens.quant.result import Quantization
from massive_lens.quant.settings import GRANULARITIES, Setting

BASES = ("W8A8", "W4A4")
EXTRA = ("W4A4@group+asym", "W4A4@token+hadamard")  # the asymmetric per-group baseline and the rotated one


def granularity_settings(bases: Sequence[str] = BASES, granularities: Sequence[str] = GRANULARITIES,
                         extra: Sequence[str] = EXTRA) -> list[Setting]:
    """The settings of the table, each followed by its kept-sinks twin.

    >>> [s.name for s in granularity_settings(["W8A8"], ["tensor"], [])]
    ['W8A8@tensor', 'W8A8@tensor+kvsink']
    """
    plain = [Setting.parse(f"{b}@{g}") for b in bases for g in granularities]
    plain += [Setting.parse(e) for e in extra]
    out = []
    for s in plain:
        if s.keep_sinks is not None:
            raise MassiveLensError(f"{s.name}: name settings without kept sinks; each runs beside its +kvsink twin")
        if s.granularity is None:
            raise MassiveLensError(f"{s.name}: name the granularity (@tensor, @channel, @token or @group)")
        out += [s, replace(s, keep_sinks="kvsink")]
    return out


def paired(a: pd.Series, b: pd.Series) -> tuple[float, float, float]:
    """Mean of ``a - b`` (paired, aligned by position) with its 95% bootstrap interval
    (:func:`~massive_lens.metrics.bootstrap_mean`); infinite differences give infinite bounds."""
    diff = torch.tensor(a.to_numpy() - b.to_numpy(), dtype=torch.float64)
    mean = float(diff.mean())
    if not math.isfinite(mean):
        return mean, mean, mean
    low, high = bootstrap_mean(diff)
    return mean, low, high


def d_sink_rows(grid: Quantization, settings: list[Setting]) -> pd.DataFrame:
    """One row per plain setting of ``settings`` (pairs of a setting and its kept twin) that ran."""
    f = grid.frame.set_index("setting")
    seqs = grid.sequences
    rows = []
    for plain, kept in zip(settings[::2], settings[1::2], strict=True):
        if plain.name not in f.index or kept.name not in f.index:
            continue
        p, k = f.loc[plain.name], f.loc[kept.name]
        lp = seqs[seqs.setting == plain.name].sort_values("seq").loss.reset_index(drop=True)
        lk = seqs[seqs.setting == kept.name].sort_values("seq").loss.reset_index(drop=True)
        nats = paired(lp, lk)
        ppl = paired(lp.clip(upper=700).map(math.exp), lk.clip(upper=700).map(math.exp))
        rows.append(dict(setting=plain.name, base=f"W{plain.weights}A{plain.activations}",
                         weight_granularity=p.weight_granularity, activation_granularity=p.activation_granularity,
                         symmetric=bool(p.symmetric), rotation=p.rotation, gap=p.gap, gap_low=p.gap_low,
                         gap_high=p.gap_high, ppl_ratio=p.ppl_ratio, destroyed=bool(p.destroyed),
                         kept_gap=k.gap, kept_destroyed=bool(k.destroyed),
                         d_sink=nats[0], d_sink_low=nats[1], d_sink_high=nats[2],
                         d_sink_ppl=ppl[0], d_sink_ppl_low=ppl[1], d_sink_ppl_high=ppl[2]))
    return pd.DataFrame(rows)


def granularity_table(
    model: Any,
    corpus: Corpus = None,
    *,
    bases: Sequence[str] = BASES,
    granularities: Sequence[str] = GRANULARITIES,
    extra: Sequence[str] = EXTRA,
    group_size: int = 128,
    seq_len: int = 128,
    n_seqs: int = 8,
    calibration: Any = None,
    seed: int = 0,
    criterion: Any = None,
) -> GranularityTable:
    """Each base setting at each granularity with ``D_sink`` (module docstring).

    Args:
        model: as :func:`~massive_lens.quant.quantize_grid`.
        corpus: evaluation text (as :func:`~massive_lens.quant.quantize_grid`).
        bases: ``W<w>A<a>`` settings run at every granularity (default W8A8, W4A4).
        granularities: activation granularities (default all four).
        extra: more settings, granularity named (default the asymmetric per-group W4A4 and the
            Hadamard-rotated per-token W4A4).
        group_size: the group width of ``@group``.
        seq_len: tokens per sequence.
        n_seqs: evaluation sequences (as many calibrate).
        calibration: other text for the static ranges.
        seed: the rotations' seed.
        criterion: as :func:`~massive_lens.quant.quantize_grid`.

    Returns:
        A :class:`~massive_lens.quant.findings.GranularityTable`.

    Raises:
        MassiveLensError: for a bad setting, a setting naming kept sinks or no granularity, or as
            :func:`~massive_lens.quant.quantize_grid`.
    """
    specs = granularity_settings(bases, granularities, extra)
    run, planned, skipped = prepare_grid(model, corpus, settings=specs, granularity="token", symmetric=True,
                                         group_size=group_size, seq_len=seq_len, n_seqs=n_seqs,
                                         calibration=calibration, include_head=False, seed=seed,
                                         criterion=criterion)
    grid = evaluate_grid(run, planned, skipped)
    return GranularityTable(model_name=grid.model_name, frame=d_sink_rows(grid, specs), fp_loss=grid.fp_loss,
                            arms=grid.frame, sequences=grid.sequences)
