"""Shared helpers for the training tests: tiny MassiveLM models, seeded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from massive_lens.train.model import MassiveLM, MassiveLMConfig

SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare" / "input.txt"
TEXT = "The cat sat. The dog ran, and the bird flew.\nA new line. " * 60


def tiny_lm(attention: str = "softmax", style: str = "llama", seed: int = 0, **fields) -> MassiveLM:
    """A 2-layer, 32-wide MassiveLM with seeded random weights."""
    torch.manual_seed(seed)
    shape = dict(n_layers=2, d_model=32, n_heads=2, n_ctx=32)
    cfg = MassiveLMConfig(**{**shape, **fields}, style=style, attention=attention)
    return MassiveLM(cfg).eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
