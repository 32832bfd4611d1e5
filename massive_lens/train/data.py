"""Training data: tokenizers, token streams, token files on disk, and batches.

A data source (``TrainConfig.data``) is one of

* ``"default"`` (massive_lens's offline prose), a text file, or ``"hf:<name>[:<config>]"``
  (Hugging Face datasets, streamed; needs ``datasets`` and network): tokenized in memory;
* a **token file** ``*.bin`` written by :func:`write_token_file` (or ``massive-lens
  tokenize``): a flat array of uint16/uint32 token ids read through ``numpy.memmap``, so a
  10B-token corpus costs no RAM and no tokenizing at start-up (the ``gpu-gpt2`` way).

Batches are windows at random offsets, a pure function of ``(seed, step)``.

>>> from massive_lens.core.tokens import byte_tokenizer
>>> stream = token_stream("abc abc", byte_tokenizer())
>>> sample_batch(stream, 2, 4, bos=1, seed=0, step=0).shape
torch.Size([2, 4])
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.core.corpora import iter_texts
from massive_lens.core.tokens import byte_tokenizer
from massive_lens.errors import MassiveLensError
from massive_lens.models.load import load_model

Stream = Tensor | np.ndarray  # a 1-D token stream: in memory, or a memmap over a token file


TOKENIZERS = ("byte", "default")


def get_tokenizer(name: str) -> Any:
    """``"byte"``: the offline byte-level tokenizer; ``"default"``: the default model's."""
    if name == "byte":
        return byte_tokenizer()
    if name == "default":
        return load_model().tokenizer
    raise MassiveLensError(f"unknown tokenizer {name!r}; choose one of {TOKENIZERS}")


def token_stream(data: str, tokenizer: Any, max_chars: int | None = None) -> Stream:
    """Tokenize a data source (see the module docstring) into one long 1-D stream.

    >>> from massive_lens.core.tokens import byte_tokenizer
    >>> token_stream("abc abc", byte_tokenizer()).shape
    torch.Size([7])
    """
    if isinstance(data, (str, os.PathLike)) and str(data).endswith(".bin"):
        return read_token_file(data, tokenizer)
    pieces = list(_token_pieces(data, tokenizer, max_chars))  # int32: 4 bytes a token
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)


def write_token_file(data: str, tokenizer: str, path: str | os.PathLike, max_chars: int | None = None,
                     progress: bool = True) -> Path:
    """Tokenize ``data`` once into ``path`` (``.bin``) plus a ``.json`` description.

    Tokens are appended piece by piece (flat memory) as uint16 when the vocabulary fits,
    else uint32; the file is written under a temporary name and renamed when complete.

    >>> import tempfile
    >>> out = write_token_file("one two three", "byte", tempfile.mkdtemp() + "/t.bin", progress=False)
    >>> len(read_token_file(out, get_tokenizer("byte")))
    13
    """
    path = Path(path)
    if path.suffix != ".bin":
        raise MassiveLensError(f"a token file must end in .bin (the trainer recognises it by that), got {path}")
    tok = get_tokenizer(tokenizer)
    dtype = np.uint16 if len(tok) <= 2**16 else np.uint32
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n_tokens = 0
    try:
        with open(tmp, "wb") as f, tqdm(unit="tok", unit_scale=True, disable=not progress, desc="tokenize") as bar:
            for piece in _token_pieces(data, tok, max_chars):
                f.write(piece.numpy().astype(dtype).tobytes())
                n_tokens += len(piece)
                bar.update(len(piece))
    except BaseException:  # an interrupted or failed run leaves no partial file behind
        tmp.unlink(missing_ok=True)
        raise
    meta = dict(tokenizer=tokenizer, vocab_size=len(tok), dtype=np.dtype(dtype).name, n_tokens=n_tokens,
                source=str(data), max_chars=max_chars)
    _meta_path(path).write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path)
    return path


def read_token_file(path: str | os.PathLike, tokenizer: Any) -> np.ndarray:
    """Memory-map a token file written by :func:`write_token_file`, checked before use: its
    description names an unsigned integer dtype wide enough for the vocabulary, its size
    matches ``n_tokens``, the vocabulary is ``tokenizer``'s, and every id is inside it (one
    chunked pass over the file)."""
    path = Path(path)
    if not path.is_file() or not _meta_path(path).is_file():
        raise MassiveLensError(f"no token file {path} (with {_meta_path(path).name}); write one with "
                               "write_token_file(data, tokenizer, path) or `massive-lens tokenize`")
    meta, dtype = _read_meta(path)
    if meta["vocab_size"] != len(tokenizer):
        raise MassiveLensError(f"{path} was tokenized with a {meta['vocab_size']}-token vocabulary "
                               f"({meta['tokenizer']!r}) but the run uses {len(tokenizer)} tokens; "
                               f"set tokenizer={meta['tokenizer']!r}")
    size = path.stat().st_size
    if size != meta["n_tokens"] * dtype.itemsize:
        raise MassiveLensError(f"{path} holds {size} bytes, its description says {meta['n_tokens']} tokens of "
                               f"{dtype.itemsize} bytes: the file is incomplete or not this description's; write it "
                               "again")
    stream = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    for start in range(0, len(stream), 1 << 26):  # ids beyond the vocabulary would index out of the embedding
        top = int(stream[start : start + (1 << 26)].max())
        if top >= len(tokenizer):
            raise MassiveLensError(f"{path} holds token id {top}, beyond the {len(tokenizer)}-token vocabulary of "
                                   f"{meta['tokenizer']!r}: the file is damaged or from another tokenizer; write it "
                                   "again")
    return stream


def _read_meta(path: Path) -> tuple[dict, np.dtype]:
    """A token file's JSON description, with its keys, types and dtype checked."""
    where = _meta_path(path)
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MassiveLensError(f"{where} is not a readable token-file description ({exc}); write the token file "
                               "again") from exc
    kinds = dict(tokenizer=str, vocab_size=int, dtype=str, n_tokens=int)
    bad = [k for k, kind in kinds.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), kind)
           or isinstance(meta.get(k), bool)]
    if bad:
        raise MassiveLensError(f"{where} lacks or mistypes {bad} (it needs tokenizer: str, vocab_size: int, "
                               "dtype: str, n_tokens: int); write the token file again")
    if meta["dtype"] not in ("uint8", "uint16", "uint32", "uint64") or meta["vocab_size"] < 1 \
            or np.iinfo(meta["dtype"]).max < meta["vocab_size"] - 1 or meta["n_tokens"] < 0:
        raise MassiveLensError(f"{where} describes {meta['n_tokens']} tokens of dtype {meta['dtype']!r} for a "
                               f"{meta['vocab_size']}-token vocabulary; a token file holds an unsigned integer dtype "
                               "wide enough for the vocabulary (uint16 or uint32 as write_token_file writes)")
    return meta, np.dtype(meta["dtype"])


def split_held_out(stream: Stream, n_ctx: int, val_fraction: float) -> tuple[Stream, Stream]:
    """``(train, held_out)``: the last ``val_fraction`` of the stream (at least ``n_ctx`` tokens).

    >>> [len(part) for part in split_held_out(torch.arange(1000), 16, 0.05)]
    [950, 50]
    """
    n_val = max(n_ctx, int(len(stream) * val_fraction))
    return stream[:-n_val], stream[-n_val:]


def start_token(tokenizer: Any, prepend_bos: bool = True) -> int | None:
    """The token every training sequence starts with: BOS (EOS if there is none), or None.

    >>> from massive_lens.core.tokens import byte_tokenizer
    >>> start_token(byte_tokenizer()) == byte_tokenizer().bos_token_id, start_token(byte_tokenizer(), False)
    (True, None)
    """
    if not prepend_bos:
        return None
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def sample_batch(stream: Stream, n_seq: int, n_ctx: int, bos: int | None, seed: int,
                 step: int) -> Int[Tensor, "batch pos"]:
    """``n_seq`` sequences ``[BOS] + window`` (or bare windows when ``bos`` is None).

    A pure function of ``(seed, step)``: every run with that seed sees the same batches.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    width = n_ctx if bos is None else n_ctx - 1
    starts = torch.randint(0, len(stream) - n_ctx + 1, (n_seq,), generator=gen)
    index = starts[:, None] + torch.arange(width)
    if isinstance(stream, np.ndarray):
        windows = torch.from_numpy(stream[index.numpy()].astype(np.int64))
    else:
        windows = stream[index].long()
    if bos is None:
        return windows
    return torch.cat([torch.full((n_seq, 1), bos, dtype=torch.long), windows], 1)


def _token_pieces(data: str, tokenizer: Any, max_chars: int | None):
    n_chars = 0
    # Hugging Face rows are documents: end each with EOS, as GPT-2's pipeline does
    eos = [tokenizer.eos_token_id] if str(data).startswith("hf:") and tokenizer.eos_token_id is not None else []
    for text in iter_texts(None if data == "default" else data):
        if max_chars is not None:
            text = text[: max_chars - n_chars]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        yield torch.tensor(ids, dtype=torch.int32)
        n_chars += len(text)
        if max_chars is not None and n_chars >= max_chars:
            break


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")
