"""The paper's Table 3: every intervention judged by perplexity on the same sequences, and
checked downstream.

Each intervention of :data:`~massive_lens.interventions.registry.REGISTRY` is evaluated on
the *same* token sequences as the untouched model, with the perplexity ratio and a paired
95% bootstrap interval over sequences (the per-sequence log-ratio is resampled, so the
interval reflects how consistently a setting hurts, not how hard the sequences are).
Calibration statistics (means) must come from text other than the evaluation text.

Before any setting runs, the sinks of every evaluation batch are found by the one rule
(:func:`~massive_lens.attention.find_sinks`: positions that draw attention as sinks or carry
a persistent massive activation), and every setting uses exactly those. Every row then says
which positions it treated as sinks, and what its targets held downstream with and without
it (:mod:`massive_lens.interventions.checks`). A massive-activation removal that the model
undoes a few layers later is flagged ("the model rebuilds it") and its ``_every`` variant,
which removes the value at every layer where it is massive, is added to the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.attention.sinks import LEVEL, SinkSet, sinks_of
from massive_lens.core.budget import logit_batches
from massive_lens.core.charts import intervention_bars
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.fmt import ratio as _num
from massive_lens.core.model_view import ModelView
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.interventions.arm_stats import arm_lines
from massive_lens.interventions.calibration import calibrate, describe_source
from massive_lens.interventions.calibration_result import Calibration
from massive_lens.interventions.checks import Record, downstream, reading
from massive_lens.interventions.registry import ATTN, EVERY, REGISTRY, SETTINGS
from massive_lens.metrics import perplexity

# the settings that run on an nnsight model (they edit the residual stream, or nothing)
NNSIGHT_SETTINGS = ("original", "zero", "mean", "resample", "noise", "control", "zero_every", "mean_every",
                    "resample_every", "noise_every")
CHECK_COLUMNS = ["where", "acts_on", "sinks_per_seq", "sink_kinds", "targets_per_seq", "target_dims", "target_kinds",
                 "target_kept", "peak_layer", "target_back", "back_layer", "sink_mass", "sink_mass_original", "rebuilt",
                 "added", "check"]


@dataclass(frozen=True, kw_only=True)
class InterventionTable(Result):
    """The paper's Table 3, with each row's downstream check.

    ``to_frame()`` columns: ``setting``, ``perplexity``, ``ratio`` (perplexity / original),
    ``ratio_low``, ``ratio_high`` (paired 95% bootstrap interval over sequences),
    ``accuracy``, ``n_seqs``, ``description``; then, measured on the evaluation batches:

    - ``where``: ``first`` or ``every`` for massive-activation edits, else empty;
    - ``acts_on``: where it edits the forward pass, relative to the model's norms;
    - ``sinks_per_seq``, ``sink_kinds``: positions it treated as sinks (mean per sequence;
      token kinds with counts); NaN and empty for settings that use no sinks;
    - ``targets_per_seq``: positions whose massive entries it targeted, per sequence;
      ``target_dims``: the dims it edits there (the calibrated massive dims; outlier
      dimensions only with ``outliers="include"``); ``target_kinds``: the token kinds of the
      targeted positions, with counts over all sequences (empty for settings that edit none);
      ``edited_dims``: the dims whose residual entries it really set, each with how many
      (``"5 (64)"``), counted in the hooks: what the summary's outlier line is read from;
    - ``target_kept``: the targeted dims' mean ``|value|`` at their original peak layer
      (``peak_layer``), with the intervention / without (largest over dims);
    - ``target_back``, ``back_layer``: the largest such ratio at a later layer where the dim
      is massive in calibration, and that layer; a removal is undone (``rebuilt``) when it
      reaches ``REBUILT`` (0.5);
    - ``sink_mass``, ``sink_mass_original``: attention of non-sink queries to the sinks,
      mean over heads and the intervened layers, with and without it;
    - ``rebuilt``: a removal whose target came back; ``added``: a row added because the
      first-layer row was rebuilt; ``check``: the one-line reading.

    ``checks``: the long table behind those (``setting``, ``kind``, ``dim``, ``layer``,
    ``without``, ``with``, ``kept``); ``sinks``: the evaluation batches' sinks;
    ``calibration_source``: where the means were measured; ``calibration``: the
    :class:`Calibration` itself, which ``ablate_massive(model, "mean",
    calibration=table.calibration)`` (and ``run_interventions``) reuse as is.
    """

    frame: pd.DataFrame
    model_name: str
    corpus: str
    calibration_source: str
    seq_len: int
    checks: pd.DataFrame = field(default_factory=pd.DataFrame)
    sinks: SinkSet | None = None
    calibration: Calibration | None = None

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        n_seqs = int(self.frame["n_seqs"].iloc[0])
        lines = [f"{self.model_name}: interventions judged by perplexity on {self.corpus} "
                 f"({n_seqs} sequences of {self.seq_len} tokens; calibration: {self.calibration_source})",
                 f"{'setting':<24}{'perplexity':>12}{'ratio':>10}{'95% interval':>22}{'accuracy':>10}"]
        for r in self.frame.itertuples():
            interval = f"[{_num(r.ratio_low)}, {_num(r.ratio_high)}]"
            lines.append(f"{r.setting:<24}{_num(r.perplexity):>12}{_num(r.ratio):>10}{interval:>22}{r.accuracy:>10.1%}")
        lines += arm_lines(self.frame)  # a zero-ablation verdict beside its controls (mean/resample/noise/template)
        if "check" not in self.frame:
            return "\n".join(lines)
        if self.sinks is not None:
            lines.append(f"sinks (positions that draw attention as sinks or carry persistent massive activations; "
                         f"{LEVEL}): {self.sinks.describe()}")
        calib = self.calibration
        if calib is not None and len(getattr(calib, "outlier_dims", ())):
            lines.append(outlier_line(calib, self.frame))
        edits = self.frame[self.frame["target_dims"] != ""] if "target_dims" in self.frame else self.frame.iloc[:0]
        for r in edits.drop_duplicates("target_dims").itertuples():
            lines.append(f"targets of the massive-activation edits: dims {r.target_dims} at {r.target_kinds} "
                         f"({r.targets_per_seq:.3g} per sequence)")
        lines.append("checked downstream, on the evaluation text:")
        for r in self.frame.itertuples():
            if r.setting == "original":
                continue
            added = " [added: the first-layer removal did not hold]" if r.added else ""
            lines.append(f"  {r.check}{added}")
        flagged = self.frame[self.frame["rebuilt"]]
        if len(flagged):
            lines.append("NOTE: " + ", ".join(flagged["setting"]) + " did not remove the massive activations: "
                         "the model rebuilt them downstream, so their perplexity does not measure a removal")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Perplexity ratio per setting (log scale) with its 95% interval."""
        return intervention_bars(self.frame, ax=ax, title=f"{self.model_name}: interventions")


@dataclass
class _Run:
    per_seq: Tensor
    accuracy: Tensor
    record: Record
    intervention: Any


def _evaluate(model: Any, setting: str, calib: Calibration, batches: list[tuple[Tensor, SinkSet]],
              bar: Any) -> _Run:
    losses, accs, record, first = [], [], Record(), None
    for chunk, sinks in batches:
        iv = REGISTRY[setting].build(model, calib, sinks=sinks)
        first = first or iv
        with iv.reading():  # the record of the attention on the sinks: the kernel's, where no pattern is served
            res = perplexity(model, chunk, batch_size=len(chunk), hooks=iv, progress=False)
        losses.append(res.per_seq)
        accs.append(res.accuracy_per_seq)
        record.merge(iv.record)
        bar.update()
    return _Run(torch.cat(losses), torch.cat(accs), record, first)


def _row(setting: str, run: _Run, base: _Run, calib: Calibration, sinks: SinkSet, added: bool
         ) -> tuple[dict[str, Any], pd.DataFrame]:
    diff = run.per_seq - base.per_seq
    low, high = bootstrap_mean(diff)
    iv = run.intervention
    checks = downstream(base.record, run.record)
    read = reading(checks, label=iv.label, first_layer=calib.first_layer, massive_layers=calib.massive_layers,
                   removes=iv.removes, edits_massive=iv.edits_massive, uses_sinks=iv.uses_sinks)
    used = torch.cat(run.record.sinks) if run.record.sinks and iv.uses_sinks else None
    targets = torch.cat(run.record.targets) if run.record.targets and iv.edits_massive else None
    used_set = SinkSet(used, sinks.kinds, "used") if used is not None and used.shape == sinks.kinds.shape else None
    aimed = SinkSet(targets, sinks.kinds, "targets") if targets is not None and targets.shape == sinks.kinds.shape \
        else None
    row = dict(setting=setting, perplexity=math.exp(float(run.per_seq.mean())), ratio=math.exp(float(diff.mean())),
               ratio_low=math.exp(low), ratio_high=math.exp(high), accuracy=float(run.accuracy.mean()),
               n_seqs=len(base.per_seq), description=REGISTRY[setting].description, where=iv.where,
               acts_on=iv.acts_on,
               sinks_per_seq=float(used_set.per_seq.float().mean()) if used_set is not None else math.nan,
               sink_kinds=used_set.kinds_text if used_set is not None else "",
               targets_per_seq=float(targets.sum(-1).float().mean()) if targets is not None else math.nan,
               target_dims=", ".join(map(str, sorted(calib.first_layer))) if iv.edits_massive else "",
               edited_dims=", ".join(f"{d} ({n})" for d, n in sorted(run.record.edited.items())),
               target_kinds=aimed.kinds_text if aimed is not None else "",
               **{k: read[k] for k in ("target_kept", "peak_layer", "target_back", "back_layer", "sink_mass",
                                       "sink_mass_original", "rebuilt", "check")}, added=added)
    if setting == "original":  # the baseline itself: only what it measured (the sinks, their attention)
        row.update(target_kept=math.nan, peak_layer=math.nan, target_back=math.nan, back_layer=math.nan,
                   target_dims="", target_kinds="", check="original: untouched (the baseline of every check)")
    return row, checks.assign(setting=setting)


def outlier_line(calib: Calibration, frame: pd.DataFrame) -> str:
    """What the table did to the outlier dimensions, read from the entries each setting really
    edited (``edited_dims``), not from the choice it was asked to make."""
    outlier = set(calib.outlier_dims.tolist())
    by_dim: dict[int, list[str]] = {}
    for setting, edited in zip(frame["setting"], frame.get("edited_dims", pd.Series("", index=frame.index)),
                               strict=True):
        for item in filter(None, str(edited).split(", ")):
            dim = int(item.split(" ")[0])
            if dim in outlier:
                by_dim.setdefault(dim, []).append(setting)
    choice = "excluded" if calib.criterion.outliers == "exclude" else "included"
    head = f"outlier dimensions (massive at most tokens of a layer) {calib.outlier_text()}: {choice}"
    if not by_dim:
        return f"{head}: no setting edited an entry of them"
    done = "; ".join(f"dim {d} by {', '.join(names)}" for d, names in sorted(by_dim.items()))
    where = "" if choice == "included" else " (at layers where its entries are token-specific, see docs/detection.md)"
    return f"{head}; edited: {done}{where}"


def run_interventions(
    model: Any,
    corpus: Corpus | Tensor = None,
    *,
    calibration: Corpus | Calibration = None,
    settings: Sequence[str] = SETTINGS,
    seq_len: int = 128,
    n_seqs: int = 32,
    batch_size: int | None = None,
    calibration_seqs: int = 16,
    outliers: str = "exclude",
    progress: bool = True,
) -> InterventionTable:
    """Evaluate each intervention of ``settings`` on the same sequences of ``corpus``, and check each downstream.

    The sinks of every evaluation batch are found first (positions that draw attention as
    sinks or carry a persistent massive activation) and given to every setting. Each row
    records what its targets hold downstream with and without it; a massive-activation
    removal at the first layer that the model rebuilds later is flagged, and its ``_every``
    variant is evaluated and added as a row.

    Args:
        model: a TransformerLens-style model, or an nnsight model with the settings that edit
            the residual stream (``original``, ``zero``, ``mean``, ``resample``, ``noise``, ``control``
            and the ``_every`` forms; the attention on the sinks read from the kernel's log-sum-exp).
        corpus: the evaluation text (a file, text, ``hf:`` name, token tensor; None: the
            offline default text).
        calibration: where means are measured (a corpus, None for the offline default
            text, or a :class:`~massive_lens.interventions.Calibration`); must be other
            text than ``corpus`` (a sequence of both is refused).
        settings: names from :data:`~massive_lens.interventions.REGISTRY` (default: the
            paper's Table 3, :data:`~massive_lens.interventions.SETTINGS`); ``original`` is
            always evaluated, as the baseline of the ratios and the checks.
        seq_len: tokens per sequence (default 128), for text input (evaluation and
            calibration).
        n_seqs: evaluation sequences (default 32), for text input.
        batch_size: sequences per forward pass (default None: up to 8, as many as keep one
            pass's logits small against the weights, see
            :func:`~massive_lens.core.budget.logit_batches`).
        calibration_seqs: calibration sequences (default 16), for text input.
        outliers: whether the massive-activation edits may target outlier dimensions (dims
            massive at most tokens of a layer): ``"exclude"`` (default) or ``"include"``; for a
            corpus calibration (a :class:`Calibration` keeps the choice it was made with, in
            ``calibration.criterion.outliers``). Each row lists its targets either way
            (``target_dims``, ``target_kinds``).
        progress: show progress bars.

    Returns:
        An :class:`InterventionTable` (one row per setting, in the order of ``settings``,
        then any added ``_every`` rows).

    Raises:
        MassiveLensError: if ``settings`` is empty or names an unknown setting (or, on an
            nnsight model, a setting that acts on attention), a setting
            that edits massive activations (``zero``, ``mean``, ``control``) finds none in the
            calibration text, the calibration text shares a sequence with ``corpus``, or the
            model or a corpus is unusable (see :func:`~massive_lens.perplexity`).

    >>> from massive_lens import tiny_model
    >>> text = "The cat sat. A dog ran. " * 40
    >>> table = run_interventions(tiny_model("llama"), text, calibration=text[::-1], seq_len=16, n_seqs=2,
    ...                           settings=["original", "sink_attention_removed"], progress=False)
    >>> table.to_frame()[["setting", "sinks_per_seq", "sink_kinds"]].values.tolist()
    [['original', 1.0, 'bos 2'], ['sink_attention_removed', 1.0, 'bos 2']]
    """
    unknown = [s for s in settings if s not in REGISTRY]
    if unknown or not settings:
        raise MassiveLensError(f"unknown settings {unknown or settings}; choose from {tuple(REGISTRY)}")
    if batch_size is not None and batch_size < 1:
        raise MassiveLensError(f"batch_size must be >= 1, got {batch_size}")
    view = ModelView(model)
    if not view.serves_patterns:  # nnsight: the settings that edit the residual stream only
        refused = [s for s in settings if REGISTRY[s].acts_on == ATTN or REGISTRY[s].name not in NNSIGHT_SETTINGS]
        if refused:
            raise view.unsupported(f"the setting(s) {', '.join(refused)} of run_interventions (on nnsight it runs "
                                   f"the settings that edit the residual stream: {', '.join(NNSIGHT_SETTINGS)})")
    tokens = sequences(view, corpus, seq_len, n_seqs)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise MassiveLensError(f"token tensor must be [seq, pos] with pos >= 2, got {tuple(tokens.shape)}")
    if isinstance(calibration, Calibration):
        calib = calibrate(model, calibration)  # checked to be this model's
    else:
        calib_tokens = sequences(view, calibration, seq_len, calibration_seqs)
        _check_disjoint(tokens, calib_tokens)
        calib = replace(calibrate(model, calib_tokens, outliers=outliers, progress=progress),
                        source=describe_source(calibration))
    chunks = logit_batches(view.model, tokens, batch_size)  # the model itself, or nnsight's adapter
    order = list(dict.fromkeys(["original", *settings]))
    bar = tqdm(total=len(chunks) * (len(order) + 1), desc="interventions", disable=not progress, leave=False)
    found = []
    for chunk in chunks:
        found.append(sinks_of(view, view.full_batch(chunk), calib.rule, calib.criterion))
        bar.update()
    sinks = SinkSet(torch.cat([f.mask for f in found]), torch.cat([f.kinds for f in found]), found[0].source,
                    torch.cat([f.by_attention for f in found]), torch.cat([f.by_massive for f in found]))
    batches = [(chunk, f) for chunk, f in zip(chunks, found, strict=True)]  # the SinkSet: masks and token kinds
    runs = {s: _evaluate(model, s, calib, batches, bar) for s in order}
    bar.close()
    rows, checks = [], []
    for setting in order if "original" in settings else order[1:]:
        row, check = _row(setting, runs[setting], runs["original"], calib, sinks, added=False)
        rows.append(row)
        checks.append(check)
    for row in list(rows):
        extra = EVERY.get(row["setting"])
        if row["rebuilt"] and extra and extra not in runs:
            runs[extra] = _evaluate(model, extra, calib, batches, tqdm(disable=True))
            added, check = _row(extra, runs[extra], runs["original"], calib, sinks, added=True)
            rows.append(added)
            checks.append(check)
    return InterventionTable(frame=pd.DataFrame(rows), model_name=view.name, corpus=describe_source(corpus),
                             calibration_source=f"{calib.source}, {calib.n_seqs} sequences",
                             seq_len=int(tokens.shape[1]),
                             checks=pd.concat(checks, ignore_index=True) if checks else pd.DataFrame(), sinks=sinks,
                             calibration=calib)


def _check_disjoint(tokens: Tensor, calib_tokens: Tensor) -> None:
    """Refuse calibration text that repeats evaluation sequences (means fitted on the text
    they are judged on would flatter the interventions that use them)."""
    seen = {tuple(row) for row in tokens.tolist()}
    shared = sum(tuple(row) in seen for row in calib_tokens.tolist())
    if shared:
        raise MassiveLensError(
            f"the calibration text shares {shared} of its {len(calib_tokens)} sequences with the evaluation text "
            "(the same text or file, or both left at the default text); calibrate on other text, e.g. "
            "corpus='test.txt' with calibration='valid.txt'")
