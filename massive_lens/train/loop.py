"""One training step at a time (:class:`TrainLoop`): the learning rate of the schedule
(:func:`lr_at`), the batch, the micro-batches' forward and backward passes, clipping, the update,
and the history row with the held-out loss when one is due. :func:`~massive_lens.train.trainer.train_model`
builds the loop and runs it, saving checkpoints between steps.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from massive_lens.train.checkpoint import interrupt_after
from massive_lens.train.data import Stream, sample_batch
from massive_lens.train.ddp import mean_over_ranks
from massive_lens.train.model import MassiveLM
from massive_lens.train.presets import TrainConfig
from massive_lens.train.recorder import StepRecorder


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainLoop:
    """One training step at a time: the batch, the micro-batches' forward and backward passes
    (DDP-synchronised on the last), clipping, the update, and the history row when one is due."""

    cfg: TrainConfig
    model: MassiveLM
    optimizer: Any
    wrapped: Any
    train: Stream
    bos: int | None
    amp: Any
    rank: int
    world: int
    dev: torch.device
    recorder: StepRecorder | None
    per_step: list
    t0: float = field(default_factory=time.perf_counter)
    tokens_seen: int = 0

    def step(self, step: int, history: list, val: Stream, stop: int, bar: Any) -> None:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        batch = sample_batch(self.train, cfg.batch_size, self.model.cfg.n_ctx, self.bos, cfg.seed, step)
        loss_sum = self._gradients(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf)  # 0: no clip
        if self.recorder is not None:  # before the update: an interrupted save keeps rows <= the updates applied
            self.per_step.append(self.recorder.row(step=step + 1, loss=mean_over_ranks(loss_sum, self.world),
                                                   grad_norm=float(grad_norm), lr=self.optimizer.param_groups[0]["lr"]))
        with interrupt_after():  # a Ctrl-C here waits until the update is whole
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_seen += batch.numel()
        bar.update(1)
        done = step + 1
        if done % cfg.log_every == 0 or done % cfg.eval_every == 0 or done == stop:
            due = eval_due(done, cfg, stop)
            val_loss = evaluate_held_out(self.model, val, cfg, self.bos, self.amp) if due else math.nan
            elapsed = time.perf_counter() - self.t0
            history.append(dict(step=done, tokens=done * batch.numel(), loss=mean_over_ranks(loss_sum, self.world),
                                val_loss=val_loss, lr=lr_at(cfg, step), grad_norm=float(grad_norm),
                                tokens_per_s=self.tokens_seen / elapsed, elapsed_s=elapsed))

    def _gradients(self, batch: Tensor) -> Tensor:
        """Accumulate the gradients of the batch's micro-batches; their summed loss."""
        cfg, micro = self.cfg, self.cfg.batch_size // self.cfg.grad_accum
        loss_sum = torch.zeros((), device=self.dev)
        for i in range(cfg.grad_accum):
            rows = batch[i * micro : (i + 1) * micro][self.rank :: self.world].to(self.dev)
            last = i == cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or self.world == 1 else self.wrapped.no_sync()
            with sync, self.amp, self.recorder.watching() if self.recorder else contextlib.nullcontext():
                loss = self.wrapped(rows, return_type="loss") / cfg.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        return loss_sum


def eval_due(done: int, cfg: TrainConfig, stop: int) -> bool:
    """Whether step ``done`` evaluates on the held-out data (every ``eval_every`` steps and the last)."""
    return done % cfg.eval_every == 0 or done == stop


@torch.no_grad()
def evaluate_held_out(model: MassiveLM, val: Stream, cfg: TrainConfig, bos: int | None, amp: Any) -> float:
    """The mean loss on ``eval_batches`` fixed windows of the held-out stream (the model left in train mode)."""
    model.eval()
    n_ctx, dev = model.cfg.n_ctx, model.W_E.device
    n_seq = max(1, min(cfg.batch_size, (len(val) - 1) // (n_ctx - 1)))
    losses = []
    for i in range(cfg.eval_batches):  # fixed windows: the same for every run and step
        batch = sample_batch(val, n_seq, n_ctx, bos, seed=-1 - i, step=0).to(dev)
        with amp:
            losses.append(float(model(batch, return_type="loss")))
    model.train()
    return sum(losses) / len(losses)
