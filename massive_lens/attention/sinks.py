"""Which positions act as attention sinks, and the sink term of an attention output.

A position is a sink when a large share of heads put most of their attention on it, or when
it carries a massive activation that persists across layers (the rule of
:class:`~massive_lens.core.criterion.SinkRule`); a dim that crosses the massive criterion at
one early layer does not make its positions sinks. A sequence with none falls back to its
first token. :class:`SinkSet` records which positions an analysis treated as sinks.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from massive_lens.core.attention_pass import attention_pass, choose_path
from massive_lens.core.criterion import Criterion, SinkEvidence, SinkRule
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.tokens import TOKEN_KINDS, Batch
from massive_lens.errors import MassiveLensError


def sink_term(pattern: Float[Tensor, "batch head_index query_pos key_pos"],
              v: Float[Tensor, "batch key_pos kv_head d_head"],
              keys: Bool[Tensor, "batch key_pos"]) -> Float[Tensor, "batch query_pos head_index d_head"]:
    """``sum_{i in keys} p_qi v_i`` per query head; a kv head serves ``n_heads // n_kv`` heads.

    >>> p = torch.full((1, 2, 3, 3), 1 / 3)
    >>> sink_term(p, torch.ones(1, 3, 1, 4), torch.tensor([[True, False, False]]))[0, 0, 0]
    tensor([0.3333, 0.3333, 0.3333, 0.3333])
    """
    group = pattern.shape[1] // v.shape[2]
    return torch.einsum("bhqk,bkhd->bqhd", pattern * keys[:, None, None, :].to(pattern.dtype),
                        v.repeat_interleave(group, dim=2))


# The sink rule's sinks are the census's primary level (``sink_census``); secondary and transient
# sinks are never treated as sinks unless given, and every summary says so through this text.
LEVEL = "census level primary; secondary sinks not included"
FOUND = f"positions with massive activations that persist across layers, or that draw attention as sinks; {LEVEL}"


@dataclass(frozen=True)
class SinkSet:
    """The positions an analysis or intervention treated as sinks, and why.

    ``mask [batch pos]``; ``kinds [batch pos]`` indexes ``TOKEN_KINDS`` (``bos``, ``first``,
    ``delimiter``, ``other``; in an image ``cls``, ``register``, ``patch``);
    ``by_attention``/``by_massive``: which sinks the rule found by the attention they draw and
    by a persistent massive activation (None when the sinks were given); ``source``: how they
    were chosen.

    >>> s = SinkSet(torch.tensor([[True, False], [True, True]]), torch.tensor([[0, 3], [0, 2]]), "given")
    >>> s.describe()
    '1-2 per sequence (mean 1.5): bos 2, delimiter 1'
    """

    mask: Bool[Tensor, "batch pos"]
    kinds: Int[Tensor, "batch pos"]
    source: str
    by_attention: Bool[Tensor, "batch pos"] | None = None
    by_massive: Bool[Tensor, "batch pos"] | None = None
    attention: str = ""  # how the rule read attention: "lse" (the kernel's log-sum-exp) or "eager" ("": given)

    @property
    def per_seq(self) -> Int[Tensor, " batch"]:
        """Number of sink positions in each sequence."""
        return self.mask.sum(-1)

    @property
    def kind_counts(self) -> dict[str, int]:
        """Sink positions of each token kind (kinds with none left out)."""
        counts = torch.bincount(self.kinds[self.mask].flatten(), minlength=len(TOKEN_KINDS)).tolist()
        return {kind: n for kind, n in zip(TOKEN_KINDS, counts, strict=True) if n}

    @property
    def kinds_text(self) -> str:
        """``"bos 8, delimiter 2"``: the token kinds of the sinks, with counts."""
        return ", ".join(f"{k} {n}" for k, n in self.kind_counts.items()) or "none"

    def describe(self) -> str:
        """One line: how many sinks per sequence, and their token kinds."""
        n = self.per_seq.float()
        if not len(n):
            return "no sequences"
        low, high = int(n.min()), int(n.max())
        count = f"{low} per sequence" if low == high else f"{low}-{high} per sequence (mean {float(n.mean()):.3g})"
        return f"{count}: {self.kinds_text}"

    def summary(self) -> str:
        """What the sinks are and how they were chosen, in one line (as results summarize)."""
        return f"sinks ({self.source}): {self.describe()}"

    def plot(self, ax: Any = None) -> Any:
        """Sink positions per token kind (a bar each)."""
        ax = ensure_axes(ax, (5, 3), layout=None)
        counts = self.kind_counts
        ax.bar(list(counts), list(counts.values()))
        ax.set(xlabel="token kind", ylabel="sink positions", title=f"sinks: {self.source}")
        return ax

    def to_frame(self) -> pd.DataFrame:
        """One row per sink: ``seq``, ``pos``, ``token_kind``, ``by_attention``, ``by_massive``."""
        seq, pos = self.mask.nonzero(as_tuple=True)
        frame = pd.DataFrame({"seq": seq.tolist(), "pos": pos.tolist(),
                              "token_kind": [TOKEN_KINDS[int(k)] for k in self.kinds[seq, pos]]})
        for name in ("by_attention", "by_massive"):
            flags = getattr(self, name)
            frame[name] = flags[seq, pos].tolist() if flags is not None else None
        return frame


# sink positions as the analyses take them: a list of positions, a bool [batch, pos] mask, a SinkSet
# found earlier on the same batch (``find_sinks``; one pass for several analyses), or None (found here)
Sinks = Sequence[int] | Tensor | SinkSet | None


def sinks_from(evidence: SinkEvidence, kinds: Int[Tensor, "batch pos"], attention: str = "") -> SinkSet:
    """The :class:`SinkSet` the rule gives, each sequence without one falling back to its first token."""
    mask = evidence.mask()
    none = ~mask.any(-1)
    source = FOUND
    if bool(none.any()):
        mask = mask.clone()
        mask[none, 0] = True
        source += f"; the first token in {int(none.sum())} sequence(s) with none"
    return SinkSet(mask, kinds, source, evidence.by_attention, evidence.by_massive, attention)


def find_sinks(model: Any, text: str | Sequence[str] | Tensor, *, rule: SinkRule | None = None,
               criterion: Criterion | None = None, attention: str = "auto") -> SinkSet:
    """The positions of ``text`` that act as attention sinks (one forward pass).

    A position is a sink when a large share of heads put most of their attention on it, or
    when it carries a massive activation that persists across layers (see
    :class:`~massive_lens.core.criterion.SinkRule`); a sequence with none falls back to its
    first token.

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor; for a
            vision model, ``pixel_values`` ``[batch, channels, height, width]``.
        rule: the sink rule (None: ``SinkRule()``).
        criterion: when an activation is massive (None: ``Criterion()``).
        attention: ``"auto"`` (the default: the eager pattern below 512 tokens, where it is the
            faster; from there each key's attention from q, k and the fused SDPA kernel's
            log-sum-exp where the model supports it; see
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"`` or ``"eager"``;
            the set's ``attention`` says which.

    Returns:
        A :class:`SinkSet`.

    Raises:
        MassiveLensError: for ``attention="lse"`` on a model whose kernel cannot give the LSE.

    >>> from massive_lens import tiny_model
    >>> find_sinks(tiny_model("llama"), "Hello there, world.").describe()
    '1 per sequence: bos 1'
    """
    view = ModelView(model)
    batch = view.tokenize(text)
    return sinks_of(view, batch, rule, criterion, attention)


def sinks_of(view: ModelView, batch: Batch, rule: SinkRule | None = None, criterion: Criterion | None = None,
             attention: str = "auto") -> SinkSet:
    """The sinks of an already tokenized ``batch`` (what :func:`find_sinks` does after tokenizing)."""
    path = choose_path(view, attention, batch)
    evidence = SinkEvidence(batch.mask, view.n_layers, rule, criterion)
    attention_pass(view, batch, None, path=path, evidence=evidence)
    return sinks_from(evidence, view.token_kinds(batch), path)


# at most this many key columns are kept per layer while the sinks are found in the same pass
MAX_CANDIDATES = 64


def candidate_columns(view: ModelView, batch: Any) -> Tensor:
    """Key positions that could be sinks, kept per layer while the pass finds the sinks: the first
    four positions and every position that is not an ordinary token (first token, delimiters,
    an image's class and register tokens) in some sequence; at most ``MAX_CANDIDATES`` (a sink
    elsewhere costs a second pass, never a wrong split)."""
    kinds = view.token_kinds(batch)
    ordinary = torch.tensor([TOKEN_KINDS.index("other"), TOKEN_KINDS.index("patch")])
    special = (~torch.isin(kinds, ordinary) & batch.mask).any(0)
    special[:4] = True
    return special.nonzero()[:MAX_CANDIDATES, 0]


def post_attention_norm(model: Any) -> bool:
    """Whether the model normalizes each attention output before adding it (Gemma 2/3)."""
    return ModelView(model).sandwich_norm()


def sink_mask(model: Any, batch: Batch, sinks: Sinks, attention: str = "auto") -> SinkSet:
    """``sinks`` as the analyses take them (see :data:`Sinks`) as a :class:`SinkSet` for ``batch``;
    None: found here (:func:`sinks_of`, reading attention as ``attention`` says)."""
    view = ModelView(model)
    n, pos = batch.tokens.shape
    mask = torch.zeros(n, pos, dtype=torch.bool)
    if isinstance(sinks, SinkSet):
        if tuple(sinks.mask.shape) != (n, pos):
            raise MassiveLensError(f"the SinkSet is for a batch of {list(sinks.mask.shape)} positions, this text has "
                                   f"{[n, pos]}; find the sinks on the same text")
        return sinks
    if isinstance(sinks, Tensor):
        if sinks.dtype != torch.bool or tuple(sinks.shape) != (n, pos):
            raise MassiveLensError(f"a sinks tensor must be bool [batch, pos] = {[n, pos]}, got "
                                   f"{sinks.dtype} {list(sinks.shape)}; or pass a list of positions")
        return SinkSet(sinks.cpu() & batch.mask, view.token_kinds(batch), "given mask")
    if sinks is None:
        return sinks_of(view, batch, attention=attention)
    if isinstance(sinks, (str, bytes, int, float)) or not hasattr(sinks, "__iter__"):
        raise MassiveLensError(f"sinks must be None (found by the sink rule), a list of positions, a bool mask "
                               f"[batch, pos] or a SinkSet; got {type(sinks).__name__} {sinks!r}"
                               + (": a single position goes in a list, e.g. sinks=[0]"
                                  if isinstance(sinks, int) else ""))
    positions = list(sinks)
    if any(isinstance(p, bool) or not isinstance(p, (numbers.Integral, torch.Tensor)) for p in positions):
        raise MassiveLensError(f"sink positions must be integers, got {positions!r}")
    if not positions or any(not 0 <= int(p) < pos for p in positions):
        raise MassiveLensError(f"sink positions {positions} must be non-empty and within 0..{pos - 1}")
    mask[:, positions] = True
    return SinkSet(mask & batch.mask, view.token_kinds(batch), f"positions {positions}")
