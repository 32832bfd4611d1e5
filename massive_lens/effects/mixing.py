"""Over-mixing: do attention sinks stop a small change from spreading? (Barbero et al., 2025)

Barbero et al. ("Why do LLMs attend to the first token?", COLM 2025) read the sink as a brake:
attention parked on the first token is attention not spent mixing the other tokens, so a
perturbation of one token's representation reaches the later tokens less. :func:`over_mixing`
tests it directly. It adds a small random vector (``scale`` times the token's own norm) to one
early token's embedding (``blocks.0.hook_resid_pre`` at ``pos``) and measures, per layer, how
much the later tokens' residual streams move:

``spread = mean over later positions t of ||resid'_t - resid_t|| / ||resid_t||``

(and ``self_change``, the same at the perturbed token), once with the model intact and once
with the attention to the sinks removed (:func:`~massive_lens.interventions.remove_sink_attention`,
renormalized, in the same two passes). The claim predicts more spread without the sinks.

A model whose attention is masked to the diagonal cannot spread anything: every later token's
residual stream is then exactly unchanged (``spread == 0``), the check in the tests.

>>> from massive_lens import tiny_model
>>> mix = over_mixing(tiny_model("llama"), "a b c d e f " * 20, seq_len=24, n_seqs=2, remove=False)
>>> bool((mix.to_frame()["spread"] > 0).all())
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.effects.common import band, with_intervals
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import calibrate, remove_sink_attention
from massive_lens.metrics import as_hooks

INTACT, REMOVED = "sinks_intact", "sink_attention_removed"


@dataclass(frozen=True, kw_only=True)
class OverMixing(Result):
    """How far a small perturbation of one token spreads, per layer (see the module docstring).

    ``to_frame()``: one row per ``setting`` (``sinks_intact``, ``sink_attention_removed``) and
    ``layer``: ``spread`` (mean relative change of the later tokens' residual streams) and
    ``self_change`` (of the perturbed token), each with ``_low``/``_high`` (95% bootstrap over
    sequences), and ``n_seqs``. ``per_seq``: the same per ``seq``.
    """

    frame: pd.DataFrame
    per_seq: pd.DataFrame
    model_name: str
    pos: int
    scale: float
    seq_len: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        intact = self.frame[self.frame["setting"] == INTACT].set_index("layer")
        last = intact.index.max()
        text = (f"{self.model_name}, {int(intact['n_seqs'].iloc[0])} sequences of {self.seq_len} tokens: token "
                f"{self.pos}'s embedding moved by {self.scale:g} of its norm; at the last layer the later tokens "
                f"move by {intact.loc[last, 'spread']:.3g} of their norm (95% CI {intact.loc[last, 'spread_low']:.3g}-"
                f"{intact.loc[last, 'spread_high']:.3g}) with the sinks intact")
        removed = self.frame[self.frame["setting"] == REMOVED].set_index("layer")
        if len(removed):
            ratio = removed["spread"] / intact["spread"].reindex(removed.index)
            more = int((ratio > 1).sum())
            text += (f", {removed.loc[last, 'spread']:.3g} (95% CI {removed.loc[last, 'spread_low']:.3g}-"
                     f"{removed.loc[last, 'spread_high']:.3g}) with attention to the sinks removed: "
                     f"{ratio.loc[last]:.2f}x; more spread without the sinks in {more} of {len(ratio)} layers")
        return text

    def plot(self, ax: Any = None) -> Any:
        """Relative spread to later tokens per layer (log), one line per setting, with intervals."""
        ax = ensure_axes(ax, (7, 4))
        for name, rows in self.frame.groupby("setting", sort=False):
            band(ax, rows.sort_values("layer"), "spread", label=name)
        ax.set(xlabel="layer", ylabel="relative change of later tokens (log)", yscale="log",
               title=f"{self.model_name}: spread of a perturbation of token {self.pos}")
        ax.legend(fontsize=8)
        return ax


def _residuals(view: ModelView, tokens: Tensor, layers: list[int], hooks: list, nudge: Tensor | None,
               pos: int) -> dict[int, Tensor]:
    seen: dict[int, Tensor] = {}

    def keep(x: Tensor, hook: Any, *, layer: int) -> None:
        seen[layer] = x.detach().double().cpu()

    def push(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        x[:, pos] += (nudge.to(x.device) * x[:, pos].norm(dim=-1, keepdim=True)).to(x.dtype)
        return x

    first = [(view.hook_name(0, "resid_pre"), push)] if nudge is not None else []
    mine = [(view.hook_name(layer, "resid_post"), lambda x, hook, layer=layer: keep(x, hook, layer=layer))
            for layer in layers]
    view.forward(view.full_batch(tokens), first + hooks + mine, stop_after=view.hook_name(max(layers), "resid_post"))
    return seen


def _rows(setting: str, clean: dict[int, Tensor], moved: dict[int, Tensor], pos: int, seq0: int) -> list[dict]:
    rows = []
    for layer, base in clean.items():
        change = (moved[layer] - base).norm(dim=-1) / base.norm(dim=-1).clamp(min=1e-30)  # [batch pos]
        for b in range(len(base)):
            rows.append(dict(setting=setting, seq=seq0 + b, layer=layer, spread=float(change[b, pos + 1:].mean()),
                             self_change=float(change[b, pos])))
    return rows


def over_mixing(model: Any, text: Corpus = None, *, pos: int = 1, scale: float | int = 0.01,
                layers: int | Sequence[int] | None = None, seq_len: int = 128, n_seqs: int = 8, batch_size: int = 4,
                remove: bool = True, calibration: Any = None, seed: int = 0, hooks: Any = ()) -> OverMixing:
    """How far a perturbation of token ``pos``'s embedding spreads to the later tokens, per layer,
    with the sinks intact and with attention to them removed (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a corpus (a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token
            tensor; None: the offline default text), cut into ``n_seqs`` sequences of ``seq_len``.
        pos: the perturbed position (default 1, the first token after the first).
        scale: the perturbation's norm over the embedding's norm (default 0.01).
        layers: a layer or a sequence of layers (None: all).
        seq_len: tokens per sequence (default 128).
        n_seqs: sequences (default 8).
        batch_size: sequences per forward pass (default 4).
        remove: also measure with attention to the sinks removed (default True).
        calibration: where :func:`~massive_lens.interventions.remove_sink_attention` fits its sink
            rule (a corpus, None: the offline default text, or a ``Calibration``).
        seed: seed of the random direction (one direction per sequence).
        hooks: extra ``(hook_name, function)`` pairs (or an intervention) attached in every pass.

    Returns:
        An :class:`OverMixing`.

    Raises:
        MassiveLensError: if ``pos`` leaves no later token, ``scale`` is not a positive finite
            number, or ``layers`` / ``batch_size`` are invalid.

    >>> from massive_lens import tiny_model
    >>> mix = over_mixing(tiny_model("llama"), "a b c d e f " * 20, seq_len=24, n_seqs=2, layers=[0, 3], remove=False)
    >>> mix.to_frame()["layer"].tolist(), mix.pos
    ([0, 3], 1)
    """
    view = ModelView(model)
    chosen = view.chosen_layers(layers)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise MassiveLensError(f"scale must be a positive finite number, got {scale!r}")
    if batch_size < 1:
        raise MassiveLensError(f"batch_size must be >= 1, got {batch_size}")
    extra = as_hooks(hooks)
    tokens = sequences(view, text, seq_len, n_seqs)
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < tokens.shape[1] - 1:
        raise MassiveLensError(f"pos must be an integer in [0, {tokens.shape[1] - 2}] so that later tokens exist, "
                               f"got {pos!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MassiveLensError(f"seed must be an integer (the random direction's seed), got {seed!r}")
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(len(tokens), view.d_model, generator=gen, dtype=torch.float64)
    direction = direction / direction.norm(dim=-1, keepdim=True) * scale
    settings = [(INTACT, extra)]
    if remove:
        iv = remove_sink_attention(model, calibration=calibrate(model, calibration, progress=False))
        settings.append((REMOVED, extra + list(iv.fwd_hooks)))
    rows: list[dict] = []
    for name, setting_hooks in settings:
        for start in range(0, len(tokens), batch_size):
            chunk, nudge = tokens[start:start + batch_size], direction[start:start + batch_size]
            clean = _residuals(view, chunk, chosen, setting_hooks, None, pos)
            moved = _residuals(view, chunk, chosen, setting_hooks, nudge, pos)
            rows += _rows(name, clean, moved, pos, start)
    per_seq = pd.DataFrame(rows)
    frame = with_intervals(per_seq, ["setting", "layer"], ["spread", "self_change"])
    return OverMixing(frame=frame, per_seq=per_seq, model_name=view.name, pos=pos, scale=float(scale),
                      seq_len=int(tokens.shape[1]))
