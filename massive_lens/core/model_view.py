"""One adapter over the kinds of model massive_lens accepts.

A TransformerBridge (TransformerLens 4.x), a legacy HookedTransformer, or a model trained
by ``massive_lens.train`` all speak the TransformerLens hook vocabulary
(``blocks.{l}.hook_resid_post``, ``blocks.{l}.mlp.hook_post``, ...) and expose
TransformerLens-style weights (``blocks[l].mlp.W_out``). This module is the one place that
knows how to tokenize for them, run them with temporary hooks, and classify tokens
(``bos``, ``first``, ``delimiter``, ``other``), so analyses never special-case a model kind.
"""

from __future__ import annotations

import contextlib
import math
import string
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from massive_lens.errors import MassiveLensError

TOKEN_KINDS = ("bos", "first", "delimiter", "other")
_DELIMITER_CHARS = set(string.punctuation) | {"\n", "\r"}
_DELIMITER_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> table


@dataclass(frozen=True)
class Batch:
    """Right-padded tokens with a mask of real (non-pad) positions."""

    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    has_bos: bool

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.mask.sum(-1)


class ModelView:
    """Uniform access to a TransformerLens-style model (never holds state of its own)."""

    def __init__(self, model: Any):
        missing = [a for a in ("run_with_hooks", "hooks", "cfg", "hook_dict") if not hasattr(model, a)]
        if missing:
            raise MassiveLensError(
                f"{type(model).__name__} is not a TransformerLens model (missing "
                f"{', '.join(missing)}); load it with massive_lens.load_model(...), which "
                "also wraps Hugging Face models"
            )
        self.model = model
        self.cfg = model.cfg

    # ------------------------------------------------------------------ facts
    @property
    def name(self) -> str:
        return str(getattr(self.cfg, "model_name", None) or type(self.model).__name__)

    @property
    def n_layers(self) -> int:
        return int(self.cfg.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.cfg.d_model)

    @property
    def n_ctx(self) -> int | None:
        return getattr(self.cfg, "n_ctx", None)

    @property
    def tokenizer(self) -> Any:
        tok = getattr(self.model, "tokenizer", None)
        if tok is None:
            raise MassiveLensError(
                f"{self.name} has no tokenizer; pass token ids (a LongTensor) instead of text"
            )
        return tok

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def input_device(self) -> torch.device:
        embed = getattr(self.model, "embed", None)
        params = embed.parameters() if embed is not None else self.model.parameters()
        return next(iter(params)).device

    def hook_name(self, layer: int, hook: str) -> str:
        """``blocks.{layer}.hook_{hook}``, checked to exist on this model."""
        if not 0 <= layer < self.n_layers:
            raise MassiveLensError(f"layer {layer} out of range: {self.name} has {self.n_layers}")
        name = f"blocks.{layer}.{hook if hook.startswith(('hook_', 'attn.', 'mlp.', 'ln')) else 'hook_' + hook}"
        if name not in self.model.hook_dict:
            near = sorted(n.split(".", 2)[2] for n in self.model.hook_dict if n.startswith("blocks.0."))
            raise MassiveLensError(f"{self.name} has no hook {name!r}; per-block hooks: {near}")
        return name

    # ------------------------------------------------------------------ tokens
    def tokenize(self, inputs: str | Sequence[str] | Tensor, prepend_bos: bool | None = None) -> Batch:
        """Texts (or token ids) to a right-padded batch; errors for empty or too long input."""
        if isinstance(inputs, Tensor):
            tokens = inputs.long()
            if tokens.ndim == 1:
                tokens = tokens[None]
            if tokens.ndim != 2 or tokens.shape[-1] == 0:
                raise MassiveLensError(f"token ids must be [batch, pos] with pos > 0, got {tuple(inputs.shape)}")
            self.check_length(tokens.shape[-1])
            vocab = getattr(self.cfg, "d_vocab", None)
            if int(tokens.min()) < 0 or (vocab is not None and int(tokens.max()) >= vocab):
                raise MassiveLensError(
                    f"token ids must lie in [0, {vocab}) for {self.name}; got ids from "
                    f"{int(tokens.min())} to {int(tokens.max())}"
                )
            return self.full_batch(tokens)
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if not texts or any(not isinstance(t, str) or not t for t in texts):
            raise MassiveLensError("got an empty text (or no texts); pass at least one non-empty string")
        if prepend_bos is None:
            prepend_bos = bool(getattr(self.cfg, "default_prepend_bos", True))
        tok = self.tokenizer
        has_bos = prepend_bos and tok.bos_token_id is not None
        rows = []
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            rows.append(([tok.bos_token_id] if has_bos else []) + list(ids))
        longest = max(len(r) for r in rows)
        self.check_length(longest)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        tokens = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = True
        return Batch(tokens, mask, has_bos)

    def starts_with_bos(self, tokens: Int[Tensor, "batch pos"]) -> bool:
        """Whether every sequence starts with the tokenizer's BOS id (the one has-BOS check)."""
        tok = getattr(self.model, "tokenizer", None)
        bos = getattr(tok, "bos_token_id", None)
        return bos is not None and tokens.shape[-1] > 0 and bool((tokens[..., 0] == bos).all())

    def full_batch(self, tokens: Int[Tensor, "batch pos"]) -> Batch:
        """Unpadded token ids as a :class:`Batch` (every position real)."""
        return Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), self.starts_with_bos(tokens))

    def check_length(self, length: int) -> None:
        """Error when ``length`` tokens exceed the model's context."""
        if self.n_ctx is not None and length > self.n_ctx:
            raise MassiveLensError(
                f"input has {length} tokens but {self.name} has a context of {self.n_ctx}; "
                "shorten the text, or use scan_corpus, which cuts long text into sequences"
            )

    def str_tokens(self, batch: Batch) -> list[list[str]]:
        """Token strings of each sequence (pads dropped)."""
        tok = self.tokenizer
        return [
            [tok.decode([t]) for t in row[: int(n)].tolist()]
            for row, n in zip(batch.tokens, batch.lengths, strict=True)
        ]

    @property
    def _delimiter_table(self) -> Bool[Tensor, " d_vocab"]:
        """Which vocabulary ids are delimiters; decoded once per tokenizer (~1 s for 49k ids)."""
        tok = self.tokenizer
        table = _DELIMITER_TABLES.get(tok)
        if table is None or len(table) != len(tok):
            pieces = tok.batch_decode([[i] for i in range(len(tok))])
            special = set(tok.all_special_ids)
            flags = [i not in special and _is_delimiter(piece) for i, piece in enumerate(pieces)]
            table = _DELIMITER_TABLES[tok] = torch.tensor(flags, dtype=torch.bool)
        return table

    def token_kinds(self, batch: Batch) -> Int[Tensor, "batch pos"]:
        """Index into ``TOKEN_KINDS`` for every position (pads get ``other``)."""
        table = self._delimiter_table
        ids = batch.tokens.clamp(0, len(table) - 1)
        kinds = torch.full_like(batch.tokens, TOKEN_KINDS.index("other"))
        kinds[table[ids] & batch.mask] = TOKEN_KINDS.index("delimiter")
        first = 1 if batch.has_bos else 0
        if batch.has_bos:
            kinds[:, 0] = TOKEN_KINDS.index("bos")
        if batch.tokens.shape[1] > first:
            kinds[:, first] = torch.where(
                batch.mask[:, first], TOKEN_KINDS.index("first"), kinds[:, first]
            )
        return kinds

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def hooked(self, fwd_hooks: list[tuple[str, Any]]) -> Iterator[None]:
        """Attach hooks for the block; only these hooks are removed afterwards, always."""
        with self.model.hooks(fwd_hooks=fwd_hooks):
            yield

    def forward(self, batch: Batch, fwd_hooks: list[tuple[str, Any]], stop_after: str | None = None) -> Any:
        """One no-grad forward pass with temporary hooks; returns the model's output.

        With ``stop_after`` (a hook name) the pass ends right after that hook fires and
        returns None: analyses that read the residual stream skip the rest (and the
        unembedding, often the costliest matmul of a small model).
        """
        tokens = batch.tokens.to(self.input_device)
        kwargs: dict[str, Any] = {}
        if not bool(batch.mask.all()):
            kwargs["attention_mask"] = batch.mask.to(self.input_device).long()
        hooks = list(fwd_hooks)
        if stop_after is not None:
            hooks.append((stop_after, _stop_forward))
        try:
            with torch.no_grad(), self.hooked(hooks):
                return self.model(tokens, **kwargs)
        except _StopForward:
            return None

    def activation(self, batch: Batch, name: str) -> Tensor:
        """The activation at hook ``name`` for ``batch`` (float32, CPU); the pass stops there."""
        seen: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            seen["x"] = x.detach().float().cpu()

        self.forward(batch, [(name, keep)], stop_after=name)
        return seen["x"]

    def check_precision(self, peak: float, where: str) -> None:
        """Warn (with numbers) when a half-precision model carries values near its limits."""
        dtype = self.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return
        info = torch.finfo(dtype)
        if not torch.isfinite(torch.tensor(peak)):
            raise MassiveLensError(
                f"{self.name} in {dtype} overflowed ({where} reached {peak}); load it with "
                "dtype=torch.float32 (or bfloat16, which has float32's range)"
            )
        spacing = info.eps * 2.0 ** math.floor(math.log2(max(peak, 1e-30)))
        if peak > info.max / 4 or spacing >= 1.0:
            warnings.warn(
                f"{self.name} runs in {dtype}: the largest activation ({where}) is {peak:,.1f}; "
                f"at that size {dtype} resolves steps of {float(spacing):g} and overflows at "
                f"{info.max:,.0f}. Values and ratios are approximate; use float32 for exact ones.",
                stacklevel=3,
            )


class _StopForward(Exception):
    """Raised by the last hook an analysis needs, to end the forward pass early."""


def _stop_forward(activation: Tensor, hook: Any) -> None:
    raise _StopForward


def _is_delimiter(piece: str) -> bool:
    stripped = piece.strip(" \t")
    if not stripped:
        return False
    return all(c in _DELIMITER_CHARS or c.isspace() for c in stripped)
