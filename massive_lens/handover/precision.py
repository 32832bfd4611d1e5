"""Will this model run in float16 or bfloat16? Measure in float32, then confirm.

A massive activation is a number half precision may not hold. float16 tops out at 65,504 and
bfloat16 keeps float32's range but only 8 bits of mantissa. Two things go wrong:

- **overflow**: a residual, attention or MLP value exceeds the dtype's largest value, or
  what a norm computes from its input does: the squares ``x**2`` (``(x - mean)**2`` for
  LayerNorm) and their mean, the variance (RMSNorm's ``mean(x**2)``). Attention's first
  product, ``q . k`` before its ``1/sqrt(d_head)`` scaling, is measured too (at the site
  ``attn.hook_attn_scores``, causal entries, largest over heads; ``pos`` is the query and
  ``dim`` the key position): Qwen2.5's key biases make it overflow float16 in layer 0;
- **rounding away**: at a massive value the dtype's spacing (the gap between neighbouring
  representable numbers) is larger than the typical activation at that site (the median
  ``|x|``), so updates of typical size vanish in that entry.

:func:`precision_check` measures every such value once in float32 and compares it with each
dtype's range and spacing (no cast needed), giving each problem's site, layer, position
and dim. It then **confirms** by running the model in each dtype on the same tokens. The
weights are cast in place, and every parameter and buffer is put back, bit for bit, on every
exit path. The verdict is ``safe`` or ``unsafe``. An unsafe verdict names its cause and the
smallest fix that held in a run (:mod:`~massive_lens.handover.rescale`): rescaling the residual
stream, the fewest blocks kept in float32 (:mod:`~massive_lens.handover.mixed`), bfloat16, or
float32; clamping at the dtype's limit is costed in float32. Whether a norm's square overflows
depends on the implementation (Hugging Face's RMSNorm squares in float32): the run shows it.

>>> from massive_lens import tiny_model
>>> check = precision_check(tiny_model("llama"), "Some text to read. " * 20, seq_len=16, n_seqs=2)
>>> check.verdicts["verdict"].tolist()
['safe', 'safe']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.fmt import num, ratio
from massive_lens.core.loss import NextTokenLoss
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.detect.scope import layer_span
from massive_lens.errors import MassiveLensError
from massive_lens.handover.headroom import DTYPES, PROBLEM_COLUMNS, PROBLEMS, SITES, SitePeaks, dtype_of, problems_in
from massive_lens.handover.mixed import block_dtype_hooks, cast
from massive_lens.handover.rescale import cause_of, smallest_fix

VERDICT_COLUMNS = ["dtype", "verdict", "loss_float32", "loss", "ppl_ratio", "top1_agree", "nonfinite_at", *PROBLEMS,
                   "clamp_ppl_ratio", "kept_float32", "kept_ppl_ratio", "fix"]
FIX_COLUMNS = ["cause", "rescale_factor", "rescale_ppl_ratio", "bfloat16_ppl_ratio", "smallest_fix"]


@dataclass(frozen=True, kw_only=True)
class PrecisionCheck(Result):
    """What float16 and bfloat16 do to a model's activations, measured and confirmed.

    ``to_frame()`` (``problems``): one row per (dtype, problem, site, layer): ``problem``
    (``overflow``: a value; ``square_overflow``: a square a norm takes of its input;
    ``variance_overflow``: the mean of those squares; ``rounds_away``), ``site`` (the hook in
    the block), the worst entry's ``seq``, ``pos``, ``dim`` (-1 for a variance) and ``value``
    (float32), ``limit`` (the dtype's largest value; for ``rounds_away`` the site's median
    ``|x|``) and ``count`` (entries past it; positions for the norms' problems). ``verdicts``:
    one row per dtype: ``verdict``, the confirmation run's loss against float32
    (``loss_float32``, ``loss``, ``ppl_ratio``, ``top1_agree``, ``nonfinite_at``: the first hook
    that saw inf or NaN, ``""`` if none), the problem counts, ``clamp_ppl_ratio`` (float32
    perplexity with the overflowing sites clamped to the dtype's range, over the unclamped; NaN
    when nothing overflows), ``kept_float32`` and ``kept_ppl_ratio`` (the blocks an unsafe,
    confirmed verdict keeps in float32, and the perplexity ratio of that mixed run, measured; ""
    and NaN otherwise), ``fix``, and from :func:`~massive_lens.handover.rescale.smallest_fix`:
    ``cause`` (the first value past the range: site, layer, value; and the run's first inf/NaN),
    ``rescale_factor`` and ``rescale_ppl_ratio`` (the residual-stream scale and the perplexity
    ratio of a float16 run with it), ``bfloat16_ppl_ratio`` and ``smallest_fix`` (the least
    change that held in a run: rescale, keep blocks in float32, bfloat16, float32).
    ``peaks``: per site and layer, the float32 ``max_abs``, ``median`` and, at a norm's input,
    ``max_square`` and ``max_variance``.
    """

    problems: pd.DataFrame
    verdicts: pd.DataFrame
    peaks: pd.DataFrame
    model_name: str
    n_seqs: int
    seq_len: int
    tolerance: float

    def to_frame(self) -> pd.DataFrame:
        return self.problems.copy()

    def verdict(self, dtype: str) -> str:
        """The verdict for one dtype.

        Args:
            dtype: a dtype name that was checked (``"float16"``, ``"bfloat16"``).

        Returns:
            ``"safe"`` or ``"unsafe"``.

        Raises:
            MassiveLensError: if ``dtype`` was not checked.
        """
        rows = self.verdicts[self.verdicts["dtype"] == dtype]
        if rows.empty:
            raise MassiveLensError(f"{dtype!r} was not checked; checked: {self.verdicts['dtype'].tolist()}")
        return str(rows["verdict"].iloc[0])

    def first_overflow(self, dtype: str) -> str:
        """The first site, in the forward pass's order, whose value (or a norm's square) passes
        ``dtype``'s range: ``"<site> at layer <n> (|x| = <value>)"``, or "" where none does."""
        rows = self.problems[(self.problems["dtype"] == dtype) & self.problems["problem"].str.endswith("overflow")]
        if rows.empty:
            return ""
        r = rows.iloc[0]
        square = ", its square" if r.problem != "overflow" else ""
        return f"{r.site} at layer {int(r.layer)} (|x| = {num(r.value)}{square})"

    def summary(self) -> str:
        values = self.peaks[self.peaks["kind"] != "scores"]
        peak = values.loc[values["max_abs"].idxmax()]
        lines = [f"{self.model_name}, {self.n_seqs} x {self.seq_len} tokens: largest |x| in float32 "
                 f"{num(peak.max_abs)} ({peak.site}, layer {int(peak.layer)}); at a norm's input the largest "
                 f"square is {self.peaks['max_square'].max():.3g}, the largest variance "
                 f"{self.peaks['max_variance'].max():.3g}"]
        for v in self.verdicts.itertuples():
            mine = self.problems[self.problems["dtype"] == v.dtype]
            found = "; ".join(f"{p} at {n} site(s) in {layer_span(g['layer'])}"
                              for p, g in mine.groupby("problem", sort=False) for n in [len(g)]) or "no problems"
            ran = (f"Confirmed by running in {v.dtype}: inf/NaN from {v.nonfinite_at}." if v.nonfinite_at else
                   f"Not run in {v.dtype} (confirm=False): the verdict rests on the float32 measurement."
                   if math.isnan(v.loss) else
                   f"Confirmed by running in {v.dtype}: loss {v.loss:.4f} vs {v.loss_float32:.4f} in float32 "
                   f"(perplexity x{ratio(v.ppl_ratio)}, top-1 agreement {v.top1_agree:.1%}).")
            first = self.first_overflow(v.dtype)
            found += f"; first overflowing site: {first}" if first else ""
            lines.append(f"  {v.dtype}: {v.verdict.upper()}. Predicted: {found}. {ran}" + (f" Fix: {v.fix.rstrip('.')}."
                                                                                           if v.fix else "")
                         + (f" Cause: {v.cause}. Smallest fix: {v.smallest_fix}." if v.cause else ""))
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Per layer: the residual's largest ``|x|`` and what the norms compute from it (largest
        square and variance), with each dtype's largest value (log scale)."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        resid = self.peaks[self.peaks["site"] == "hook_resid_post"]
        norms = self.peaks[self.peaks["kind"] == "norm"].groupby("layer")[["max_square", "max_variance"]].max()
        ax.plot(resid["layer"], resid["max_abs"], marker="o", markersize=3, label="max |resid_post|")
        ax.plot(norms.index, norms["max_square"], marker="s", markersize=3, label="max square at a norm")
        ax.plot(norms.index, norms["max_variance"], marker="^", markersize=3, label="max variance at a norm")
        for name in self.verdicts["dtype"]:
            ax.axhline(torch.finfo(DTYPES[name]).max, linestyle="--", color="k" if name == "float16" else "grey",
                       label=f"{name} max")
        ax.set(yscale="log", xlabel="layer", ylabel="value", title=f"{self.model_name}: half-precision headroom")
        ax.legend(fontsize="small")
        return ax


def _clamp(x: Tensor, hook: Any, *, limit: float) -> Tensor:
    return x.clamp(-limit, limit)


def _seen(x: Tensor, hook: Any, *, order: list[tuple[str, int, bool]], name: str, layer: int) -> None:
    if name.endswith("attn_scores"):  # masked scores may hold -inf by design: only NaN and +inf count
        order.append((name, layer, not bool(torch.isnan(x).any() | torch.isposinf(x).any())))
    else:
        order.append((name, layer, bool(torch.isfinite(x).all())))


def _run(scorer: NextTokenLoss, tokens: Tensor, hooks: list[tuple[str, Any]]) -> tuple[Tensor, Tensor]:
    """Per-sequence loss and the argmax predictions of one forward pass (every sequence in it: the
    ``SitePeaks`` hooks record the sequence index within the pass). No logits are held where the head
    can be applied slice by slice (:mod:`massive_lens.core.loss`); else the pass's logits are."""
    out = scorer(tokens, hooks=hooks, top1=True)
    return out.loss.float(), out.top1


def _loss_in(view: ModelView, scorer: NextTokenLoss, tokens: Tensor, dtype: torch.dtype,
             hooks: list[tuple[str, Any]]) -> float:
    """The mean loss of a run with the model cast to ``dtype`` and ``hooks`` on."""
    with cast(view.model, dtype):
        return float(_run(scorer, tokens, hooks)[0].mean())


def precision_check(
    model: Any,
    corpus: Corpus = None,
    *,
    dtypes: Sequence[str] = ("float16", "bfloat16"),
    seq_len: int = 64,
    n_seqs: int = 4,
    tolerance: float | int = 0.01,
    confirm: bool = True,
) -> PrecisionCheck:
    """Whether ``model`` runs safely in each half-precision dtype (see the module docstring).

    Args:
        model: a TransformerLens-style model in float32 (it is left as found).
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor,
            or None for the offline default text.
        dtypes: names among ``"float16"`` and ``"bfloat16"``.
        seq_len: tokens per sequence read from a text corpus.
        n_seqs: sequences read from a text corpus.
        tolerance: the largest relative perplexity change (dtype over float32, minus 1) that
            is still ``safe`` (default 0.01).
        confirm: run the model in each dtype to confirm (default True); without it the
            verdict rests on the float32 measurement alone.

    Returns:
        A :class:`PrecisionCheck`: ``.verdicts`` (one row per dtype), ``.to_frame()`` (the problems).

    Raises:
        MassiveLensError: for an unknown or repeated dtype name, no dtypes, a ``tolerance``
            that is not a finite number >= 0, a model not in float32, an unreadable corpus, or
            an nnsight model (its sites need TransformerLens's modules: load it with
            ``backend="bridge"``).
    """
    names = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    chosen = [dtype_of(n) for n in names]
    if not chosen or len(set(names)) != len(names):
        raise MassiveLensError(f"dtypes must name each dtype once, some of {tuple(DTYPES)}; got {names}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) \
            or tolerance < 0:
        raise MassiveLensError(f"tolerance is a relative perplexity change >= 0 (0.01 = 1%), got {tolerance!r}")
    view = ModelView(model)
    if not view.serves_patterns:  # nnsight: no q/k/v, attention-score or norm sites, no per-block casts
        raise view.unsupported("precision_check (its q/k/v, attention-score and norm sites, and the runs with "
                               "blocks cast to float16/bfloat16)")
    if view.dtype != torch.float32:
        raise MassiveLensError(f"{view.name} is in {view.dtype}; precision_check measures in float32: load it with "
                               "dtype=torch.float32 (massive_lens.load_model(..., dtype='float32'))")
    tokens = sequences(view, corpus, seq_len, n_seqs)
    scale = getattr(view.cfg, "attn_scale", None)  # the score divisor; configs may hold -1 for "sqrt(d_head)"
    scale = scale if isinstance(scale, (int, float)) and scale > 0 else math.sqrt(getattr(view.cfg, "d_head", 1) or 1)
    peaks = SitePeaks(chosen, str(getattr(view.cfg, "normalization_type", "RMS")).startswith("LN"), float(scale))
    hooks = [(view.block_hook(layer, site), partial(peaks.hook, site=site, kind=kind, layer=layer))
             for layer in range(view.n_layers) for site, kind in SITES if view.has_hook(layer, site)]
    scorer = NextTokenLoss(view)  # decides, in float32 before any cast, whether the head can run in slices
    loss32, top32 = _run(scorer, tokens, hooks)
    frame = pd.DataFrame(peaks.rows)
    problems, verdicts = [], []
    for name, dtype in zip(names, chosen, strict=True):
        limit = torch.finfo(dtype).max
        mine = problems_in(frame, name, dtype, limit)
        problems += mine
        # the cost of clamping each overflowing site to the dtype's range, in float32 (a norm's input
        # to the square root of it, so that its squares and their mean fit)
        over = {(r[2], r[3]): (limit / scale if r[2] == "attn.hook_attn_scores" else limit) if r[1] == "overflow"
                else math.sqrt(limit) for r in mine if r[1] != "rounds_away"}
        clamp = float("nan")
        if over:
            clamp_loss, _ = _run(scorer, tokens, [(view.block_hook(layer, site), partial(_clamp, limit=bound))
                                                for (site, layer), bound in over.items()])
            clamp = math.exp(float(clamp_loss.mean()) - float(loss32.mean()))
        verdicts.append(_verdict(view, scorer, tokens, name, dtype, mine, loss32, top32, clamp, tolerance, confirm))
    keep = ["site", "kind", "layer", "max_abs", "median", "max_square", "max_variance"]
    table = pd.DataFrame(verdicts, columns=VERDICT_COLUMNS)
    rows = table.to_dict("records")
    fixes = smallest_fix(view, partial(_loss_in, view, scorer, tokens), rows, frame[keep], float(loss32.mean()),
                         tolerance, confirm)
    table = table.assign(cause=[cause_of(r, [p for p in problems if p[0] == r["dtype"]], torch.finfo(
        DTYPES[r["dtype"]]).max) for r in rows], **{c: [f[c] for f in fixes] for c in FIX_COLUMNS[1:]})
    return PrecisionCheck(problems=pd.DataFrame(problems, columns=PROBLEM_COLUMNS), verdicts=table,
                          peaks=frame[keep].copy(), model_name=view.name, n_seqs=int(tokens.shape[0]),
                          seq_len=int(tokens.shape[1]), tolerance=float(tolerance))


def _verdict(view: ModelView, scorer: NextTokenLoss, tokens: Tensor, name: str, dtype: torch.dtype,
             mine: list[tuple], loss32: Tensor, top32: Tensor, clamp: float, tolerance: float, confirm: bool) -> tuple:
    counts = {p: sum(1 for r in mine if r[1] == p) for p in PROBLEMS}
    loss, agree, bad, failed = float("nan"), float("nan"), "", None  # failed: the block where the run saw inf/NaN
    if confirm:
        order: list[tuple[str, int, bool]] = []
        watch = [(view.block_hook(layer, site), partial(_seen, order=order, name=view.block_hook(layer, site),
                                                        layer=layer))
                 for layer in range(view.n_layers) for site, _ in SITES if view.has_hook(layer, site)]
        with cast(view.model, dtype):
            losses, top = _run(scorer, tokens, watch)
        loss, agree = float(losses.mean()), float((top == top32).float().mean())
        bad, failed = next(((n, layer) for n, layer, ok in order if not ok), ("", None))
        if not bad and not math.isfinite(loss):
            bad = "the logits"
    base = float(loss32.mean())
    change = math.exp(loss - base) if math.isfinite(loss) else float("inf") if confirm else float("nan")
    layers = sorted({r[3] for r in mine if r[1] != "rounds_away"})
    unsafe = bool(bad) or (confirm and change > 1 + tolerance) or (not confirm and counts["overflow"] > 0)
    fix, kept, kept_change = "", "", float("nan")
    if unsafe:
        where = sorted({*(layers or {r[3] for r in mine}), *([failed] if failed is not None else [])})
        fix = f"keep {layer_span(where)} in float32" if where else "run in float32"
        if confirm and where:
            where, kept_change = _fewest_kept(view, scorer, tokens, dtype, mine, failed, where, base, tolerance)
            kept = layer_span(where) if where else ""
            fix = (f"keep {kept} in float32 (measured: the rest in {name}, perplexity x{ratio(kept_change)})"
                   if where else f"run in float32 (keeping {layer_span(layers)} in float32 was not enough)")
        if failed is not None and failed not in layers:
            fix += (f" (layer {failed} overflowed inside a computation no measured site shows, e.g. the attention "
                    "scores; the float32 measurement did not predict it)")
        if math.isfinite(clamp) or clamp == math.inf:
            fix += (f", or clamp the overflowing sites to the range (+-{num(torch.finfo(dtype).max)}; a norm's input "
                    f"to +-{num(math.sqrt(torch.finfo(dtype).max))}): perplexity x{ratio(clamp)}, measured in float32")
    elif (counts["square_overflow"] or counts["variance_overflow"]) and confirm:
        fix = ("none needed: the norms' squares exceed the range, yet the run stayed finite, so this model's norms "
               f"square in a wider type; keep them so (clamping their inputs instead: perplexity x{ratio(clamp)})")
    return (name, "unsafe" if unsafe else "safe", base, loss, change, agree, bad, *(counts[p] for p in PROBLEMS),
            clamp, kept, kept_change, fix)


def _fewest_kept(view: ModelView, scorer: NextTokenLoss, tokens: Tensor, dtype: torch.dtype, mine: list[tuple],
                 failed: int | None, where: list[int], base: float, tolerance: float) -> tuple[list[int], float]:
    """The blocks to keep in float32, measured: first only those where a value itself overflows
    (and the one where the run failed), then every block with a problem; the first set whose
    mixed run stays finite and within ``tolerance`` of float32, with its perplexity ratio
    (``[]`` and the last ratio when none does)."""
    values = sorted({r[3] for r in mine if r[1] == "overflow"} | ({failed} if failed is not None else set()))
    change = float("inf")
    for keep in dict.fromkeys((tuple(values), tuple(where))):
        if not keep:
            continue
        with cast(view.model, dtype, keep=keep):
            losses, _ = _run(scorer, tokens, block_dtype_hooks(view, dtype, keep))
        loss = float(losses.mean())
        change = math.exp(loss - base) if math.isfinite(loss) else float("inf")
        if change <= 1 + tolerance:
            return list(keep), change
    return [], change
