"""The off-switch protocol: on a model whose attention can switch off (a learned sink logit, sink
slots, an output gate), where does its idle attention go, and does its residual stream still grow
a massive activation?

:func:`offswitch` reports, per layer and side by side (issue 51):

- the **off-switch's own mass**: ``null_mass`` (the attention to the sink logit or slot,
  as :func:`~massive_lens.attention.null_mass.null_mass` reads it) or ``gate_shut`` (the share of output
  gates below 0.05, :func:`~massive_lens.attention.gates.gate_census`), NaN where the layer has
  none;
- the **first-token mass**: the mean attention of the queries after the first token to it
  (``first_mass``; a plain softmax head's usual parking place); ``null_head_max`` and
  ``first_head_max``: the largest head's of each (a sink is a few heads, the mean hides them);
- the **residual peak** at ``resid_post``: the largest ``|x|`` (``peak``, at ``peak_pos``,
  ``peak_dim``), its share of that token's norm (``top1_share``: near 1 for one massive dimension,
  small for broad growth), and how many tokens and dims pass the massive-activation rule
  (``massive_tokens``, ``massive_dims``; :class:`~massive_lens.core.criterion.Criterion`);
- ``full_attention``: whether the layer has softmax attention (a hybrid's linear-attention and
  state-space layers do not), so that a **pre-attention spike** (the hybrid paper's finding: the
  largest activations sit right before each full-attention layer) reads off the table:
  :attr:`OffSwitch.spikes_before_attention`;
- the **float16 verdict**: :func:`~massive_lens.handover.precision.precision_check` (measured in
  float32, confirmed by a float16 run) naming the first overflowing site; on a model not in
  float32 (gpt-oss-20b in bfloat16), predicted from the residual peaks alone and said so.

The first-token mass, the null slot's weight and the residual peaks come from one attention pass
(:func:`~massive_lens.core.attention_pass.attention_pass`, the first token's column, on the path
:func:`~massive_lens.core.attention_pass.choose_path` picks for the text's length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.gates import gate_census, gate_sites
from massive_lens.attention.null_mass import NullReader
from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.criterion import Criterion, as_criterion, massive_mask
from massive_lens.core.fmt import num
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.handover.precision import precision_check

COLUMNS = ["layer", "full_attention", "null_mass", "gate_shut", "first_mass", "null_head_max", "first_head_max",
           "peak", "peak_pos", "peak_dim", "top1_share", "massive_tokens", "massive_dims"]
SPECIFIC = 0.1  # massive at no more than this share of the tokens: token-specific, else an outlier dimension
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


@dataclass(frozen=True, kw_only=True)
class OffSwitch(Result):
    """The protocol's table (``to_frame()``: one row per layer, :data:`COLUMNS`) and verdicts:
    ``kind`` (the off-switch), ``idle`` (where idle attention goes: ``"sink slot"``, ``"first
    token"``, ``"output gate"`` or ``"neither"``), ``residual`` (what the peak is), ``float16``
    (``"safe"``, ``"unsafe"`` or ``"overflows"`` / ``"fits"`` when only predicted) and
    ``first_overflow`` (the first site past float16's range, "" if none)."""

    frame: pd.DataFrame
    kind: str
    idle: str
    residual: str
    float16: str
    first_overflow: str
    float16_how: str
    model_name: str
    n_texts: int

    @property
    def peak_layer(self) -> int:
        """The layer whose residual holds the largest ``|x|``."""
        return int(self.frame.loc[self.frame["peak"].idxmax(), "layer"])

    @property
    def spikes_before_attention(self) -> bool | None:
        """Whether the residual peaks right before a full-attention layer (its input, the previous
        layer's ``resid_post``) in a hybrid; None in a model where every layer is full attention."""
        full = self.frame["full_attention"].to_numpy()
        if full.all() or not full.any():
            return None
        return bool(self.peak_layer + 1 < len(full) and full[self.peak_layer + 1])

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame
        peak = f.loc[f["peak"].idxmax()]
        mass = (f"null mass {f['null_mass'].mean():.3f}" if f["null_mass"].notna().any() else
                f"gates shut {f['gate_shut'].mean():.1%}" if f["gate_shut"].notna().any() else "no off-switch")
        hybrid = self.spikes_before_attention
        lines = [f"{self.model_name}, {self.n_texts} text(s), off-switch: {self.kind or 'none'}",
                 f"  idle attention goes to: {self.idle} ({mass} against first-token mass {f['first_mass'].mean():.3f},"
                 f" means over heads and layers)",
                 f"  residual: {self.residual}: peak |x| = {num(peak.peak)} at layer {int(peak.layer)}, position "
                 f"{int(peak.peak_pos)}, dim {int(peak.peak_dim)}, {peak.top1_share:.0%} of that token's norm; "
                 f"{int(peak.massive_tokens)} token(s) and {int(peak.massive_dims)} dim(s) pass the rule there",
                 f"  float16: {self.float16.upper()}" + (f", first overflowing site {self.first_overflow}"
                                                          if self.first_overflow else "") + f" ({self.float16_how})"]
        if hybrid is not None:
            lines.append(f"  hybrid: the residual peaks {'right before' if hybrid else 'not right before'} a "
                         "full-attention layer")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Per layer: the off-switch's mass and the first-token mass (left axis), the residual peak (right)."""
        ax = ensure_axes(ax, size=(6, 3))
        f = self.frame
        for col, label in (("null_mass", "null mass"), ("gate_shut", "gates shut"), ("first_mass", "first token")):
            if f[col].notna().any():
                ax.plot(f["layer"], f[col], marker="o", label=label)
        ax.set(xlabel="layer", ylabel="share", ylim=(0, 1), title=f"{self.model_name}: off-switch protocol")
        ax.legend(loc="upper left")
        twin = ax.twinx()
        twin.semilogy(f["layer"], f["peak"], color="grey", linestyle="--")
        twin.set_ylabel("largest |x|")
        return ax


def offswitch(model: Any, text: str | Sequence[str] | Tensor, *, criterion: Any = None,
              precision: bool = True) -> OffSwitch:
    """Run the off-switch protocol (module docstring) on ``model``.

    Args:
        model: a TransformerLens-style model or an nnsight-wrapped one (any attention: without an
            off-switch the table has NaN there and idle attention can only go to tokens).
        text: a string, a list of strings or a token tensor.
        criterion: the massive-activation rule (None: the default ``Criterion()``).
        precision: run :func:`precision_check` for the float16 verdict (float32 models only; else,
            and when False, the verdict is predicted from the residual peaks).

    Returns:
        An :class:`OffSwitch`.

    Raises:
        MassiveLensError: as the analyses it runs (an empty or too long text, a bad criterion).

    >>> from massive_lens import tiny_model
    >>> result = offswitch(tiny_model("gpt_oss"), "Hello world. Bye now.", precision=False)
    >>> result.kind, result.float16
    ('sink logit (s_aux)', 'fits')
    """
    crit = Criterion() if criterion is None else as_criterion(criterion)
    view = ModelView(model)
    batch = view.tokenize(text)
    nulls = NullReader(view)  # the null slot's weight, read in the same pass
    gate_kind, gated = gate_sites(view)
    gates = gate_census(model, text).to_frame() if gated else None
    first, resid = _one_pass(view, batch, crit, nulls)
    sums, n = nulls.head_sums(batch.mask)
    rows = []
    for layer in range(view.n_layers):
        heads = sums[layer] / n.clamp(min=1) if layer in sums else None  # the null mass per head
        rows.append(dict(
            layer=layer, full_attention=layer in first,
            null_mass=math.nan if heads is None else float(heads.mean()),
            gate_shut=(float(gates[gates.layer == layer].shut_share.mean())
                       if gates is not None and layer in gated else math.nan),
            first_mass=first.get(layer, (math.nan, math.nan))[0],
            null_head_max=math.nan if heads is None else float(heads.max()),
            first_head_max=first.get(layer, (math.nan, math.nan))[1], **resid[layer]))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    idle = _idle(frame)
    peak = frame.loc[frame["peak"].idxmax()]
    share = peak.massive_tokens / max(int(batch.mask.sum()), 1)
    residual = ("no massive activation (broad growth)" if peak.massive_tokens == 0 else
                "token-specific massive activation" if share <= SPECIFIC
                else "massive on many tokens (outlier dimension)")
    verdict, first_site, how = _float16(model, view, batch, frame, precision)
    return OffSwitch(frame=frame, kind=nulls.kind or gate_kind, idle=idle, residual=residual, float16=verdict,
                     first_overflow=first_site, float16_how=how, model_name=view.name, n_texts=len(batch.tokens))


def _one_pass(view: ModelView, batch: Any, crit: Criterion, nulls: NullReader
              ) -> tuple[dict[int, tuple[float, float]], dict[int, dict[str, float]]]:
    """One attention pass (:func:`~massive_lens.core.attention_pass.attention_pass`, on
    :func:`~massive_lens.core.attention_pass.choose_path`'s path): per layer with softmax attention the mean
    and the largest over heads of the real queries' (after the first token) attention to the first token,
    the null weight into ``nulls``, and per layer the residual peak (:func:`_residual`), in the same forward."""
    after = batch.mask.float().clone()
    after[:, 0] = 0.0
    first: dict[int, tuple[float, float]] = {}
    resid: dict[int, dict[str, float]] = {}

    def take(at: PassLayer) -> None:
        w = after.to(at.cols.device)
        per_head = torch.einsum("bhq,bq->h", at.cols[..., 0].float(), w) / w.sum().clamp(min=1)
        first[at.layer] = (float(per_head.mean()), float(per_head.max()))
        nulls.take(at)

    hooks = [(view.hook_name(layer, "resid_post"), partial(_residual, valid=batch.mask, crit=crit, out=resid,
                                                           layer=layer)) for layer in range(view.n_layers)]
    # every layer with attention as the pass reads it (the null slots' layers among them)
    attention_pass(view, batch, take, path=choose_path(view, "auto", batch), columns=[0], **nulls.reads, hooks=hooks)
    return first, resid


def _residual(x: Tensor, hook: Any, *, valid: Tensor, crit: Criterion, out: dict[int, dict[str, float]],
              layer: int) -> None:
    """One layer's ``resid_post``: the peak, its place, its share of its token's norm and how many
    tokens and dims pass ``crit``."""
    x = x.detach().float()
    mag = x.abs() * valid.to(x.device)[..., None]
    flat = int(mag.argmax())
    b, p, d = torch.unravel_index(torch.tensor(flat), mag.shape)
    token_norm = float(x[b, p].norm())
    massive = massive_mask(x, crit, valid.to(x.device))
    out[layer] = dict(peak=float(mag[b, p, d]), peak_pos=int(p), peak_dim=int(d),
                      top1_share=float(mag[b, p, d]) / token_norm if token_norm > 0 else math.nan,
                      massive_tokens=int(massive.any(-1).sum()), massive_dims=int(massive.any(0).any(0).sum()))


def _idle(frame: pd.DataFrame) -> str:
    """Where idle attention goes: the larger of the largest head's slot mass and first-token mass,
    where either passes 0.3 (Gu et al.'s threshold); an output gate shut for most tokens and heads
    of some layer is the gate."""
    null, first, gate = (frame[c].max() for c in ("null_head_max", "first_head_max", "gate_shut"))
    null, first, gate = (0.0 if math.isnan(v) else float(v) for v in (null, first, gate))
    if gate > 0.5 and gate >= max(null, first):
        return "output gate"
    if max(null, first) <= 0.3:
        return "neither"
    return "sink slot" if null >= first else "first token"


def _float16(model: Any, view: ModelView, batch: Any, frame: pd.DataFrame, precision: bool) -> tuple[str, str, str]:
    """The float16 verdict, the first overflowing site, and how the verdict was reached."""
    if precision and view.dtype == torch.float32:
        tokens = batch.tokens if bool(batch.mask.all()) else batch.tokens[:1, : int(batch.mask[0].sum())]
        check = precision_check(model, tokens.cpu(), dtypes=("float16",), seq_len=tokens.shape[1],
                                n_seqs=tokens.shape[0])
        return check.verdict("float16"), check.first_overflow("float16"), "precision_check: measured in float32, " \
            "confirmed by a float16 run"
    over = frame[frame["peak"] > FLOAT16_MAX]
    site = "" if over.empty else (f"{ModelView.block_hook(int(over.iloc[0].layer), 'resid_post')} "
                                  f"(|x| = {num(over.iloc[0].peak)})")
    why = "not float32" if precision else "precision=False"
    return ("overflows" if site else "fits"), site, (f"predicted from the residual peaks ({why}; float16's largest "
                                                     f"value is {num(FLOAT16_MAX)}), not confirmed by a float16 run")
