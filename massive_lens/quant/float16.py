"""The fewest modules to keep in full precision, and the damage of each layer quantized alone.

:func:`fewest_float16` ranks every linear layer of a setting (no rotation: a rotation is fused
into every layer, so no layer can leave it) by its own relative output error in one pass with
every layer quantized (``|y_q - y| / |y|`` per token, averaged over tokens: a massive token's large
output does not hide the other tokens' error; ``y`` the layer's output on the same input with its
weight and input unquantized; a zero output kept zero has no error), then keeps the first ``k`` of
that ranking in full precision for growing ``k`` (1, 2, 3, 4, 6, 9, 13, ...: half as many again
each step) until the perplexity comes within ``target`` times the full-precision perplexity, and
narrows the last step by bisection: the smallest ``k`` of the ranking that reaches the target,
and the curve of every ``k`` measured. A ranked search, not an exhaustive one: a set outside the
ranking's prefixes is not tried.

:func:`layer_damage`: the loss gap with only one layer's modules quantized, per layer.

>>> from massive_lens import tiny_model
>>> s = fewest_float16(tiny_model("llama"), "One. Two. Three. " * 40, setting="W4A4@tensor", seq_len=32, n_seqs=2,
...                    target=100.0)
>>> s.to_frame().kept.tolist()
[0]
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from massive_lens.core.corpora import Corpus
from massive_lens.errors import MassiveLensError
from massive_lens.quant.api import prepare_grid
from massive_lens.quant.findings import Float16Search
from massive_lens.quant.run import Run
from massive_lens.quant.settings import Setting, parse_settings
from massive_lens.quant.simulate import Bits


def _counts(n: int) -> list[int]:
    """1, 2, 3, 4, 6, 9, 13, 19, ...: half as many again each step, up to ``n`` (``n`` itself last)."""
    out, a = [], 1
    while a < n:
        out.append(a)
        a = max(a + 1, a * 3 // 2)
    return [*out, n]


def _one(setting: str | Setting) -> Setting:
    specs = parse_settings(setting)
    if len(specs) != 1:
        raise MassiveLensError(f"name one setting, got {[s.name for s in specs]}")
    if specs[0].rotation is not None:
        raise MassiveLensError(f"{specs[0].name}: a rotated setting cannot leave a module in full precision (the "
                               "rotation is fused into every layer); use a setting without a rotation")
    return specs[0]


def _start(model: Any, corpus: Corpus, setting: str | Setting, seq_len: int, n_seqs: int, calibration: Any,
           seed: int) -> tuple[Run, Setting, Bits]:
    spec = _one(setting)
    run, planned, _ = prepare_grid(model, corpus, settings=[spec], granularity="token", symmetric=True,
                                   group_size=128, seq_len=seq_len, n_seqs=n_seqs, calibration=calibration,
                                   include_head=False, seed=seed, criterion=None)
    return run, *planned[0]


def _site_name(site: Any, i: int) -> str:
    return f"layer {site.layer} {site.name}" if site.layer >= 0 else f"{site.name} {i}"


def fewest_float16(
    model: Any,
    corpus: Corpus = None,
    *,
    setting: str | Setting = "W8A8@tensor",
    target: float = 1.05,
    seq_len: int = 128,
    n_seqs: int = 8,
    calibration: Any = None,
    seed: int = 0,
) -> Float16Search:
    """The smallest prefix of the damage ranking to keep in full precision (module docstring).

    Args:
        model: as :func:`~massive_lens.quant.quantize_grid`.
        corpus: evaluation text (as :func:`~massive_lens.quant.quantize_grid`).
        setting: one setting without a rotation (default ``W8A8@tensor``: static per-tensor).
        target: the perplexity to reach, as a multiple of full precision's (default 1.05).
        seq_len: tokens per sequence.
        n_seqs: evaluation sequences (as many calibrate).
        calibration: other text for the static ranges.
        seed: unused without a rotation; kept for the grid's options.

    Returns:
        A :class:`~massive_lens.quant.findings.Float16Search`.

    Raises:
        MassiveLensError: for a target below 1, a rotated setting, or as
            :func:`~massive_lens.quant.quantize_grid`.
    """
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not target >= 1:
        raise MassiveLensError(f"target is a perplexity ratio of at least 1 (e.g. 1.05), got {target!r}")
    run, spec, bits = _start(model, corpus, setting, seq_len, n_seqs, calibration, seed)
    sites = run.sites(False, bits.kv is not None)
    row, _, _, sim = run.evaluate(spec, bits, site_errors=True)
    errors = {i: total / n for i, (total, n) in (sim.site_errors or {}).items() if n}
    order = sorted(range(len(sites)), key=lambda i: -errors.get(i, 0.0))
    ranking = pd.DataFrame({"module": [_site_name(sites[i], i) for i in order],
                            "layer": [sites[i].layer for i in order],
                            "error": [errors.get(i, math.nan) for i in order]})
    curve = {0: row}

    def at(k: int) -> dict[str, Any]:
        if k not in curve:
            curve[k] = run.evaluate(spec, bits, exempt=frozenset(order[:k]))[0]
        return curve[k]

    def ok(k: int) -> bool:
        return at(k)["ppl_ratio"] <= target

    found = 0 if ok(0) else None
    last = 0
    for k in (_counts(len(order)) if found is None else []):
        if ok(k):
            low, high = last, k  # not ok at low, ok at high
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (low, mid) if ok(mid) else (mid, high)
            found = high
            break
        last = k
    frame = pd.DataFrame([dict(kept=k, perplexity=r["perplexity"], ppl_ratio=r["ppl_ratio"], gap=r["gap"])
                          for k, r in sorted(curve.items())])
    return Float16Search(model_name=run.view.name, setting=spec.name, target=float(target),
                         fp_perplexity=math.exp(float(run.fp.double().mean())), frame=frame, ranking=ranking,
                         modules=None if found is None else tuple(ranking.module[:found]))


def layer_damage(model: Any, corpus: Corpus = None, *, setting: str | Setting = "W8A8@tensor", seq_len: int = 128,
                 n_seqs: int = 8, calibration: Any = None) -> pd.DataFrame:
    """The loss gap with only one layer's modules quantized, one row per layer (``layer``,
    ``damage`` in nats, ``damage_low``/``damage_high`` its 95% interval over sequences).

    Args:
        model: as :func:`~massive_lens.quant.quantize_grid`.
        corpus: evaluation text.
        setting: one setting without a rotation (default ``W8A8@tensor``).
        seq_len: tokens per sequence.
        n_seqs: evaluation sequences (as many calibrate).
        calibration: other text for the static ranges.

    Returns:
        A DataFrame, one row per layer.

    Raises:
        MassiveLensError: for a rotated setting, a model whose layers cannot be told apart, or
            as :func:`~massive_lens.quant.quantize_grid`.

    >>> from massive_lens import tiny_model
    >>> len(layer_damage(tiny_model("llama"), "One. Two. Three. " * 40, seq_len=32, n_seqs=2))
    4
    """
    run, spec, bits = _start(model, corpus, setting, seq_len, n_seqs, calibration, 0)
    sites = run.sites(False, bits.kv is not None)
    layers = sorted({s.layer for s in sites if s.layer >= 0})
    if not layers:
        raise MassiveLensError(f"{run.view.name}: its linear layers cannot be told apart by block; layer_damage "
                               "needs a TransformerBridge over a decoder with blocks")
    rows = []
    for layer in layers:
        exempt = frozenset(i for i, s in enumerate(sites) if s.layer != layer)
        r = run.evaluate(spec, bits, exempt=exempt)[0]
        rows.append(dict(layer=layer, damage=r["gap"], damage_low=r["gap_low"], damage_high=r["gap_high"]))
    return pd.DataFrame(rows)
