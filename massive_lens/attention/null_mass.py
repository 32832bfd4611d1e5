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
it, the sink metric. Two paths, as everywhere in the package (:mod:`massive_lens.core.lse`): on
a Hugging Face model the LSE path folds the sink logit into the kernel's log-sum-exp; the eager
path reads the pattern, whose keys' weights miss exactly the null mass (``1 - sum``). A model
trained here exposes its slots' weights at ``attn.hook_slot_pattern``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.checks import as_number
from massive_lens.core.criterion import SINK_THRESHOLD, first_token_mass, sink_metric
from massive_lens.core.lse import EAGER, LSE, LayerAttention, choose_path, lse_run, path_text
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
    for layer in range(view.n_layers):
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
        attention: ``"auto"``, ``"lse"`` (from q, k and the fused kernel's log-sum-exp with the
            sink logit folded in; Hugging Face models only) or ``"eager"`` (the pattern).

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
    slots = kind != SINK_LOGIT
    path = EAGER if slots else choose_path(view, attention)
    if slots and attention == LSE:
        raise MassiveLensError(f"{view.name} is a model trained here: it computes its own attention, so there is no "
                               "fused kernel's log-sum-exp to read; use attention='eager' or 'auto'")
    tally = _Tally(batch.mask)
    if path == LSE:
        def from_lse(att: LayerAttention) -> None:
            null = att.null_mass
            tally.add(att.layer, att.columns([0])[..., 0], torch.zeros_like(att.lse) if null is None else null)

        with lse_run(view, from_lse):
            view.forward(batch, [], stop_after=view.hook_name(max(logits), "attn.hook_out")
                         if view.has_hook(max(logits), "attn.hook_out") else None)
    else:
        hooks = []
        for layer in logits:
            hooks.append((view.hook_name(layer, "attn.hook_pattern"), _pattern_hook(tally, layer, slots)))
            if slots:
                hooks.append((view.hook_name(layer, "attn.hook_slot_pattern"), _slot_hook(tally, layer)))
        view.forward(batch, hooks, stop_after=hooks[-1][0])
    frame = tally.frame(logits)
    return NullMass(frame=frame, kind=kind, threshold=threshold, model_name=view.name,
                    n_texts=len(batch.tokens), attention=path)


class _Tally:
    """Per layer, each head's first-token weight and null weight ``[batch head query]``."""

    def __init__(self, valid: Tensor):
        self.valid = valid
        self.first: dict[int, Tensor] = {}
        self.null: dict[int, Tensor] = {}

    def add(self, layer: int, first: Tensor | None, null: Tensor | None) -> None:
        if first is not None:
            self.first[layer] = first.detach().float().cpu()
        if null is not None:
            self.null[layer] = null.detach().float().cpu()

    def frame(self, logits: dict[int, Tensor | None]) -> pd.DataFrame:
        after = self.valid.clone().float()
        after[:, 0] = 0.0  # the queries after the first token
        n = after.sum().clamp(min=1)
        rows = []
        for layer in sorted(logits):
            first, null = self.first[layer], self.null[layer]
            heads = first.shape[1]
            logit = logits[layer] if logits[layer] is not None else torch.full((heads,), float("nan"))
            gu = first_token_mass(first[..., None], self.valid)
            rows.append(pd.DataFrame({
                "layer": layer, "head": range(heads),
                "null_mass": (torch.einsum("bhq,bq->h", null, after) / n).numpy(),
                "first_mass": (torch.einsum("bhq,bq->h", first, after) / n).numpy(),
                "first_token_mass": gu.numpy(), "sink_logit": logit.numpy()}))
        return pd.concat(rows, ignore_index=True)[COLUMNS]


def _pattern_hook(tally: _Tally, layer: int, slots: bool) -> Any:
    """Reads the first-token column; without slots (a sink logit) also the null mass, one minus the
    keys' weights (transformers' eager attention drops the sink's column after the softmax)."""

    def hook(pattern: Tensor, hook: Any) -> None:
        p = pattern.detach().float()
        tally.add(layer, p[..., 0], None if slots else (1.0 - p.sum(-1)))

    return hook


def _slot_hook(tally: _Tally, layer: int) -> Any:
    def hook(slot_pattern: Tensor, hook: Any) -> None:
        tally.add(layer, None, slot_pattern.detach().float().sum(-1))

    return hook
