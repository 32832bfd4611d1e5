"""Synthetic tasks on which a softmax head *must* learn to do nothing most of the time.

On ordinary text at CPU scale, a softmax model grows neither a first-token sink nor massive
activations (``docs/training.md``), so attention variants cannot be told apart there. The two
tasks here come from papers that prove or show the baseline forms a sink, because the task
needs a head that is active on a few positions and dormant everywhere else:

* ``trigger_conditional`` (Ran-Milo 2026, arXiv 2603.11487): a sequence of value tokens, with
  a trigger token at a few random positions. At a trigger the model must output the average of
  the preceding value tokens (as one-hot vectors: the prefix's histogram); everywhere else it
  must output zero. The output is the vector of the model's logits on the value tokens, and the
  loss is the squared error, balanced between trigger and other positions (their two means
  added), so neither kind dominates. A softmax head that averages the prefix at a trigger
  must put its weight on a position whose value is zero elsewhere: the sink.
* ``bigram_backcopy`` (Guo et al. 2024, arXiv 2410.13835): tokens follow a fixed random bigram
  chain, except after one of a few trigger tokens, where the next token copies the token
  before the trigger. The head that copies is needed only after triggers (active) and is
  dormant elsewhere. The loss is next-token cross-entropy. ``bigram_backcopy`` is our small
  version (a random Dirichlet chain over 64 tokens); ``bigram_backcopy_paper`` is the paper's (its
  code, GuoTianYu2000/Active-Dormant-Attention, ``BBM/data.py``): the chain is Tiny Shakespeare's
  character bigrams (65 characters), the triggers its three most frequent characters (space, ``e``,
  ``t``), 256 tokens after BOS.

Each task's accuracy is the share of positions where the rule is followed, for trigger positions
and other positions separately, and ``accuracy`` their mean (so a model that ignores the rare
triggers scores at most one half):

* trigger_conditional: the output's L1 distance to the target (histogram or zero) is below
  :data:`L1_TOLERANCE` (one half: the target's own L1 norm is one at a trigger);
* bigram_backcopy: the top prediction is the copied token after a trigger, and the chain's most
  likely next token elsewhere.

Data is generated in memory: batch ``step`` of seed ``seed`` is a pure function of both (as the
trainer's text batches are), and the bigram chain itself of the task's ``language_seed`` only, so
every seed learns the same language.

>>> task = make_task("bigram_backcopy", seq_len=16)
>>> batch = task.sample(4, seed=0, step=0)
>>> tuple(batch.tokens.shape), int(batch.tokens[0, 0]) == task.bos
((4, 17), True)
>>> logits = torch.zeros(4, 17, task.n_tokens)
>>> sorted(task.accuracy(logits, batch))
['accuracy', 'accuracy_other', 'accuracy_trigger']
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import Tensor
from transformers import PreTrainedTokenizerFast

from massive_lens.core.corpora import data_file
from massive_lens.core.tokens import mark_bos
from massive_lens.errors import MassiveLensError

TASKS = ("trigger_conditional", "bigram_backcopy", "bigram_backcopy_paper")
L1_TOLERANCE = 0.5


@dataclass(frozen=True)
class TaskBatch:
    """Sequences ``[BOS, x_1 .. x_T]`` with what the rule asks at each position.

    ``trigger``: positions where the conditional rule is active; ``scored``: positions whose output
    counts (all but BOS for trigger_conditional, all but the last for bigram_backcopy);
    ``target``: the output vectors ``[batch, pos, n_values]`` (trigger_conditional) or the expected
    top next token ``[batch, pos]`` (bigram_backcopy, -1 where not scored).
    """

    tokens: Int[Tensor, "batch pos"]
    trigger: Bool[Tensor, "batch pos"]
    scored: Bool[Tensor, "batch pos"]
    target: Tensor


def _check_options(task: Any, counts: dict[str, int], ranges: dict[str, tuple[float, float, bool]]) -> None:
    """Refuse option values the task cannot run with: ``counts`` are whole numbers and at least the given
    minimum; ``ranges`` maps a name to ``(low, high, low_open)``: a finite number in ``[low, high]``
    (``(low, high]`` when ``low_open``)."""
    bad = [f"{k}={getattr(task, k)!r} (a whole number >= {low})" for k, low in counts.items()
           if isinstance(getattr(task, k), bool) or not isinstance(getattr(task, k), (int, np.integer))
           or getattr(task, k) < low]
    for k, (low, high, low_open) in ranges.items():
        v = getattr(task, k)
        ok = isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(v) \
            and (v > low if low_open else v >= low) and v <= high
        if not ok:
            span = f"> {low:g}" if high == math.inf else f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            bad.append(f"{k}={v!r} (a finite number {span})")
    if bad:
        raise MassiveLensError(f"bad option for task {task.name!r}: {'; '.join(bad)}")


def _rng(seed: int, step: int) -> np.random.Generator:
    if seed < 0 and step:
        raise MassiveLensError("held-out batches use a negative seed and step 0")
    return np.random.default_rng([abs(seed), step, int(seed < 0)])


def _word_tokenizer(names: list[str], bos: str) -> Any:
    """A word-level tokenizer over ``names`` (ids in order), space-separated, offline."""
    core = Tokenizer(models.WordLevel(vocab={n: i for i, n in enumerate(names)}, unk_token=bos))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=bos, pad_token=bos)
    mark_bos(tok, "task")
    return tok


def _split_means(hit: Tensor, trigger: Tensor, scored: Tensor) -> dict[str, float]:
    parts = {}
    for name, where in (("trigger", trigger & scored), ("other", ~trigger & scored)):
        parts[f"accuracy_{name}"] = float(hit[where].float().mean()) if where.any() else float("nan")
    return dict(accuracy=float(np.nanmean(list(parts.values()))), **parts)


@dataclass(frozen=True)
class TriggerConditional:
    """Ran-Milo's trigger-conditional task (module docstring). Each sequence draws its own value
    distribution from a Dirichlet(``alpha``) so that the prefix averages differ."""

    n_values: int = 16
    seq_len: int = 32
    trigger_prob: float = 0.15
    alpha: float = 0.5
    name: str = "trigger_conditional"

    def __post_init__(self) -> None:
        _check_options(self, dict(n_values=1, seq_len=2), dict(trigger_prob=(0.0, 1.0, False),
                                                               alpha=(0.0, math.inf, True)))

    @property
    def trigger_id(self) -> int:
        return self.n_values

    @property
    def bos(self) -> int:
        return self.n_values + 1

    @property
    def n_tokens(self) -> int:
        return self.n_values + 2

    def tokenizer(self) -> Any:
        return _word_tokenizer([f"v{i}" for i in range(self.n_values)] + ["<trig>", "<|bos|>"], "<|bos|>")

    def sample(self, n_seq: int, seed: int, step: int) -> TaskBatch:
        rng, k, t = _rng(seed, step), self.n_values, self.seq_len
        probs = rng.dirichlet(np.full(k, self.alpha), size=n_seq)
        draws = rng.random((n_seq, t))
        values = np.minimum((draws[..., None] > probs.cumsum(1)[:, None, :]).sum(-1), k - 1)
        trigger = rng.random((n_seq, t)) < self.trigger_prob
        trigger[:, 0] = False  # the first trigger has a prefix to average
        onehot = np.eye(k)[values] * ~trigger[..., None]
        before = np.cumsum(onehot, 1) - onehot  # value counts strictly before each position
        hist = before / np.maximum(before.sum(-1, keepdims=True), 1)
        target = np.where(trigger[..., None], hist, 0.0)
        tokens = np.where(trigger, self.trigger_id, values)
        pad = np.zeros((n_seq, 1), dtype=bool)
        return TaskBatch(
            tokens=torch.from_numpy(np.concatenate([np.full((n_seq, 1), self.bos), tokens], 1)).long(),
            trigger=torch.from_numpy(np.concatenate([pad, trigger], 1)),
            scored=torch.from_numpy(np.concatenate([pad, ~pad.repeat(t, 1)], 1)),
            target=torch.from_numpy(np.concatenate([np.zeros((n_seq, 1, k)), target], 1)).float(),
        )

    def output(self, logits: Float[Tensor, "batch pos d_vocab"]) -> Float[Tensor, "batch pos n_values"]:
        """The model's output vector: its logits on the value tokens."""
        return logits[..., : self.n_values].float()

    def loss(self, logits: Float[Tensor, "batch pos d_vocab"], batch: TaskBatch) -> Float[Tensor, ""]:
        err = (self.output(logits) - batch.target.to(logits.device)).pow(2).sum(-1)
        trig, scored = batch.trigger.to(logits.device), batch.scored.to(logits.device)
        return sum(err[w].mean() for w in (trig & scored, ~trig & scored) if w.any())

    def accuracy(self, logits: Float[Tensor, "batch pos d_vocab"], batch: TaskBatch) -> dict[str, float]:
        l1 = (self.output(logits).cpu() - batch.target).abs().sum(-1)
        return _split_means(l1 < L1_TOLERANCE, batch.trigger, batch.scored)


@dataclass(frozen=True)
class BigramBackcopy:
    """Guo et al.'s Bigram-Backcopy (module docstring). Without ``text`` (our small version): ``n_vocab``
    tokens (default 64), the last ``n_triggers`` of them triggers, the chain's rows Dirichlet(``alpha``)
    draws from ``language_seed``, the first token uniform over non-triggers. With ``text`` (the paper's
    version): one token per distinct character of that file (a path, or a name under the shared data
    folder, :func:`massive_lens.core.corpora.data_file`), the chain its character-bigram frequencies,
    the triggers its ``n_triggers`` most frequent characters, the first token drawn from the character
    frequencies with the triggers left out."""

    n_vocab: int | None = None
    n_triggers: int = 3
    seq_len: int = 64
    alpha: float = 0.2
    language_seed: int = 0
    text: str | None = None
    name: str = "bigram_backcopy"

    def __post_init__(self) -> None:
        _check_options(self, dict(n_triggers=1, seq_len=2, language_seed=0), dict(alpha=(0.0, math.inf, True)))
        if self.n_vocab is not None:
            _check_options(self, dict(n_vocab=2), {})
        if self.text is not None and not isinstance(self.text, str):
            raise MassiveLensError(f"bad option for task {self.name!r}: text={self.text!r} (a file path or a name "
                                   "under the shared data folder)")
        if self.text is not None and self.n_vocab is not None:
            raise MassiveLensError("bigram_backcopy takes n_vocab or text, not both: with text the vocabulary "
                                   "is the text's distinct characters")
        self.language  # noqa: B018 (checks the options now: the text exists, the triggers fit)

    @cached_property
    def language(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(chain, first, triggers)``: the transition matrix ``[n, n]`` (rows sum to one), the first
        token's distribution ``[n]`` and the trigger ids, ``n`` = :attr:`n_symbols`."""
        if self.text is None:
            n = 64 if self.n_vocab is None else self.n_vocab
            _check_triggers(self.n_triggers, n)
            chain = np.random.default_rng([self.language_seed, 7919]).dirichlet(np.full(n, self.alpha), size=n)
            triggers = np.arange(n - self.n_triggers, n)
            first = np.where(np.arange(n) < n - self.n_triggers, 1.0, 0.0)
            return chain, first / first.sum(), triggers
        return _text_language(self.text, self.n_triggers)

    @property
    def n_symbols(self) -> int:
        """The number of tokens other than BOS."""
        if self.text is None:
            return 64 if self.n_vocab is None else self.n_vocab
        return len(self.language[0])

    @property
    def bos(self) -> int:
        return self.n_symbols

    @property
    def n_tokens(self) -> int:
        return self.n_symbols + 1

    def tokenizer(self) -> Any:
        return _word_tokenizer([f"t{i}" for i in range(self.n_symbols)] + ["<|bos|>"], "<|bos|>")

    def chain(self) -> np.ndarray:
        """The bigram transition matrix ``[n_symbols, n_symbols]`` (rows sum to one)."""
        return self.language[0]

    def is_trigger(self, tokens: Tensor) -> Tensor:
        """Where ``tokens`` are triggers (BOS never is).

        Args:
            tokens: token ids, any shape.

        Returns:
            A boolean tensor of the same shape.
        """
        return torch.isin(tokens, torch.from_numpy(self.language[2]).to(tokens.device))

    def sample(self, n_seq: int, seed: int, step: int) -> TaskBatch:
        rng, t = _rng(seed, step), self.seq_len
        chain, first, triggers = self.language
        v, cum = len(chain), chain.cumsum(1)
        x = np.zeros((n_seq, t), dtype=np.int64)
        if self.text is None:  # our version's draw, as its runs were trained
            x[:, 0] = rng.integers(0, v - self.n_triggers, n_seq)
        else:
            x[:, 0] = np.minimum((rng.random(n_seq)[:, None] > first.cumsum()).sum(1), v - 1)
        trigger_row = np.isin(np.arange(v), triggers)
        for i in range(1, t):
            drawn = np.minimum((rng.random(n_seq)[:, None] > cum[x[:, i - 1]]).sum(1), v - 1)
            copy = x[:, i - 2] if i >= 2 else drawn
            x[:, i] = np.where(trigger_row[x[:, i - 1]], copy, drawn)
        return self.rule(torch.from_numpy(np.concatenate([np.full((n_seq, 1), self.bos), x], 1)))

    def rule(self, tokens: Int[Tensor, "batch pos"]) -> TaskBatch:
        """What the rule expects of ``tokens``: after a trigger, the token before it; elsewhere the chain's
        most likely next token; BOS and the last position are not scored.

        Args:
            tokens: sequences ``[BOS, x_1 .. x_T]``.

        Returns:
            The :class:`TaskBatch` of ``tokens`` (``target`` -1 where not scored).
        """
        trigger = self.is_trigger(tokens)
        expected = torch.full_like(tokens, -1)
        best = torch.from_numpy(self.chain().argmax(1))
        expected[:, 1:-1] = torch.where(trigger[:, 1:-1], tokens[:, :-2], best[tokens[:, 1:-1]])
        return TaskBatch(tokens=tokens, trigger=trigger, scored=expected >= 0, target=expected)

    def loss(self, logits: Float[Tensor, "batch pos d_vocab"], batch: TaskBatch) -> Float[Tensor, ""]:
        tokens = batch.tokens.to(logits.device)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())

    def accuracy(self, logits: Float[Tensor, "batch pos d_vocab"], batch: TaskBatch) -> dict[str, float]:
        hit = logits.argmax(-1).cpu() == batch.target
        return _split_means(hit, batch.trigger, batch.scored)


def _check_triggers(n_triggers: int, n: int) -> None:
    if not 0 < n_triggers < n:
        raise MassiveLensError(f"n_triggers must be between 1 and {n - 1} (the tokens other than BOS, less one); "
                               f"got {n_triggers}")


@functools.lru_cache(maxsize=8)
def _text_language(text: str, n_triggers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A text's character chain, first-token distribution and triggers (read once per process: a grid
    checks every run's task before the first trains)."""
    ids = np.frombuffer(_read_text(text).encode("utf-32-le"), dtype=np.uint32)
    alphabet, codes = np.unique(ids, return_inverse=True)
    n = len(alphabet)
    _check_triggers(n_triggers, n)
    counts = np.zeros((n, n))
    np.add.at(counts, (codes[:-1], codes[1:]), 1)
    counts[counts.sum(1) == 0] = 1  # a character seen only at the very end: uniform
    freq = np.bincount(codes, minlength=n).astype(float)
    triggers = np.sort(np.argsort(-freq, kind="stable")[:n_triggers])
    first = freq.copy()
    first[triggers] = 0
    out = counts / counts.sum(1, keepdims=True), first / first.sum(), triggers
    for array in out:
        array.flags.writeable = False  # shared between tasks
    return out


def _read_text(text: str) -> str:
    path = Path(text) if Path(text).is_file() else Path(data_file(text))
    if not path.is_file():
        raise MassiveLensError(f"bigram_backcopy's text {text!r} is neither a file nor a file of the shared data "
                               f"folder (looked at {path}); set $MASSIVE_LENS_DATA or pass a path")
    return path.read_text(encoding="utf-8")


Task = TriggerConditional | BigramBackcopy
_CLASSES = {"trigger_conditional": TriggerConditional, "bigram_backcopy": BigramBackcopy,
            "bigram_backcopy_paper": BigramBackcopy}
# named versions of a task: their defaults (the caller's options override them)
_PRESETS: dict[str, dict[str, Any]] = {
    "bigram_backcopy_paper": dict(text="tinyshakespeare/input.txt", n_triggers=3, seq_len=256,
                                  name="bigram_backcopy_paper"),
}


def make_task(name: str, **options: Any) -> Task:
    """A task by name (:data:`TASKS`) with its options (the dataclass fields).

    Args:
        name: ``"trigger_conditional"``, ``"bigram_backcopy"`` (our small version) or
            ``"bigram_backcopy_paper"`` (Guo et al.'s: Tiny Shakespeare's character bigrams, its three
            most frequent characters as triggers, 256 tokens after BOS).
        **options: fields of that task's dataclass (sizes, probabilities, seeds).

    Returns:
        The task.

    Raises:
        MassiveLensError: for an unknown task or option.

    >>> make_task("trigger_conditional", n_values=8).n_tokens
    10
    """
    if not isinstance(name, str) or name not in _CLASSES:
        raise MassiveLensError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    try:
        return _CLASSES[name](**{**_PRESETS.get(name, {}), **options})
    except TypeError as exc:
        raise MassiveLensError(f"bad option for task {name!r}: {exc}") from exc
