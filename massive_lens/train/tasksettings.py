"""What one sink-task run is: :class:`TaskSettings` (task, attention variant, norm placement, model
shape and the schedule as a :class:`~massive_lens.train.presets.TrainConfig`), how ``result.json`` stores
them, and :func:`check_settings`, the one check every entry runs before anything is built or trained
(:mod:`massive_lens.train.taskrun` trains and records the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from massive_lens.errors import MassiveLensError
from massive_lens.train.layers import NORM_PLACEMENTS, MassiveLMConfig
from massive_lens.train.presets import TrainConfig
from massive_lens.train.tasks import make_task
from massive_lens.train.variants import VARIANTS

INITS = ("massive_lm", "torch")
STYLES = ("llama", "gpt2")


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


def model_config(settings: TaskSettings, task: Any) -> MassiveLMConfig:
    """The :class:`~massive_lens.train.layers.MassiveLMConfig` of a run on ``task``."""
    return MassiveLMConfig(n_layers=settings.n_layers, d_model=settings.d_model, n_heads=settings.n_heads,
                           n_ctx=task.seq_len + 1, d_vocab=task.n_tokens, attention=settings.variant,
                           norm=settings.norm, style=settings.style)


def check_settings(settings: TaskSettings) -> Any:
    """The one check of a run's settings, used by every entry (:func:`~massive_lens.train.taskrun.train_task`,
    :func:`~massive_lens.train.taskrun.build_model`, the grid, the command line, a run folder's stored
    settings): whole numbers where counts are meant (steps, sizes, seed), finite rates in their ranges, a
    known task with valid options, variant, norm placement, style and init. Nothing is built or trained.

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
