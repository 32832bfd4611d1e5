"""Training presets: named budgets from a CI smoke test to GPT-2 124M scale.

A preset is a :class:`TrainConfig`: the model shape (a dict of
:class:`~massive_lens.train.model.MassiveLMConfig` fields), the data, and the optimizer
schedule. Every variant in a comparison uses the same preset, so the budget, data order
and seeds are identical and only the attention differs.

Run times (see ``docs/training.md``; "measured" ones were timed here, the GPU ones are
estimates from FLOP counts):

* ``smoke``: a few seconds on a laptop CPU (measured), for CI.
* ``cpu``: byte-level Tiny Shakespeare, 10M tokens; ~23 minutes on one CPU thread
  (measured at 7,400 tokens/s), less on two idle cores.
* ``gpu-small``: a 6-layer, 384-wide Llama-style model, ~1 h on one modern GPU (estimate).
* ``gpu-gpt2``: GPT-2 124M shape on FineWeb text, the massive-activations paper's setting
  (nanoGPT-style bare windows, no BOS prepended); ~1 day on one H100 (estimate), less with
  ``torchrun`` over several GPUs.

Both GPU presets read the token file ``FINEWEB_TOKENS`` (written once with ``massive-lens
tokenize``, see below), memory-mapped, so start-up costs neither RAM nor tokenizing time.

>>> get_preset("smoke", steps=5).steps
5
>>> get_preset("cpu").model["n_layers"]
4
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from massive_lens.core.corpora import data_file
from massive_lens.errors import MassiveLensError


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (JSON-able, stored in checkpoints).

    ``data`` is ``"default"`` (massive_lens's offline prose), a path to a text file,
    ``"hf:<dataset>[:<config>]"`` (needs the ``datasets`` package and network), or a token
    file ``*.bin`` (see :mod:`massive_lens.train.data`). ``prepend_bos`` starts every
    sequence with BOS (else sequences are bare windows and the first token is arbitrary).
    ``tokenizer`` is ``"byte"`` (offline, 259 tokens) or ``"default"`` (the default model's
    tokenizer). ``batch_size`` is the global number of sequences per optimizer step,
    split over ``grad_accum`` micro-batches and over DDP ranks. ``grad_clip`` 0: gradients not clipped.
    """

    model: dict[str, Any] = field(default_factory=dict)
    data: str = "default"
    tokenizer: str = "byte"
    max_chars: int | None = None
    prepend_bos: bool = True
    val_fraction: float = 0.05
    steps: int = 100
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    ckpt_every: int = 100
    amp: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise MassiveLensError("steps, batch_size and grad_accum must be positive integers")
        if self.batch_size % self.grad_accum:
            raise MassiveLensError(
                f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}"
            )
        if self.tokenizer not in ("byte", "default"):
            raise MassiveLensError(f"tokenizer must be 'byte' or 'default', got {self.tokenizer!r}")
        rates = dict(lr=self.lr, min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay, beta1=self.beta1,
                     beta2=self.beta2, grad_clip=self.grad_clip, val_fraction=self.val_fraction)
        bad = {k: v for k, v in rates.items() if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0}
        if bad or self.lr == 0 or not (self.beta1 < 1 and self.beta2 < 1):
            raise MassiveLensError(f"optimizer settings must be finite numbers >= 0 (lr > 0; grad_clip > 0 clips, "
                                   f"0 does not; betas < 1); "
                                   f"got {bad or rates}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if "attention" in out["model"] and not isinstance(out["model"]["attention"], (str, dict)):
            out["model"]["attention"] = asdict(out["model"]["attention"])
        return out

    def with_attention(self, variant: Any) -> TrainConfig:
        """The same run with another attention variant (a name, dict or VariantConfig).

        Args:
            variant: a variant name from :data:`~massive_lens.train.VARIANTS`, a dict of
                :class:`~massive_lens.train.VariantConfig` fields, or a ``VariantConfig``;
                checked when the model is built.

        Returns:
            A new ``TrainConfig`` whose ``model["attention"]`` is ``variant``.
        """
        return replace(self, model={**self.model, "attention": variant})


# The GPU presets read a token file (memmap), written once with
#   massive-lens tokenize hf:HuggingFaceFW/fineweb-edu:sample-10BT fineweb-edu-10BT.bin
# (~10B SmolLM2 tokens, 20 GB as uint16); pass data=... to put it elsewhere.
FINEWEB_TOKENS = "fineweb-edu-10BT.bin"
_TINY = dict(n_layers=2, d_model=32, n_heads=2, n_ctx=32)
_SHAKESPEARE = data_file("tinyshakespeare/input.txt")

PRESETS: dict[str, TrainConfig] = {
    "smoke": TrainConfig(
        model=_TINY, steps=30, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=15,
        eval_batches=2, log_every=5, ckpt_every=15, max_chars=200_000,
    ),
    "cpu": TrainConfig(
        model=dict(n_layers=4, d_model=128, n_heads=4, n_ctx=128),
        data=_SHAKESPEARE, steps=5000, batch_size=16, lr=3e-3, warmup_steps=100,
        eval_every=250, eval_batches=8, log_every=25, ckpt_every=250,
    ),
    "gpu-small": TrainConfig(
        model=dict(n_layers=6, d_model=384, n_heads=6, n_ctx=512),
        data=FINEWEB_TOKENS, tokenizer="default", steps=20_000, batch_size=64, lr=1e-3, warmup_steps=500,
        eval_every=1000, eval_batches=16, log_every=50, ckpt_every=1000,
    ),
    "gpu-gpt2": TrainConfig(
        model=dict(style="gpt2", n_layers=12, d_model=768, n_heads=12, n_ctx=1024),
        data=FINEWEB_TOKENS, tokenizer="default", prepend_bos=False, steps=20_000, batch_size=480,
        grad_accum=8, lr=6e-4,
        warmup_steps=700, eval_every=1000, eval_batches=16, log_every=50, ckpt_every=1000,
    ),
}


def get_preset(name: str | TrainConfig, **overrides: Any) -> TrainConfig:
    """A preset by name, with field overrides (``model=`` dicts are merged, not replaced).

    Args:
        name: a preset name from :data:`PRESETS` (``smoke``, ``cpu``, ``gpu-small``,
            ``gpu-gpt2``) or a :class:`TrainConfig` to start from.
        **overrides: :class:`TrainConfig` fields to replace; a ``model=`` dict is merged
            into the preset's model fields.

    Returns:
        A new :class:`TrainConfig` (the presets themselves are never changed).

    Raises:
        MassiveLensError: for an unknown preset name, an unknown field, or values the
            config rejects (e.g. ``steps=0``).

    >>> get_preset("smoke", model=dict(n_layers=1)).model
    {'n_layers': 1, 'd_model': 32, 'n_heads': 2, 'n_ctx': 32}
    """
    if isinstance(name, TrainConfig):
        base = name
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise MassiveLensError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    if "model" in overrides:
        overrides["model"] = {**base.model, **overrides["model"]}
    try:
        return replace(base, **overrides)
    except TypeError as exc:
        raise MassiveLensError(f"bad preset override: {exc}") from exc
