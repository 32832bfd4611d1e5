"""Null mass: the attention that goes to an attention's own off-switch, not to a token.

An attention with a learned sink logit (gpt-oss's ``s_aux``: softmax over the keys' scores and
one extra logit ``s`` per head whose value is zero) or with explicit sink slots (the package's
training variants ``softmax1`` / ``softmax_n``, ``learned_sink``, ``kv_bias``, ``k_bias``: extra
keys appended after the real ones, :mod:`massive_lens.train.variants`) lets a head put its weight
on "nothing". Per query that weight is ``exp(s - LSE')``, ``LSE'`` the log of the softmax's
denominator *with* the sink logit in it; the keys' weights then sum to one minus it.

:func:`null_mass` reports it per layer and head beside where plain softmax heads park the same
weight, the first token: ``null_mass`` and ``first_mass`` (the mean attention of the real queries
after the first token to the sink slot and to the first token, the same queries for both),
Gu et al.'s ``first_token_mass`` (the first 64 queries' attention to the first token) and, from
it, the sink metric. The attention pass (:mod:`massive_lens.core.attention_pass`) hands each layer's
null weight over whichever path ran: on a Hugging Face model the LSE path folds the sink logit into
the kernel's log-sum-exp; the eager path reads the pattern, whose keys' weights miss exactly the
null mass (``1 - sum``), or, on a model trained here, its slots' weights at ``attn.hook_slot_pattern``
(where: :class:`NullReader`'s ``reads``, from the slot's kind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.checks import as_number
from massive_lens.core.criterion import SINK_THRESHOLD, first_token_mass, sink_metric
from massive_lens.core.lse import EAGER, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

SINK_LOGIT = "sink logit (s_aux)"  # a Hugging Face attention with a learned sink logit per head
COLUMNS = ["layer", "head", "null_mass", "first_mass", "first_token_mass", "sink_logit"]


def off_switch_layers(view: ModelView, *, required: bool = False) -> tuple[str, dict[int, Tensor | None]]:
    """Which kind of null slot ``view``'s attention has, and per attention layer the sink logit per
    head (``[head]``, float32; None where the slot's logit depends on the query: a learned key);
    ``("", {})`` where it has none (with ``required``: a MassiveLensError saying so). Kinds:
    :data:`SINK_LOGIT` (a Hugging Face attention module with a ``sinks`` parameter, one per head:
    gpt-oss), or the training variant's name.

    >>> from massive_lens import tiny_model
    >>> off_switch_layers(ModelView(tiny_model("gpt_oss")))[0]
    'sink logit (s_aux)'
    """
    found: dict[int, Tensor | None] = {}
    kind = ""
    # a view without TransformerLens-style blocks (nnsight) is not read here: its blocks are refused
    # inside its trace, and an error raised there leaves the trace's state behind in the process
    for layer in range(view.n_layers if view.serves_patterns else 0):
        attn = getattr(view.block(layer), "attn", None)
        variant = getattr(attn, "variant", None)
        if variant is not None and callable(getattr(variant, "slots", None)) and variant.slots() is not None:
            kind = getattr(getattr(variant, "cfg", None), "name", "slot")
            _, _, bias = variant.slots()
            learned_key = getattr(variant, "k_slot", None) is not None
            logit = None if learned_key else (torch.zeros(variant.n_heads) if bias is None else bias[:, 0])
            found[layer] = None if logit is None else logit.detach().float().cpu()
            continue
        hf = getattr(attn, "original_component", attn)
        sinks = getattr(hf, "sinks", None)
        if isinstance(sinks, torch.nn.Parameter) and sinks.ndim == 1:
            kind, found[layer] = SINK_LOGIT, sinks.detach().float().cpu()
    if required and not found:
        raise MassiveLensError(f"{view.name}: its attention has no null slot (no learned sink logit, no sink slot "
                               "variant), so every head's weight goes to tokens; use sink_attention for the mass on "
                               "the first token")
    return kind, found


@dataclass(frozen=True, kw_only=True)
class NullMass(Result):
    """Per layer and head (``to_frame()`` columns ``layer``, ``head``, ``null_mass``, ``first_mass``,
    ``first_token_mass``, ``sink_logit``): the mean attention of the real queries after the first
    token to the null slot and to the first token, Gu et al.'s first-token mass (first 64 queries)
    and the head's sink logit (NaN where a learned key makes it depend on the query).
    ``kind``: the off-switch (see :func:`off_switch_layers`); ``attention``: ``"lse"`` or ``"eager"``."""

    frame: pd.DataFrame
    kind: str
    threshold: float
    model_name: str
    n_texts: int
    attention: str = EAGER

    @property
    def sink_metric(self) -> float:
        """Share of heads whose first-token mass (Gu et al.) exceeds ``threshold``."""
        return sink_metric(torch.tensor(self.frame["first_token_mass"].to_numpy()), self.threshold)

    @property
    def null_metric(self) -> float:
        """Share of heads whose null mass exceeds ``threshold``: the heads that switch off by the slot."""
        return sink_metric(torch.tensor(self.frame["null_mass"].to_numpy()), self.threshold)

    @property
    def where(self) -> str:
        """Where the heads' idle attention goes: ``"sink slot"``, ``"first token"`` (the larger
        mean mass over all heads) or ``"neither"`` (no head passes ``threshold`` on either)."""
        null, first = float(self.frame["null_mass"].mean()), float(self.frame["first_mass"].mean())
        if max(self.null_metric, self.sink_metric) == 0:
            return "neither"
        return "sink slot" if null >= first else "first token"

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame
        return (f"{self.model_name}, {self.n_texts} text(s), off-switch: {self.kind}: mean null mass "
                f"{f['null_mass'].mean():.3f} (max {f['null_mass'].max():.3f}) against first-token mass "
                f"{f['first_mass'].mean():.3f} (max {f['first_mass'].max():.3f}); {self.null_metric:.0%} of heads put "
                f"> {self.threshold:g} on the slot, {self.sink_metric:.0%} on the first token (sink metric): "
                f"idle attention goes to: {self.where}; {path_text(self.attention)}")

    def plot(self, ax: Any = None) -> Any:
        """Mean null mass and first-token mass per layer (over heads)."""
        ax = ensure_axes(ax, size=(6, 3))
        per = self.frame.groupby("layer")[["null_mass", "first_mass"]].mean()
        ax.plot(per.index, per["null_mass"], marker="o", label="sink slot (null mass)")
        ax.plot(per.index, per["first_mass"], marker="s", label="first token")
        ax.set(xlabel="layer", ylabel="mean attention", ylim=(0, 1),
               title=f"{self.model_name}: where idle attention goes")
        ax.legend()
        return ax


def null_mass(model: Any, text: str | Sequence[str] | Tensor, *, threshold: float = SINK_THRESHOLD,
              attention: str = "auto") -> NullMass:
    """Per layer and head, the attention that goes to the attention's null slot (a learned sink
    logit or sink slots), beside the first-token mass and the sink metric.

    Args:
        model: a TransformerBridge over a Hugging Face model whose attention has learned sink
            logits (gpt-oss), or a model trained here with a slot variant (``softmax1``,
            ``softmax_n``, ``learned_sink``, ``kv_bias``, ``k_bias``).
        text: a string, a list of strings (padded into one batch) or a token tensor.
        threshold: the share of attention in (0, 1) that counts a head for the sink metric and
            the null metric (default 0.3, Gu et al.).
        attention: ``"auto"`` (:func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"``
            (from q, k and the fused kernel's log-sum-exp with the sink logit folded in; Hugging
            Face models only) or ``"eager"`` (the pattern).

    Returns:
        A :class:`NullMass`, one row per attention layer and head.

    Raises:
        MassiveLensError: if the model's attention has no null slot (plain softmax: its idle
            attention can only go to tokens, see :func:`sink_attention`), ``threshold`` is not
            in (0, 1), or ``text`` is empty or too long.

    >>> from massive_lens import tiny_model
    >>> result = null_mass(tiny_model("gpt_oss"), "Hello world. Bye now.")
    >>> bool(((result.to_frame().null_mass > 0) & (result.to_frame().null_mass < 1)).all())
    True
    """
    threshold = as_number(threshold, "threshold (an attention share)", above=0, below=1)
    view = ModelView(model)
    kind, logits = off_switch_layers(view, required=True)
    batch = view.tokenize(text)
    path = choose_path(view, attention, batch)  # a model trained here (slots) has no kernel: 'auto' reads its pattern
    reader, first = NullReader(view), {}

    def on_layer(at: PassLayer) -> None:
        first[at.layer] = at.cols[..., 0].detach().float().cpu()
        reader.take(at)

    last = max(logits)
    attention_pass(view, batch, on_layer, path=path, columns=[0], layers=logits, **reader.reads,
                   stop_after=view.hook_name(last, "resid_post") if view.has_hook(last, "resid_post") else None)
    frame = _frame(first, reader, batch.mask)
    return NullMass(frame=frame, kind=kind, threshold=threshold, model_name=view.name,
                    n_texts=len(batch.tokens), attention=path)


class NullReader:
    """Each null-slot layer's null weight ``null[layer] [batch head query]`` (the attention each
    query gives to the slot), reduced from an attention pass's ``PassLayer.null``
    (:func:`~massive_lens.core.attention_pass.attention_pass`: pass it ``**reader.reads`` and hand it
    every layer, ``reader.take(at)``), whichever path ran. ``kind`` and ``logits``: as
    :func:`off_switch_layers` (``""``: no null slot, and the reader asks for nothing).

    >>> from massive_lens import tiny_model
    >>> NullReader(ModelView(tiny_model("gpt_oss"))).reads["want"]
    ('null',)
    """

    def __init__(self, view: ModelView):
        self.kind, self.logits = off_switch_layers(view)
        self.null: dict[int, Tensor] = {}

    @property
    def reads(self) -> dict[str, Any]:
        """The pass's arguments that read the null weight: ``want`` and, per layer, where the eager
        path finds it (``null_from``: the pattern for a sink logit, which transformers' eager attention
        drops after the softmax; ``attn.hook_slot_pattern`` for a trained slot variant)."""
        source = "pattern" if self.kind == SINK_LOGIT else "slot_pattern"
        return {"want": ("null",) if self.kind else (), "null_from": dict.fromkeys(self.logits, source)}

    def take(self, at: PassLayer) -> None:
        """One layer of the pass: its null weight (zero where no sink logit reached the kernel)."""
        if at.layer in self.logits:
            null = at.null if at.null is not None else torch.zeros(at.shape[:3])
            self.null[at.layer] = null.detach().float().cpu()

    def head_sums(self, valid: Tensor) -> tuple[dict[int, Tensor], Tensor]:
        """Per layer each head's null weight summed over the real queries after the first token
        (``valid [batch pos]``), and how many queries that is: their ratio is ``null_mass``."""
        after = valid.clone().float()
        after[:, 0] = 0.0  # the queries after the first token
        return {layer: torch.einsum("bhq,bq->h", null, after) for layer, null in sorted(self.null.items())}, after.sum()


def _frame(first: dict[int, Tensor], reader: NullReader, valid: Tensor) -> pd.DataFrame:
    """One row per null-slot layer and head (:data:`COLUMNS`)."""
    sums, n = reader.head_sums(valid)
    after = valid.clone().float()
    after[:, 0] = 0.0
    rows = []
    for layer in sorted(reader.logits):
        heads = first[layer].shape[1]
        logit = reader.logits[layer] if reader.logits[layer] is not None else torch.full((heads,), float("nan"))
        rows.append(pd.DataFrame({
            "layer": layer, "head": range(heads), "null_mass": (sums[layer] / n.clamp(min=1)).numpy(),
            "first_mass": (torch.einsum("bhq,bq->h", first[layer], after) / n.clamp(min=1)).numpy(),
            "first_token_mass": first_token_mass(first[layer][..., None], valid).numpy(),
            "sink_logit": logit.numpy()}))
    return pd.concat(rows, ignore_index=True)[COLUMNS]
