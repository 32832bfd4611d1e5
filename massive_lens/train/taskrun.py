"""Train a :class:`MassiveLM` on a sink-forcing task (:mod:`massive_lens.train.tasks`) and record,
at every evaluation step, what the papers on sinks look at.

At step 0, every ``eval_every`` steps and at the last step, one pass over a fixed held-out batch
(the same for every run) records

* per head (``heads.parquet``: step, layer, head): ``sink_mass``, the attention weight on the first
  token (BOS) averaged over queries 1.. (what ``hook_pattern[..., 0]`` shows; for ``relu`` the weight
  ``relu(s_0) / n``); ``max_logit``, the largest attention logit (the quantity QK-Clip bounds);
  ``value_norm_first``, the first token's value-vector norm and ``value_ratio``, that over the
  median of the other positions' (the value-state drain, Guo et al.);
* per step (``evals.parquet``): ``loss`` and the task's ``accuracy`` (``accuracy_trigger``,
  ``accuracy_other``); ``sink_mass`` (the largest over heads, and its layer and head);
  ``value_ratio`` at that head; ``resid_ratio``, the first token's largest residual |activation|
  over the median |activation| of the layer over the batch (Sun et al.'s top-1 / median, read off the first
  token with :func:`massive_lens.core.stats.top1_median`) and
  ``resid_norm_ratio``, the first token's residual norm over the median position's, both the
  largest over layers (``hook_resid_post``).

At the end (``result.json``): the last record, ``sink_step`` (the first evaluation step whose
``sink_mass`` exceeds the package's sink threshold, :data:`massive_lens.core.criterion.SINK_THRESHOLD`,
Gu et al.'s 0.3; NaN if none), and the W8A8 / W4A4 gaps in task loss
and accuracy under :func:`massive_lens.quant.fake_quantized` (per-channel weights, dynamic
per-token activations, the unembedding kept in full precision). ``result.json`` is written last,
so its presence marks a finished run.

>>> run = train_task(TaskSettings.of("bigram_backcopy", steps=2, eval_every=1, eval_seqs=2, batch_size=2,
...                                  d_model=16, n_heads=2, task_options=dict(seq_len=8, n_vocab=8)))
>>> run.evals["step"].tolist(), sorted(run.result)[:3]
([0, 1, 2], ['accuracy', 'accuracy_other', 'accuracy_trigger'])
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from massive_lens.core.criterion import SINK_THRESHOLD, first_norm_ratio
from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import MEDIAN_FLOOR, top1_median
from massive_lens.errors import MassiveLensError
from massive_lens.quant import fake_quantized
from massive_lens.train.layers import NORM_PLACEMENTS, MassiveLMConfig
from massive_lens.train.model import MassiveLM
from massive_lens.train.presets import TrainConfig
from massive_lens.train.tasks import TaskBatch, make_task
from massive_lens.train.trainer import lr_at, make_optimizer
from massive_lens.train.variants import VARIANTS

RESULT = "result.json"
# the version of the definitions of the derived fields (head_summary, sink_step with SINK_THRESHOLD,
# derived_fields): records carry the one they were written with, and readers recompute or refuse older ones.
# 0: records written before it existed (their sink_step may use a threshold other than 0.3)
DEFINITIONS_VERSION = 1
DERIVED_EVALS = ("sink_mass", "sink_layer", "sink_head", "value_ratio", "max_logit")  # read off heads.parquet
INITS = ("massive_lm", "torch")
STYLES = ("llama", "gpt2")
# fan-in of each matrix from its shape: [in, out], W_Q/K/V [head, d_model, d_head], W_O [head, d_head, d_model]
_FAN_IN = {"W_Q": lambda s: s[1], "W_K": lambda s: s[1], "W_V": lambda s: s[1], "W_O": lambda s: s[0] * s[1],
           "W_in": lambda s: s[0], "W_gate": lambda s: s[0], "W_out": lambda s: s[0], "W_U": lambda s: s[0]}
_HOOKS = ("hook_pattern", "hook_attn_scores", "hook_v", "hook_resid_post")


# the knobs of TrainConfig (massive_lens.train.presets) a task run reads: its seed, schedule and optimizer;
# the others (data, model, ...) are the text trainer's and stay at their defaults
TRAIN_KNOBS = ("seed", "steps", "batch_size", "lr", "warmup_steps", "weight_decay", "eval_every", "min_lr_ratio",
               "beta1", "beta2", "grad_clip")
TASK_TRAIN = TrainConfig(steps=600, batch_size=32, warmup_steps=30)  # a task run's schedule by default
# how result.json stores the settings: 1 (no "format" field) flat, TRAIN_KNOBS beside the task's own
# fields; 2 the task's own fields and TRAIN_KNOBS under "train". Both are read.
SETTINGS_FORMAT = 2


@dataclass(frozen=True)
class TaskSettings:
    """One run: task, attention variant, norm placement, model shape and ``train``, the seed, schedule and
    optimizer as a :class:`~massive_lens.train.presets.TrainConfig` (its :data:`TRAIN_KNOBS`; default
    :data:`TASK_TRAIN`). JSON-able (:meth:`to_dict`, :meth:`from_dict`); :meth:`of` takes the knobs flat.

    ``style`` is :class:`~massive_lens.train.layers.MassiveLMConfig`'s (``"llama"``: RMSNorm, rotary,
    SwiGLU; ``"gpt2"``: LayerNorm, learned positions, GELU); the schedule is linear warmup then cosine
    decay to ``min_lr_ratio * lr`` (1: constant), AdamW with ``beta1``, ``beta2``, gradients clipped at
    ``grad_clip`` (0: not clipped). ``init`` ``"torch"`` redraws the weights as PyTorch's layers would
    (embeddings N(0, 1), matrices uniform within 1/sqrt(fan-in)), the init of Guo et al.'s code;
    ``"massive_lm"`` keeps MassiveLM's N(0, 0.02).

    >>> s = TaskSettings.of("bigram_backcopy", steps=20, d_model=16)
    >>> s.train.steps, s.d_model, TaskSettings.from_dict(s.to_dict()) == s
    (20, 16, True)
    """

    task: str
    variant: str = "softmax"
    norm: str = "pre"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    eval_seqs: int = 64
    task_options: dict = field(default_factory=dict)
    style: str = "llama"
    init: str = "massive_lm"
    train: TrainConfig = TASK_TRAIN

    @property
    def name(self) -> str:
        """The setting's folder name, ``<variant>-<norm>``."""
        return f"{self.variant}-{self.norm}"

    @classmethod
    def of(cls, task: str, **knobs: Any) -> TaskSettings:
        """Settings from flat knobs: this class's fields and :data:`TRAIN_KNOBS` (set on :data:`TASK_TRAIN`).

        Args:
            task: the task's name (one of :data:`~massive_lens.train.tasks.TASKS`).
            **knobs: this class's other fields and any of :data:`TRAIN_KNOBS`, flat.

        Returns:
            The settings, the training knobs held once, in ``train``.

        Raises:
            MassiveLensError: a knob that is neither a field nor a training knob, or a bad count or rate.

        >>> TaskSettings.of("trigger_conditional", seed=3).train.seed
        3
        """
        schedule = {k: knobs.pop(k) for k in TRAIN_KNOBS if k in knobs}
        unknown = sorted(set(knobs) - {f.name for f in fields(cls)} | ({"train"} & set(knobs)))
        if unknown:
            raise MassiveLensError(f"sink-task settings with unknown fields {unknown}; the fields are "
                                   f"{[f.name for f in fields(cls) if f.name != 'train'] + list(TRAIN_KNOBS)}")
        bad = _bad_values(schedule)  # check_settings' words, before TrainConfig's own check
        if bad:
            raise MassiveLensError(f"bad sink-task settings: {'; '.join(bad)}")
        return cls(task, **knobs, train=replace(TASK_TRAIN, **schedule))

    def to_dict(self) -> dict[str, Any]:
        """The settings as ``result.json`` stores them (:data:`SETTINGS_FORMAT`)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train"}
        return {"format": SETTINGS_FORMAT, **own, "train": {k: getattr(self.train, k) for k in TRAIN_KNOBS}}

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> TaskSettings:
        """Settings as :meth:`to_dict` wrote them, or flat as records before :data:`SETTINGS_FORMAT` 2 did.

        Args:
            stored: the ``settings`` of a ``result.json``.

        Returns:
            The settings.

        Raises:
            MassiveLensError: not a dict naming a task, an unknown format or an unknown field.

        >>> s = TaskSettings.of("trigger_conditional", seed=3)
        >>> TaskSettings.from_dict(s.to_dict()) == s
        True
        """
        if not isinstance(stored, dict) or "task" not in stored:
            raise MassiveLensError(f"sink-task settings must be a dict naming a task, got {stored!r}")
        raw = dict(stored)
        version = raw.pop("format", 1)
        if version not in (1, SETTINGS_FORMAT) or isinstance(version, bool):
            raise MassiveLensError(f"unknown settings format {version!r} (this massive_lens reads 1 and "
                                   f"{SETTINGS_FORMAT}): upgrade massive_lens to read it")
        if version == SETTINGS_FORMAT:
            train = raw.pop("train", {})
            if not isinstance(train, dict) or set(train) - set(TRAIN_KNOBS):
                raise MassiveLensError(f"settings' train must be a dict of {list(TRAIN_KNOBS)}, got {train!r}")
            raw.update(train)
        return cls.of(**raw)


@dataclass(frozen=True)
class TaskRun:
    """A finished run: the model (eval mode), its records and its end-of-run result."""

    model: MassiveLM
    settings: TaskSettings
    evals: pd.DataFrame
    heads: pd.DataFrame
    result: dict[str, Any]


def build_model(settings: TaskSettings) -> MassiveLM:
    """The run's model, initialised from its seed (the global RNG left as it was); the settings are
    checked first (:func:`check_settings`)."""
    task = check_settings(settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.train.seed)
        model = MassiveLM(model_config(settings, task), task.tokenizer())
        if settings.init == "torch":
            torch_init(model)
        return model


def model_config(settings: TaskSettings, task: Any) -> MassiveLMConfig:
    """The :class:`~massive_lens.train.layers.MassiveLMConfig` of a run on ``task``."""
    return MassiveLMConfig(n_layers=settings.n_layers, d_model=settings.d_model, n_heads=settings.n_heads,
                           n_ctx=task.seq_len + 1, d_vocab=task.n_tokens, attention=settings.variant,
                           norm=settings.norm, style=settings.style)


@torch.no_grad()
def torch_init(model: MassiveLM) -> None:
    """Redraw ``model``'s embeddings from N(0, 1) and its matrices uniformly within 1/sqrt(fan-in), as
    ``nn.Embedding`` and ``nn.Linear`` start (biases, norms and variant parameters are left as they are)."""
    for name, p in model.named_parameters():
        kind = name.split(".")[-1]
        if kind in ("W_E", "W_pos"):
            torch.nn.init.normal_(p)
        elif kind in _FAN_IN:
            bound = 1 / math.sqrt(_FAN_IN[kind](p.shape))
            torch.nn.init.uniform_(p, -bound, bound)


def train_task(settings: TaskSettings, out_dir: str | os.PathLike | None = None) -> TaskRun:
    """Train one run and record it (module docstring); with ``out_dir``, write its three files there.

    Args:
        settings: the run.
        out_dir: the run's folder (None: nothing is written).

    Returns:
        A :class:`TaskRun`.

    Raises:
        MassiveLensError: for an unknown task, variant or norm placement, or bad task options.
    """
    task = check_settings(settings)
    model = build_model(settings)
    schedule = settings.train
    optimizer = make_optimizer(model, schedule)
    held_out = task.sample(settings.eval_seqs, seed=-1, step=0)
    evals, heads, t0 = [], [], time.perf_counter()
    model.train()
    for step in range(schedule.steps + 1):
        if step % schedule.eval_every == 0 or step == schedule.steps:
            row, per_head = evaluate(model, task, held_out)
            evals.append(dict(step=step, **row))
            heads += [dict(step=step, **h) for h in per_head]
        if step == schedule.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(schedule, step)
        batch = task.sample(schedule.batch_size, schedule.seed, step)
        loss = task.loss(model(batch.tokens), batch)
        loss.backward()
        if schedule.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    seconds = time.perf_counter() - t0
    evals_frame, heads_frame = pd.DataFrame(evals), pd.DataFrame(heads)
    result = {**derived_fields(evals_frame), **lowbit_gaps(model, task, held_out), "seconds": seconds,
              "settings": settings.to_dict()}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        evals_frame.to_parquet(out / "evals.parquet", index=False)
        heads_frame.to_parquet(out / "heads.parquet", index=False)
        tmp = out / (RESULT + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        os.replace(tmp, out / RESULT)
    return TaskRun(model, settings, evals_frame, heads_frame, result)


def sink_step(evals: pd.DataFrame, threshold: float = SINK_THRESHOLD) -> float:
    """The first evaluation step whose ``sink_mass`` exceeds ``threshold`` (NaN if none)."""
    hit = evals.sort_values("step").loc[lambda f: f["sink_mass"] > threshold, "step"]
    return float(hit.iloc[0]) if len(hit) else math.nan


def head_summary(heads: pd.DataFrame) -> pd.DataFrame:
    """The evaluation record's columns read off its per-head rows, one row per ``step`` (the index):
    ``sink_mass`` (the largest head's; among equal heads the first in layer, head order), its ``sink_layer``,
    ``sink_head`` and ``value_ratio``, and ``max_logit`` (the largest over heads). A definition: changing it
    raises :data:`DEFINITIONS_VERSION`.

    >>> heads = pd.DataFrame(dict(step=0, layer=[0, 0, 1], head=[0, 1, 0], sink_mass=[0.2, 0.5, 0.5],
    ...                           max_logit=[3.0, 1.0, 2.0], value_ratio=[1.0, 0.5, 0.25]))
    >>> head_summary(heads).iloc[0].tolist()
    [0.5, 0.0, 1.0, 0.5, 3.0]
    """
    ordered = heads.sort_values(["step", "layer", "head"], kind="stable").reset_index(drop=True)
    top = ordered.loc[ordered.groupby("step")["sink_mass"].idxmax()].set_index("step")
    out = top[["sink_mass", "layer", "head", "value_ratio"]].set_axis(list(DERIVED_EVALS[:4]), axis=1)
    return out.assign(max_logit=ordered.groupby("step")["max_logit"].max())


def derive_evals(evals: pd.DataFrame, heads: pd.DataFrame) -> pd.DataFrame:
    """``evals`` with its :data:`DERIVED_EVALS` columns recomputed from ``heads`` (:func:`head_summary`)."""
    summary = head_summary(heads).reindex(evals["step"].to_numpy())
    return evals.assign(**{c: summary[c].to_numpy() for c in DERIVED_EVALS})


def derived_fields(evals: pd.DataFrame) -> dict[str, Any]:
    """The derived fields of ``result.json``: the last evaluation's values, ``sink_step`` (:func:`sink_step`)
    and ``definitions``, the :data:`DEFINITIONS_VERSION` they follow."""
    last = evals.sort_values("step").iloc[-1:]
    return {**{c: last[c].iloc[0].item() for c in evals}, "sink_step": sink_step(evals),
            "definitions": DEFINITIONS_VERSION}


@torch.no_grad()
def evaluate(model: MassiveLM, task: Any, batch: TaskBatch) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One held-out pass: the step's summary row and one row per (layer, head) (module docstring)."""
    was_training = model.training
    model.eval()
    try:
        logits, cache = model.run_with_cache(batch.tokens, names_filter=lambda n: n.endswith(_HOOKS))
    finally:
        model.train(was_training)
    per_head, resid_ratio, norm_ratio = [], 0.0, 0.0
    for layer in range(model.cfg.n_layers):
        pattern = cache[ModelView.block_hook(layer, "attn.hook_pattern")][:, :, 1:, 0].mean((0, 2))
        scores = cache[ModelView.block_hook(layer, "attn.hook_attn_scores")]
        top_logit = scores.masked_fill(~torch.isfinite(scores), -math.inf).amax((0, 2, 3))
        v_norm = cache[ModelView.block_hook(layer, "attn.hook_v")].norm(dim=-1)  # [batch, pos, kv_head]
        v_norm = v_norm.repeat_interleave(model.cfg.n_heads // v_norm.shape[-1], -1)
        v_first, v_rest = v_norm[:, 0].mean(0), v_norm[:, 1:].median(1).values.mean(0)
        for head in range(model.cfg.n_heads):
            per_head.append(dict(layer=layer, head=head, sink_mass=float(pattern[head]),
                                 max_logit=float(top_logit[head]), value_norm_first=float(v_first[head]),
                                 value_ratio=float(v_first[head] / v_rest[head].clamp(min=1e-12))))
        x = cache[ModelView.block_hook(layer, "resid_post")].float()
        first_top = top1_median(x[:, :1].abs())[0].mean()  # the first token's largest |activation|, batch mean
        median = top1_median(x.abs().flatten(0, 1)[None])[1]  # the median |activation| over the whole batch
        resid_ratio = max(resid_ratio, float(first_top / median.clamp(min=MEDIAN_FLOOR)))
        norm_ratio = max(norm_ratio, float(first_norm_ratio(x.norm(dim=-1)).mean()))
    top = head_summary(pd.DataFrame(per_head).assign(step=0))
    row = dict(loss=float(task.loss(logits, batch)), **task.accuracy(logits, batch),
               **{c: top[c].iloc[0].item() for c in DERIVED_EVALS}, resid_ratio=resid_ratio,
               resid_norm_ratio=norm_ratio)
    return row, per_head


@torch.no_grad()
def lowbit_gaps(model: MassiveLM, task: Any, batch: TaskBatch) -> dict[str, float]:
    """Task loss and accuracy under W8A8 and W4A4 (per-token activations), minus full precision's."""
    full = model(batch.tokens)
    base_loss, base_acc = float(task.loss(full, batch)), task.accuracy(full, batch)["accuracy"]
    out = {}
    for w, a in ((8, 8), (4, 4)):
        with fake_quantized(model, w_bits=w, a_bits=a, per_token=True):
            logits = model(batch.tokens)
        out[f"w{w}a{a}_gap"] = float(task.loss(logits, batch)) - base_loss
        out[f"w{w}a{a}_acc_gap"] = task.accuracy(logits, batch)["accuracy"] - base_acc
    return out


def check_settings(settings: TaskSettings) -> Any:
    """The one check of a run's settings, used by every entry (:func:`train_task`, :func:`build_model`, the
    grid, the command line, a run folder's stored settings): whole numbers where counts are meant (steps,
    sizes, seed), finite rates in their ranges, a known task with valid options, variant, norm placement,
    style and init. Nothing is built or trained.

    Args:
        settings: the run.

    Returns:
        The run's task (:func:`~massive_lens.train.tasks.make_task`).

    Raises:
        MassiveLensError: naming every bad field and what it must be.

    >>> check_settings(TaskSettings.of("bigram_backcopy", eval_seqs=0))
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: bad sink-task settings: eval_seqs=0 (a whole number >= 1)
    """
    if not isinstance(settings, TaskSettings):
        raise MassiveLensError(f"expected TaskSettings, got {type(settings).__name__}")
    if not isinstance(settings.train, TrainConfig):
        raise MassiveLensError(f"bad sink-task settings: train={settings.train!r} (a TrainConfig; "
                               "TaskSettings.of takes its knobs flat)")
    unused = [f"train.{f.name}={getattr(settings.train, f.name)!r}" for f in fields(TrainConfig)
              if f.name not in TRAIN_KNOBS and getattr(settings.train, f.name) != getattr(TASK_TRAIN, f.name)]
    bad = [f"{', '.join(unused)} (a task run reads only {', '.join(TRAIN_KNOBS)} of TrainConfig: leave the "
           "others at their defaults)"] if unused else []
    bad += _bad_values({k: _knob(settings, k) for k in (*_COUNTS, *_RATES)})
    for k, choices in (("variant", VARIANTS), ("norm", NORM_PLACEMENTS), ("style", STYLES), ("init", INITS)):
        if getattr(settings, k) not in choices:
            bad.append(f"{k}={getattr(settings, k)!r} (one of {', '.join(choices)})")
    if not isinstance(settings.task_options, dict) or not all(isinstance(k, str) for k in settings.task_options):
        bad.append(f"task_options={settings.task_options!r} (a dict of the task's options by name)")
    if bad:
        raise MassiveLensError(f"bad sink-task settings: {'; '.join(bad)}")
    task = make_task(settings.task, **settings.task_options)
    model_config(settings, task)  # d_model divisible by n_heads
    return task


def _bad_values(values: dict[str, Any]) -> list[str]:
    """What is wrong with each of ``values`` that is a count (:data:`_COUNTS`) or a rate (:data:`_RATES`)."""
    bad = [f"{k}={values[k]!r} (a whole number >= {low})" for k, low in _COUNTS.items()
           if k in values and not _whole(values[k], low)]
    for k, (low, high, low_open, high_open) in ((k, r) for k, r in _RATES.items() if k in values):
        v = values[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (v <= low if low_open else v < low) or (v >= high if high_open else v > high):
            span = f"> {low:g}" if high == math.inf and low_open else ">= 0" if high == math.inf else \
                f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            bad.append(f"{k}={v!r} (a finite number {span})")
    return bad


def _knob(settings: TaskSettings, name: str) -> Any:
    return getattr(settings.train if name in TRAIN_KNOBS else settings, name)


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# the settings' whole numbers and their minimum; their rates as (low, high, low open, high open)
_COUNTS = dict(seed=0, steps=1, batch_size=1, warmup_steps=0, n_layers=1, d_model=1, n_heads=1, eval_every=1,
               eval_seqs=1)
_RATES = dict(lr=(0, math.inf, True, False), weight_decay=(0, math.inf, False, False),
              min_lr_ratio=(0, 1, False, False), beta1=(0, 1, False, True), beta2=(0, 1, False, True),
              grad_clip=(0, math.inf, False, False))
