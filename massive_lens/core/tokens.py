"""Tokens: the right-padded :class:`Batch`, token ids checked against a vocabulary, and the
kind of every position (``bos``, ``first``, ``delimiter``, ``other`` in text; ``cls``,
``register``, ``patch`` in an image, see :mod:`massive_lens.core.images`).

Massive activations live at a few kinds of position: the first token of a sequence (BOS
where the tokenizer has one), and delimiters such as ``.``, ``,`` or a newline. Every
analysis labels positions with one of :data:`TOKEN_KINDS`, computed here once per tokenizer.

>>> from massive_lens.models import byte_tokenizer
>>> tok = byte_tokenizer()
>>> ids = torch.tensor([[tok.bos_token_id, *text_ids(tok, "Hi. Yo")]])
>>> batch = Batch(ids, torch.ones_like(ids, dtype=torch.bool), has_bos=True)
>>> [TOKEN_KINDS[k] for k in token_kinds(batch, tok)[0].tolist()]
['bos', 'first', 'other', 'delimiter', 'other', 'other', 'other']
"""

from __future__ import annotations

import string
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor
from transformers import PreTrainedTokenizerFast

from massive_lens.errors import MassiveLensError

TOKEN_KINDS = ("bos", "first", "delimiter", "other", "cls", "register", "patch")
_DELIMITER_CHARS = set(string.punctuation) | {"\n", "\r"}
_DELIMITER_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> table


@dataclass(frozen=True)
class Batch:
    """Right-padded tokens with a mask of real (non-pad) positions; for images, the
    ``pixel_values`` the model reads, with the position indices as ``tokens``.

    >>> batch = Batch(torch.tensor([[5, 6], [7, 0]]), torch.tensor([[True, True], [True, False]]), False)
    >>> batch.lengths.tolist(), [b.tokens.tolist() for b in batch.split(1)]
    ([2, 1], [[[5, 6]], [[7, 0]]])
    """

    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    has_bos: bool
    pixel_values: Float[Tensor, "batch channel height width"] | None = None

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.mask.sum(-1)

    def split(self, size: int) -> list[Batch]:
        """Consecutive sub-batches of at most ``size`` sequences (or images)."""
        pixels = (None,) * len(self.tokens) if self.pixel_values is None else self.pixel_values.split(size)
        return [Batch(t, m, self.has_bos, p) for t, m, p in
                zip(self.tokens.split(size), self.mask.split(size), pixels, strict=False)]


def delimiter_table(tokenizer: Any) -> Bool[Tensor, " d_vocab"]:
    """Which vocabulary ids are delimiters; decoded once per tokenizer (~1 s for 49k ids)."""
    table = _DELIMITER_TABLES.get(tokenizer)
    if table is None or len(table) != len(tokenizer):
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        special = set(tokenizer.all_special_ids)
        flags = [i not in special and _is_delimiter(piece) for i, piece in enumerate(pieces)]
        table = _DELIMITER_TABLES[tokenizer] = torch.tensor(flags, dtype=torch.bool)
    return table


def token_kinds(batch: Batch, tokenizer: Any) -> Int[Tensor, "batch pos"]:
    """Index into ``TOKEN_KINDS`` for every position of ``batch`` (pads get ``other``)."""
    table = delimiter_table(tokenizer)
    ids = batch.tokens.clamp(0, len(table) - 1)
    kinds = torch.full_like(batch.tokens, TOKEN_KINDS.index("other"))
    kinds[table[ids] & batch.mask] = TOKEN_KINDS.index("delimiter")
    first = 1 if batch.has_bos else 0
    if batch.has_bos:
        kinds[:, 0] = TOKEN_KINDS.index("bos")
    if batch.tokens.shape[1] > first:
        kinds[:, first] = torch.where(batch.mask[:, first], TOKEN_KINDS.index("first"), kinds[:, first])
    return kinds


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` (no special tokens added). Text that is not valid Unicode (a lone
    surrogate, left by a bad decode) is a ``MassiveLensError``, not a tokenizer traceback.

    >>> by_char = lambda text, add_special_tokens: {"input_ids": [ord(c) for c in text]}
    >>> text_ids(by_char, "Hi")
    [72, 105]
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MassiveLensError(
            f"the text holds {text[exc.start]!r} at character {exc.start}, a lone surrogate that is not valid "
            "Unicode; fix how it was decoded (e.g. bytes.decode('utf-8', errors='replace'))"
        ) from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


PREFIX_SLACK = 64  # tokens tokenized past what is kept, so that a cut mid-word never changes a kept token


def prefix_ids(tokenizer: Any, text: str, need: int | None) -> list[int]:
    """The ids of ``text`` as :func:`text_ids` gives them, but only the first ``need`` when
    that is enough (all of them for ``need=None``): a prefix of the text is tokenized, twice
    as long each time until it gives ``need + PREFIX_SLACK`` ids or is the whole text, so a
    few sequences cut from a long text (the offline default is 465k characters) cost a few
    thousand characters' tokenization, not the whole text's. The text is only ever cut at its
    end, whose last tokens (where a word may be split) are dropped: the kept ids are the
    whole text's (tests/test_corpora.py checks this on the offline tokenizers).

    >>> by_char = lambda text, add_special_tokens: {"input_ids": [ord(c) for c in text]}
    >>> prefix_ids(by_char, "Hello", 2), prefix_ids(by_char, "Hi", None)
    ([72, 101], [72, 105])
    """
    size = 4 * (need + PREFIX_SLACK) if need is not None else len(text)
    while size < len(text):
        ids = text_ids(tokenizer, text[:size])
        if len(ids) >= need + PREFIX_SLACK:
            return ids[:need]
        size *= 2
    ids = text_ids(tokenizer, text)
    return ids if need is None else ids[:need]


def check_token_ids(
    tokens: Any, vocab: int | None, model_name: str = "the model", extra: Sequence[int] = ()
) -> Int[Tensor, "..."]:
    """The one check of token ids given by a caller: an integer tensor, not empty, every id
    in ``[0, vocab)`` (or one of ``extra``). Returns it as ``torch.long``; anything else is a
    :class:`MassiveLensError` saying what was wrong. Float ids are refused, never rounded.

    >>> check_token_ids(torch.tensor([[1, 2, 3]], dtype=torch.int32), 10).dtype
    torch.int64
    >>> check_token_ids(torch.tensor([[1.0, 72.7]]), 100)
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: token ids must be integers, got a torch.float32 tensor ...
    """
    if not isinstance(tokens, Tensor):
        raise MassiveLensError(f"token ids must be a torch tensor of integers, got {type(tokens).__name__}")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        finite = tokens.is_complex() or tokens.dtype == torch.bool or bool(torch.isfinite(tokens).all())
        detail = "" if finite else " holding NaN or inf"
        if finite and tokens.is_floating_point() and not bool((tokens == tokens.round()).all()):
            detail = " holding fractional ids"
        raise MassiveLensError(
            f"token ids must be integers, got a {tokens.dtype} tensor{detail}; ids are never rounded. "
            "Tokenize text with the model's tokenizer (or pass a string), or convert whole-number ids "
            "with tokens.long()"
        )
    if tokens.numel() == 0:
        raise MassiveLensError(f"got an empty token tensor of shape {tuple(tokens.shape)}; pass at least one token")
    tokens = tokens.long()
    low, high = int(tokens.min()), int(tokens.max())
    bad = tokens < 0
    if vocab is not None:
        bad = bad | (tokens >= vocab)
    for allowed in extra:
        bad = bad & (tokens != allowed)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        span = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise MassiveLensError(
            f"token ids must lie in {span} for {model_name}; got ids from {low} to {high} "
            f"(the first bad one, {int(tokens[tuple(first)])}, at index {tuple(first)}). "
            "Tokenize text with this model's tokenizer"
        )
    return tokens


def _is_delimiter(piece: str) -> bool:
    stripped = piece.strip(" \t")
    if not stripped:
        return False
    return all(c in _DELIMITER_CHARS or c.isspace() for c in stripped)


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (256 bytes + ``<|bos|>``, ``<|eos|>``, ``<|pad|>``), offline.

    Returns:
        A ``PreTrainedTokenizerFast`` with 259 tokens: ids 0-255 are the bytes, 256 is
        ``<|bos|>``, 257 ``<|eos|>`` and 258 ``<|pad|>``; it adds no special tokens itself.

    >>> tok = byte_tokenizer()
    >>> tok.convert_ids_to_tokens(tok("Hi.").input_ids)
    ['H', 'i', '.']
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    mark_bos(tok, "byte-level")
    return tok


def mark_bos(tokenizer: Any, name: str) -> None:
    """Tell TransformerLens the tokenizer is usable as is (it would reload it by name)."""
    tokenizer.init_kwargs.setdefault("name_or_path", name)
    if tokenizer.bos_token is not None:
        tokenizer.init_kwargs["add_bos_token"] = True
