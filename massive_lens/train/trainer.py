"""Pretraining a :class:`MassiveLM` from scratch, small enough to run anywhere.

The loop is deliberately plain (nanoGPT style): AdamW with decoupled weight decay on
matrices only, linear warmup then cosine decay to ``min_lr_ratio * lr``, gradient
clipping, bf16 autocast on GPU, and data parallelism under ``torchrun`` (gloo on CPU,
NCCL on GPU). Two properties matter for science:

* **Identical data order.** Batch ``i`` is a pure function of ``(seed, i)``, so every
  attention variant trained with the same seed sees exactly the same sequences, and a
  resumed run sees what the uninterrupted one would have.
* **Every run survives an interruption.** Checkpoints are written to a temporary file
  and renamed into place; calling :func:`train_model` again with the same ``out_dir``
  resumes from the last checkpoint and reaches the same loss.

Every step is also recorded (:mod:`massive_lens.train.recorder`: loss, gradient norm, the
largest residual |activation| and its ratio to the median, attention on the first token) from
hooks on the training pass itself; :mod:`massive_lens.train.stability` finds the loss spikes in it.

Each training sequence starts with BOS (as ``to_tokens`` does), so a first-token sink
can form exactly where analyses look for it; ``prepend_bos=False`` trains on bare windows
(as nanoGPT does), so the first token is arbitrary.

>>> run = train_model("smoke", steps=3, progress=False, data="One. Two. Three. " * 200)
>>> run.steps, len(run.history) > 0
(3, True)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from massive_lens.core.charts import curve_axes
from massive_lens.core.outputs import check_out_dir
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.train.checkpoint import (
    CKPT,
    LEGACY,
    read_checkpoint,
    resume_from,
    save_checkpoint,
    save_interrupted,
    updates_applied,
)
from massive_lens.train.data import (
    Stream,
    get_tokenizer,
    split_held_out,
    start_token,
    token_stream,
)
from massive_lens.train.ddp import setup_distributed, wrap_ddp
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.loop import TrainLoop
from massive_lens.train.model import MassiveLM
from massive_lens.train.presets import TrainConfig, get_preset
from massive_lens.train.recorder import StepRecorder

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainRun(Result):
    """A finished (or stopped) run: the model, its logged history and where it lives.

    ``history``: one row every ``log_every`` steps (:meth:`to_frame`); ``per_step``: one row per
    step with the :data:`~massive_lens.train.recorder.STEP_COLUMNS` (empty with ``record=False``).

    ``save(path)`` stores the model's config and weights with the rest; ``massive_lens.load``
    rebuilds the :class:`MassiveLM` on the CPU (with the run's tokenizer, ``config.tokenizer``).
    """

    model: MassiveLM
    config: TrainConfig
    history: list[dict[str, Any]] = field(default_factory=list)
    steps: int  # the steps run (required: a default would read as a measurement)
    out_dir: str | None = None
    per_step: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def final_loss(self) -> float:
        """Last logged training loss."""
        return self.history[-1]["loss"] if self.history else float("nan")

    @property
    def val_loss(self) -> float:
        """Last held-out loss (``nan`` if never evaluated)."""
        vals = [row["val_loss"] for row in self.history if not math.isnan(row["val_loss"])]
        return vals[-1] if vals else float("nan")

    def to_frame(self) -> pd.DataFrame:
        """Columns: step, tokens, loss, val_loss, lr, grad_norm, tokens_per_s, elapsed_s."""
        return pd.DataFrame(self.history)

    def summary(self) -> str:
        attn = self.model.cfg.attention.name
        return (
            f"MassiveLM ({attn}, {self.model.cfg.n_layers} layers, d_model "
            f"{self.model.cfg.d_model}) trained {self.steps} steps: train loss "
            f"{self.final_loss:.3f}, held-out loss {self.val_loss:.3f}"
        )

    def plot(self, ax: Any = None) -> Any:
        """Training and held-out loss over steps."""
        return curve_axes(self.to_frame(), ax=ax, title=f"MassiveLM ({self.model.cfg.attention.name})")

    def _stored_fields(self) -> dict[str, Any]:
        """``save`` stores the model as its config and weights (``model.config``, ``model.state``)."""
        model = {"config": self.model.cfg.to_dict(), "state": self.model.state_dict()}
        return {**super()._stored_fields(), "model": model}

    @classmethod
    def _from_stored(cls, fields: dict[str, Any]) -> TrainRun:
        """The run back from a saved one: the MassiveLM rebuilt on the CPU, in eval mode."""
        saved = fields["model"]
        model_cfg = MassiveLMConfig.from_dict({**saved["config"], "device": "cpu"})
        tokenizer = get_tokenizer(fields["config"].tokenizer)
        with torch.device("meta"):  # the shapes the config asks for, before any memory is taken
            wanted = {k: tuple(v.shape) for k, v in MassiveLM(model_cfg, tokenizer).state_dict().items()}
        held = {k: tuple(v.shape) for k, v in saved["state"].items()}
        if wanted != held:
            differ = sorted(k for k in wanted.keys() | held.keys() if wanted.get(k) != held.get(k))
            raise MassiveLensError(f"the saved run's model config does not match its stored weights ({len(differ)} "
                                   f"tensors differ, e.g. {differ[:3]}): the saved result is damaged")
        model = MassiveLM(model_cfg, tokenizer).to(model_cfg.dtype)
        model.load_state_dict(saved["state"])
        return super()._from_stored({**fields, "model": model.eval()})


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases, slots or sink logits)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def train_model(
    preset: str | TrainConfig = "smoke",
    *,
    out_dir: str | os.PathLike | None = None,
    resume: bool = True,
    progress: bool = True,
    until_step: int | None = None,
    device: str | None = None,
    attention: Any = None,
    record: bool = True,
    **overrides: Any,
) -> TrainRun:
    """Train a MassiveLM with a preset (plus ``TrainConfig`` field overrides).

    ``out_dir`` holds ``checkpoint.safetensors``, ``log.csv`` and ``run.json``; with ``resume``
    an existing checkpoint there is continued. ``until_step`` stops early (the schedule
    still targets ``steps``), as an interruption would. ``attention`` picks the variant
    (a name or VariantConfig). Run under ``torchrun`` for DDP.

    Args:
        preset: a preset name from :data:`~massive_lens.train.PRESETS` (default
            ``"smoke"``) or a :class:`~massive_lens.train.TrainConfig`.
        out_dir: the folder for ``checkpoint.safetensors``, ``log.csv`` and ``run.json``, written
            every ``ckpt_every`` steps, at the end and on ``KeyboardInterrupt`` (None: nothing
            is written).
        resume: continue from the checkpoint in ``out_dir`` if there is one (default);
            False starts over and overwrites it.
        progress: show a progress bar.
        until_step: stop after this many steps (None: ``steps``).
        device: ``"cpu"``, ``"cuda"`` or another torch device string (None: the local GPU
            if there is one, else the CPU).
        attention: the attention variant (a name, a dict of ``VariantConfig`` fields or a
            ``VariantConfig``); None keeps the preset's (``softmax`` unless it says otherwise).
        record: record every step (:attr:`TrainRun.per_step`, ``steps.parquet`` in ``out_dir``);
            it does not change the training numbers and costs a few percent of a step's time.
        **overrides: :class:`~massive_lens.train.TrainConfig` fields to replace
            (``model=`` dicts are merged into the preset's).

    Returns:
        A :class:`TrainRun` with the trained model (in eval mode) and its logged history.

    Raises:
        MassiveLensError: for an unknown preset, an invalid override or attention variant,
            data too short for the context, a micro-batch not divisible by the DDP ranks, an
            ``out_dir`` that cannot be written (checked before training), or a checkpoint in
            ``out_dir`` that is damaged or made with another configuration. A Ctrl-C saves a
            checkpoint labelled with the updates the optimizer applied, then re-raises.

    >>> train_model("smoke", steps=2, progress=False, data="a. b. " * 500).steps
    2
    """
    if attention is not None:
        overrides["model"] = {**overrides.get("model", {}), "attention": attention}
    cfg = get_preset(preset, **overrides)
    out = check_out_dir(out_dir)  # an unwritable folder fails now, not after training
    rank, world, dev = setup_distributed(device)
    tokenizer = get_tokenizer(cfg.tokenizer)
    stream = token_stream(cfg.data, tokenizer, cfg.max_chars)  # before the model: bad data fails fast
    model, optimizer = _build(cfg, tokenizer, dev)
    start, history, per_step = 0, [], []
    if out is not None and resume and ((out / CKPT).is_file() or (out / LEGACY).is_file()):
        start, history, per_step = resume_from(out / CKPT, model, optimizer, cfg.to_dict(), TrainConfig().to_dict())
    train, val = _split(cfg, stream, model.cfg.n_ctx, world)
    recorder = StepRecorder(model) if record else None
    loop = TrainLoop(cfg, model, optimizer, wrap_ddp(model, world, dev), train, start_token(tokenizer, cfg.prepend_bos),
                     _autocast(cfg, dev), rank, world, dev, recorder, per_step)
    stop = min(cfg.steps, until_step if until_step is not None else cfg.steps)
    bar = tqdm(total=stop, initial=start, disable=not progress or rank != 0, desc="train")
    applied_at_start = updates_applied(optimizer)  # the checkpointed step is read from the optimizer
    try:
        with recorder or contextlib.nullcontext():
            for step in range(start, stop):
                loop.step(step, history, val, stop, bar)
                if out is not None and rank == 0 and (step + 1 == stop or (step + 1) % cfg.ckpt_every == 0):
                    save_checkpoint(out, model, optimizer, cfg.to_dict(), step + 1, history, per_step)
    except KeyboardInterrupt:
        if out is not None and rank == 0:
            save_interrupted(out, model, optimizer, cfg.to_dict(), start, applied_at_start, history, per_step)
        raise
    finally:
        bar.close()
    model.eval()
    return TrainRun(model=model, config=cfg, history=history, steps=max(stop, start),
                    out_dir=None if out is None else str(out), per_step=pd.DataFrame(per_step))


def _build(cfg: TrainConfig, tokenizer: Any, dev: torch.device) -> tuple[MassiveLM, Any]:
    """The model, initialised from the run's seed (the global RNG left as it was), and its optimizer.
    The variant's own parameters (slot keys and values, gates) are drawn from the seed too, so
    two runs with one seed start alike whatever ran before them in the process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = MassiveLM(_model_config(cfg, tokenizer, dev), tokenizer)
        torch.manual_seed(cfg.seed)
        model._init_weights()
    model.to(dev)
    return model, make_optimizer(model, cfg)


def _split(cfg: TrainConfig, stream: Stream, n_ctx: int, world: int) -> tuple[Stream, Stream]:
    """Training and held-out streams; data too short for the context is an error."""
    train, val = split_held_out(stream, n_ctx, cfg.val_fraction)
    if len(train) < 2 * n_ctx:
        raise MassiveLensError(
            f"the data {cfg.data!r} has {len(stream)} tokens, too few for n_ctx={n_ctx}; "
            "give more text or a smaller n_ctx"
        )
    if (cfg.batch_size // cfg.grad_accum) % world:
        raise MassiveLensError(f"micro-batch {cfg.batch_size // cfg.grad_accum} is not divisible by {world} DDP ranks")
    return train, val


def _autocast(cfg: TrainConfig, dev: torch.device) -> Any:
    """bf16 autocast on a GPU when the config asks for it; nothing otherwise."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if cfg.amp and dev.type == "cuda" \
        else contextlib.nullcontext()


def load_run(out_dir: str | os.PathLike, device: str | None = None) -> MassiveLM:
    """Rebuild the trained model from ``out_dir/checkpoint.safetensors``.

    Args:
        out_dir: the ``out_dir`` of a :func:`train_model` run.
        device: where to put the model (None: the CPU).

    Returns:
        The :class:`~massive_lens.train.MassiveLM` with the checkpoint's weights, in eval mode.

    Raises:
        MassiveLensError: if ``out_dir`` holds no ``checkpoint.safetensors``.
    """
    path = Path(out_dir) / CKPT
    if not path.is_file() and not (Path(out_dir) / LEGACY).is_file():
        raise MassiveLensError(f"no checkpoint at {path}; train with train_model(out_dir=...) first")
    state = read_checkpoint(path)
    cfg = TrainConfig(**state["config"])
    tokenizer = get_tokenizer(cfg.tokenizer)
    model = MassiveLM(MassiveLMConfig.from_dict(state["model_cfg"]), tokenizer)
    model.load_state_dict(state["model"])
    return model.to(device or "cpu").eval()


# --------------------------------------------------------------------------- internals


def _model_config(cfg: TrainConfig, tokenizer: Any, dev: torch.device) -> MassiveLMConfig:
    fields = {"d_vocab": len(tokenizer), "default_prepend_bos": cfg.prepend_bos, **cfg.model, "device": str(dev)}
    return MassiveLMConfig(**fields)


def run_and_exit(preset: str, out_dir: str, overrides: dict[str, Any]) -> None:
    """What ``massive-lens train`` runs (also under ``torchrun``): train, then end the process.

    Every rank waits for the others before teardown, the process group is destroyed, and the
    interpreter exits without its teardown (gloo's threads can abort it: "terminate called
    without an active exception"); checkpoints are already renamed into place by then.
    """
    try:
        train_model(preset, out_dir=out_dir, progress=False, **overrides)
        if dist.is_initialized():
            dist.barrier()  # no rank tears down while another still saves or evaluates
    finally:  # shut gloo/nccl down cleanly: exiting with live process-group threads can abort
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
