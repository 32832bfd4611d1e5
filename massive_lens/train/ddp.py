"""Data parallelism for :func:`~massive_lens.train.train_model`: the process group under
``torchrun`` (gloo on CPU, NCCL on GPU), the DDP wrapper, and a mean over ranks."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel


def mean_over_ranks(value: Tensor, world: int) -> float:
    """``value`` averaged over the ``world`` ranks (every rank must call it), as a float."""
    if world > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= world
    return float(value)


def setup_distributed(device: str | None) -> tuple[int, int, torch.device]:
    """``(rank, world size, device)``; under ``torchrun`` the process group is started first."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and device in (None, "cuda")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    if device is not None and device != "cuda":
        return rank, world, torch.device(device)
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def wrap_ddp(model: Any, world: int, dev: torch.device) -> Any:
    """The model wrapped for data parallelism (itself on one rank)."""
    if world == 1:
        return model
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
