"""Text sources and token batching.

Massive activations are a statement about *typical* text, so analyses that average (a
corpus scan, perplexity) need a stream of real prose. Four sources:

- the package's own offline default: the prose of the Python reference manual that every
  CPython ships (``pydoc_data.topics``), so nothing is downloaded and nothing outside the
  package is read;
- plain text files (read piece by piece, so a large file never sits in memory at once);
- Hugging Face datasets by name (``"hf:wikitext:wikitext-2-raw-v1:test"``), streamed;
  this needs network access and the ``datasets`` package;
- already tokenized sequences, a ``[n_seqs, seq_len]`` tensor of integer ids (float ids
  are refused, never rounded; every id must be in the model's vocabulary).

Which strings are files? The rule is explicit, so a typo never turns into a scan of its own
name:

- a ``pathlib.Path`` (any ``os.PathLike``) is a file, and must exist;
- a string starting with ``hf:`` names a Hugging Face dataset;
- a string naming an existing file is that file;
- a string that *looks like a file name*, a single word (no whitespace) with a file suffix
  (``corpus.csv``) or a path separator (``data/corpus``), but names nothing, is an error;
- any other string is the text itself. To analyse a word that looks like a file name as
  text, pass it in a list: ``["notes.txt"]`` (list items are always text).

:func:`token_batches` turns any of them into ``[batch, seq_len]`` token tensors, each
sequence starting with BOS when the model prepends one.

>>> default_text().startswith("%")
False
>>> len(default_text()) > 100_000
True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from massive_lens.core.tokens import prefix_ids
from massive_lens.errors import MassiveLensError

_PIECE_CHARS = 1 << 20  # characters tokenized at once when streaming a file

Corpus = str | os.PathLike | Iterable[str] | Tensor | None


def default_text() -> str:
    """Offline English prose (about 1 MB): the topics of CPython's reference manual.

    Returns:
        The topics of ``pydoc_data.topics`` in sorted order, separated by blank lines; the
        same text on every call (it depends only on the Python version).

    >>> text = default_text()
    >>> len(text) > 100_000, text == default_text()
    (True, True)
    """
    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def data_file(relative: str) -> str:
    """A file of the project's shared data folder (WikiText-2, Tiny Shakespeare), used by tests,
    benchmarks and training presets, never by the offline default text. Looked up in
    ``$MASSIVE_LENS_DATA``, then ``shared/data`` beside the checkout or the working folder.

    >>> data_file("tinyshakespeare/input.txt").endswith("input.txt")
    True
    """
    roots = [os.environ.get("MASSIVE_LENS_DATA"), Path(__file__).resolve().parents[3] / "shared" / "data",
             Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
    candidates = [Path(root) / relative for root in roots if root]
    return str(next((c for c in candidates if c.is_file()), candidates[0]))


def iter_texts(corpus: Any = None) -> Iterator[str]:
    """Yield the text pieces of a corpus source (see the module docstring).

    >>> next(iter_texts(["one text", "another"]))
    'one text'
    """
    if corpus is None:
        yield default_text()
    elif isinstance(corpus, str) and not corpus.strip():
        raise MassiveLensError("the corpus is an empty string; pass text, a file path, a list of strings, "
                               "or None for the offline default text")
    elif isinstance(corpus, os.PathLike):
        yield from _read_file(Path(corpus))
    elif isinstance(corpus, str) and corpus.startswith("hf:"):
        yield from _hf_texts(corpus)
    elif isinstance(corpus, str) and _looks_like_path(corpus):
        yield from _read_file(Path(corpus))
    elif isinstance(corpus, str):
        yield encodable(corpus)
    elif isinstance(corpus, (bytes, bytearray)):
        raise MassiveLensError("the corpus is bytes, not text; decode it first (data.decode('utf-8')) "
                               "or pass the file's path")
    elif not isinstance(corpus, Iterable) or isinstance(corpus, Mapping):
        raise MassiveLensError(f"the corpus must be None (the offline default text), a text, a file path, "
                               f"'hf:NAME', a list of strings or a token tensor; got {type(corpus).__name__} "
                               f"{corpus!r:.60}")
    else:
        for text in corpus:
            if not isinstance(text, str):
                raise MassiveLensError(f"corpus items must be strings, got {type(text).__name__}")
            yield encodable(text)


def encodable(text: str) -> str:
    """``text`` itself, checked to be valid Unicode (a lone surrogate, e.g. from a badly
    decoded file, cannot be encoded and would crash the tokenizer).

    >>> encodable("ok")
    'ok'
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MassiveLensError(f"the text has a character UTF-8 cannot encode ({text[exc.start]!r} at character "
                               f"{exc.start}, a lone surrogate); clean it first, e.g. "
                               "text.encode('utf-8', 'replace').decode('utf-8')") from exc
    return text


def token_batches(
    view: Any,
    corpus: Corpus = None,
    *,
    seq_len: int = 256,
    batch_size: int = 4,
    max_tokens: int | None = None,
    prepend_bos: bool | None = None,
) -> Iterator[Int[Tensor, "batch pos"]]:
    """Cut a corpus into ``[batch_size, seq_len]`` token batches (the last may be smaller).

    Every sequence starts with BOS when the model prepends one; ``max_tokens`` bounds the
    total number of tokens yielded. ``view`` is a ``ModelView``. Bad arguments and bad token
    ids are reported here, before the first batch is asked for.
    """
    if seq_len < 2 or batch_size < 1 or (max_tokens is not None and max_tokens < 1):
        raise MassiveLensError(f"need seq_len >= 2, batch_size >= 1 and max_tokens >= 1 (or None), got "
                               f"{seq_len}, {batch_size}, {max_tokens}")
    view.check_length(seq_len)
    if isinstance(corpus, Tensor):  # already tokenized: [n_seqs, seq_len]
        if corpus.ndim != 2 or corpus.shape[1] != seq_len:
            raise MassiveLensError(f"token corpus must be [n_seqs, {seq_len}], got {tuple(corpus.shape)}")
        stop = len(corpus) if max_tokens is None else max_tokens // seq_len
        return iter(view.check_tokens(corpus)[:stop].split(batch_size))
    tok = view.tokenizer
    if prepend_bos is None:
        prepend_bos = bool(getattr(view.cfg, "default_prepend_bos", True))
    bos = [tok.bos_token_id] if prepend_bos and tok.bos_token_id is not None else []
    max_seqs = None if max_tokens is None else max_tokens // seq_len
    if max_seqs == 0:
        raise MassiveLensError(f"max_tokens={max_tokens} is below one sequence of {seq_len} tokens")
    return _text_batches(tok, corpus, bos, seq_len, batch_size, max_seqs)


def _text_batches(tok: Any, corpus: Corpus, bos: list[int], seq_len: int, batch_size: int,
                  max_seqs: int | None) -> Iterator[Int[Tensor, "batch pos"]]:
    body = seq_len - len(bos)
    buffer: list[int] = []
    rows: list[list[int]] = []
    n_seqs = 0
    for text in iter_texts(corpus):
        need = None if max_seqs is None else (max_seqs - n_seqs) * body - len(buffer)
        buffer.extend(prefix_ids(tok, text, need))
        while len(buffer) >= body:
            rows.append(bos + buffer[:body])
            del buffer[:body]
            n_seqs += 1
            if len(rows) == batch_size or n_seqs == max_seqs:
                yield torch.tensor(rows, dtype=torch.long)
                rows = []
            if n_seqs == max_seqs:
                return
    if rows:
        yield torch.tensor(rows, dtype=torch.long)
    if n_seqs == 0:
        raise MassiveLensError(
            f"the corpus has fewer than {body} tokens, not enough for one sequence of "
            f"{seq_len}; lower seq_len or give more text"
        )


def _looks_like_path(text: str) -> bool:
    """Whether a corpus string is a file (the rule of the module docstring): True for an
    existing path, an error for a single word that looks like a file name and names nothing."""
    if "\n" in text or len(text) > 4096:
        return False
    try:
        if Path(text).expanduser().exists():
            return True
    except (OSError, ValueError):  # a long literal text, or one with a NUL, is not a file name
        return False
    if text and not any(c.isspace() for c in text) and _file_like(text):
        raise MassiveLensError(
            f"no such corpus file: {text} (a single word with a file suffix or a path separator is "
            f"taken as a file name); check the path, or pass [{text!r}] to analyse it as text"
        )
    return False


def _file_like(word: str) -> bool:
    """A path separator, or a suffix that has a letter (``.csv``, not the ``.14`` of ``3.14``)."""
    if "/" in word or os.sep in word:
        return True
    suffix = Path(word).suffix
    return len(suffix) > 1 and any(c.isalpha() for c in suffix)


def _read_file(path: Path) -> Iterator[str]:
    path = path.expanduser()
    if path.is_dir():
        raise MassiveLensError(f"the corpus {path} is a folder; pass a text file inside it")
    if not path.is_file():
        raise MassiveLensError(f"no such corpus file: {path}")
    with path.open(encoding="utf-8", errors="replace") as handle:
        carry = ""
        while piece := handle.read(_PIECE_CHARS):
            if "\x00" in piece:
                raise MassiveLensError(f"the corpus file {path} is binary (it holds NUL bytes), not "
                                       "UTF-8 text; pass a plain text file")
            piece = carry + piece
            cut = piece.rfind("\n") + 1 or len(piece)  # cut at a line end, not mid-word
            carry = piece[cut:]
            yield piece[:cut]
        if carry:
            yield carry


def _hf_texts(spec: str) -> Iterator[str]:
    parts = spec[3:].split(":")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else "train")
    try:
        import datasets
    except ImportError as exc:
        raise MassiveLensError(
            f"{spec} needs the datasets package: pip install 'massive-lens[datasets]'"
        ) from exc
    try:
        rows = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as exc:  # network, unknown name, unknown split
        raise MassiveLensError(
            f"could not open the Hugging Face dataset {name!r} (config {config}, split "
            f"{split}): {exc}. Offline, use a text file or the default corpus (None)"
        ) from exc
    for row in rows:
        text = row.get("text")
        if text:
            yield text


def sequences(view: Any, corpus: Corpus, seq_len: int, n_seqs: int) -> Int[Tensor, "seq pos"]:
    """The first ``n_seqs`` sequences of ``seq_len`` tokens of a corpus (BOS first when the
    model prepends one). ``view`` is a ``ModelView``; a token tensor is returned whole, as
    ``torch.long``, once its ids are checked."""
    view.require_text()
    if isinstance(corpus, Tensor):
        if corpus.ndim != 2 or corpus.shape[1] < 2:
            raise MassiveLensError(f"a token corpus must be [n_seqs, pos] with pos >= 2, got {tuple(corpus.shape)}")
        return view.check_tokens(corpus)
    if n_seqs < 1:
        raise MassiveLensError(f"n_seqs must be >= 1, got {n_seqs}")
    tokens = torch.cat(list(token_batches(view, corpus, seq_len=seq_len, batch_size=n_seqs,
                                          max_tokens=seq_len * n_seqs)))
    if len(tokens) < n_seqs:
        warnings.warn(f"the corpus gives only {len(tokens)} of the {n_seqs} sequences of {seq_len} tokens "
                      "asked for; the results are over those (give more text or lower seq_len)", stacklevel=3)
    return tokens
