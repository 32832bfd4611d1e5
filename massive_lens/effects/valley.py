"""The compression valley: where the first token's norm explodes, the representations collapse.

Queipo-de-Llano et al. (2025, "Attention Sinks and Compression Valleys") find that in the
layers where the first token's residual norm explodes, the **matrix entropy** of the token
representations drops (the sequence's residual stream is nearly rank one: the massive
first token dominates it) and the **sink rate** rises, in the same layers, from 410M to 120B
parameters. Their causal claim: remove the massive activation and the valley goes away.

:func:`compression_valley` measures all three per layer over a corpus, with 95% bootstrap
intervals over sequences:

- ``entropy``: the matrix entropy of one sequence's residual stream ``X`` (``[pos, d_model]``,
  ``hook_resid_post``), centered over positions: with ``s`` the singular values of the centered
  ``X`` and ``p = s^2 / sum(s^2)`` (the eigenvalues of the normalized Gram matrix),
  ``H = -sum p log p / log(min(pos, d_model))``, in ``[0, 1]``: 1 when every direction carries
  the same variance, 0 for rank one (:func:`matrix_entropy`);
- ``first_norm``: the first token's residual norm, and ``first_norm_ratio``: that over the
  median norm of the other tokens;
- ``sink_rate``: the sink metric of Gu et al. per layer: the share of the layer's heads whose
  mean attention to the first token (over the first 64 queries) exceeds 0.3.

With ``ablate="zero_every"`` (the default) it measures the same again with the massive
activations set to zero at every layer where they are massive (the ``every`` form of
:func:`~massive_lens.interventions.ablate_massive`, calibrated on ``calibration``), so the two
curves answer the paper's question in one figure.

The summary says plainly whether the valley is there (:func:`valley_layers`: middle layers
whose entropy is more than ``ENTROPY_TIE`` below both the first and the last layer measured)
and whether the first-token norm peaks inside it; it names a near-tie for the lowest entropy
(layers within ``ENTROPY_TIE`` of each other) as such instead of picking one layer of it.

>>> import torch
>>> x = torch.zeros(8, 6); x[:4, 0] = 1.0; x[4:, 0] = -1.0
>>> round(matrix_entropy(x), 6)
0.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import first_norm_ratio, first_token_mass, sink_metric
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.effects.common import band, with_intervals
from massive_lens.errors import MassiveLensError
from massive_lens.interventions import REGISTRY, calibrate
from massive_lens.metrics import as_hooks

METRICS = ("entropy", "first_norm", "first_norm_ratio", "sink_rate")
ORIGINAL = "original"
# layers whose mean matrix entropy is within this of each other are a near-tie (entropy is in [0, 1])
ENTROPY_TIE = 0.01


def matrix_entropy(x: Float[Tensor, "pos d_model"]) -> float:
    """Normalized matrix entropy of ``x`` centered over positions (see the module docstring).

    Args:
        x: one sequence's representations, ``[pos, d_model]`` with ``pos >= 2``.

    Returns:
        ``-sum p log p / log(min(pos, d_model))`` with ``p`` the normalized squared singular
        values; 0 for a centered input that is all zero. The squared singular values are the
        eigenvalues of the smaller Gram matrix (``pos x pos`` or ``d_model x d_model``, float64),
        its round-off's negative ones taken as 0: a quarter of an SVD's time on a
        ``[128, 576]`` layer, within 2e-14 of the SVD's entropy.

    >>> import torch
    >>> x = torch.zeros(8, 4)
    >>> x[:, 0], x[:, 1] = torch.tensor([1.0, -1.0] * 4), torch.tensor([1.0, 1.0, -1.0, -1.0] * 2)
    >>> matrix_entropy(x)  # two orthogonal directions of equal variance: log 2 / log 4
    0.5
    """
    if x.ndim != 2 or x.shape[0] < 2:
        raise MassiveLensError(f"matrix_entropy needs [pos, d_model] with pos >= 2, got {tuple(x.shape)}")
    centered = x.double() - x.double().mean(0, keepdim=True)
    gram = centered @ centered.T if centered.shape[0] <= centered.shape[1] else centered.T @ centered
    s2 = torch.linalg.eigvalsh(gram).clamp(min=0.0)
    total = s2.sum()
    if total <= 0:
        return 0.0
    p = s2[s2 > 0] / total
    return max(0.0, float(-(p * p.log()).sum() / math.log(min(x.shape))))


@dataclass(frozen=True, kw_only=True)
class CompressionValley(Result):
    """Matrix entropy, first-token norm and sink rate per layer, with and without the massive
    activations (see the module docstring).

    ``to_frame()``: one row per ``setting`` (``original``, and the ablation, e.g.
    ``zero_every``) and ``layer``: ``entropy``, ``first_norm``, ``first_norm_ratio``,
    ``sink_rate``, each with ``<metric>_low`` and ``<metric>_high`` (95% bootstrap interval
    over sequences), and ``n_seqs``. ``per_seq``: the same metrics per ``seq``.
    """

    frame: pd.DataFrame
    per_seq: pd.DataFrame
    model_name: str
    seq_len: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def setting(self, name: str) -> pd.DataFrame:
        """The rows of one setting, by layer.

        Args:
            name: ``"original"`` or the ablation's name (e.g. ``"zero_every"``).

        Returns:
            The rows of ``to_frame()`` of that setting, sorted by layer.
        """
        return self.frame[self.frame["setting"] == name].sort_values("layer")

    def summary(self) -> str:
        orig = self.setting(ORIGINAL)
        low = orig.loc[orig["entropy"].idxmin()]
        peak = orig.loc[orig["first_norm"].idxmax()]
        lines = [f"{self.model_name}, {int(orig['n_seqs'].iloc[0])} sequences of {self.seq_len} tokens: "
                 f"matrix entropy {_lowest(orig)} (first layer {orig['entropy'].iloc[0]:.3f}, last "
                 f"{orig['entropy'].iloc[-1]:.3f}); first-token norm peaks at layer {int(peak['layer'])} "
                 f"({peak['first_norm']:.1f}, {peak['first_norm_ratio']:.1f}x the median token); sink rate "
                 f"{orig['sink_rate'].max():.0%} at most (layer {int(orig.loc[orig['sink_rate'].idxmax(), 'layer'])})",
                 _verdict(orig)]
        for name in self.frame["setting"].unique():
            if name == ORIGINAL:
                continue
            other = self.setting(name)
            at = other[other["layer"] == low["layer"]].iloc[0]
            lines.append(f"with {name}: entropy at layer {int(low['layer'])} {at['entropy']:.3f} (95% CI "
                         f"{at['entropy_low']:.3f}-{at['entropy_high']:.3f}), lowest {other['entropy'].min():.3f}; "
                         f"first-token norm at most {other['first_norm'].max():.1f}; sink rate at most "
                         f"{other['sink_rate'].max():.0%}; valley {_presence(valley_layers(other))}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Entropy and sink rate (left axis) and first-token norm (right axis, log) per layer,
        one color per setting, with 95% intervals."""
        ax = ensure_axes(ax, (8, 4.5))
        right = ax.twinx()
        for i, name in enumerate(self.frame["setting"].unique()):
            rows, color = self.setting(name), f"C{i}"
            band(ax, rows, "entropy", color=color, label=f"{name}: matrix entropy")
            band(ax, rows, "sink_rate", color=color, ls=":", label=f"{name}: sink rate")
            band(right, rows, "first_norm", color=color, ls="--", label=f"{name}: first-token norm")
        ax.set(xlabel="layer", ylabel="matrix entropy, sink rate", ylim=(0, 1.05),
               title=f"{self.model_name}: compression valley")
        right.set(ylabel="first-token residual norm (log)", yscale="log")
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="lower left")
        return ax


def valley_layers(rows: pd.DataFrame, tol: float = ENTROPY_TIE) -> list[int]:
    """The compression valley of one setting's rows (``layer``, ``entropy``): the middle layers
    (neither the first nor the last one measured) whose mean matrix entropy is more than
    ``tol`` below both ends'. Empty: no valley (or fewer than three layers measured).

    >>> valley_layers(pd.DataFrame(dict(layer=[0, 1, 2, 3], entropy=[0.7, 0.2, 0.695, 0.6])))
    [1]
    """
    rows = rows.sort_values("layer")
    if len(rows) < 3:
        return []
    floor = min(rows["entropy"].iloc[0], rows["entropy"].iloc[-1]) - tol
    middle = rows.iloc[1:-1]
    return [int(x) for x in middle.loc[middle["entropy"] < floor, "layer"]]


def _layers(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 6 else f"{layers[0]}-{layers[-1]} ({len(layers)} layers)"


def _presence(layers: list[int]) -> str:
    return f"present (layers {_layers(layers)})" if layers else "absent"


def _lowest(rows: pd.DataFrame) -> str:
    """Where the entropy is lowest; on a near-tie (several layers within ``ENTROPY_TIE``) all of them."""
    low = rows.loc[rows["entropy"].idxmin()]
    tied = rows[rows["entropy"] <= low["entropy"] + ENTROPY_TIE].sort_values("layer")
    if len(tied) == 1:
        return (f"lowest at layer {int(low['layer'])} ({low['entropy']:.3f}, 95% CI {low['entropy_low']:.3f}-"
                f"{low['entropy_high']:.3f})")
    return (f"lowest at {len(tied)} layers within {ENTROPY_TIE:g} of each other, a near-tie: layers "
            f"{_layers(tied['layer'].astype(int).tolist())} ({tied['entropy'].min():.3f}-{tied['entropy'].max():.3f})")


def _verdict(rows: pd.DataFrame) -> str:
    """Whether the paper's compression valley (Queipo-de-Llano et al.: a minimum of matrix entropy
    in middle layers, where the first token's norm explodes) is present on this model."""
    rows = rows.sort_values("layer")
    if len(rows) < 3:
        return "compression valley: too few layers measured to tell (need the first, a middle and the last)"
    valley = valley_layers(rows)
    ends = f"the first measured layer ({rows['entropy'].iloc[0]:.3f}) and the last ({rows['entropy'].iloc[-1]:.3f})"
    if not valley:
        return (f"compression valley (the paper's claim): NOT present on this model: no middle layer's matrix "
                f"entropy is more than {ENTROPY_TIE:g} below both {ends}")
    peak = int(rows.loc[rows["first_norm"].idxmax(), "layer"])
    where = (f"and the first-token norm peaks inside it (layer {peak}): the claim holds" if peak in valley else
             f"but the first-token norm peaks outside it (layer {peak}): the valley is not where the norm explodes")
    return (f"compression valley (the paper's claim): present on this model: matrix entropy more than "
            f"{ENTROPY_TIE:g} below both {ends} at layers {_layers(valley)}, {where}")


def _measure(view: ModelView, tokens: Tensor, layers: list[int], extra: list, setting: str,
             batch_size: int) -> list[dict[str, Any]]:
    """The rows of ``setting``: one attention pass per chunk with ``extra`` run in it, on the path
    :func:`~massive_lens.core.attention_pass.choose_path` takes with them (the eager pattern where they
    edit the attention), reading each layer's first-token column and residual stream."""
    rows: list[dict[str, Any]] = []
    for start in range(0, len(tokens), batch_size):
        batch = view.full_batch(tokens[start:start + batch_size])
        attention_pass(view, batch, partial(_layer_rows, rows=rows, setting=setting, seq0=start),
                       path=choose_path(view, "auto", batch, hooks=extra), columns=[0], want=("out",), layers=layers,
                       out_hooks={layer: "resid_post" for layer in layers}, hooks=extra,
                       stop_after=view.hook_name(max(layers), "resid_post"))
    return rows


def _layer_rows(at: PassLayer, *, rows: list[dict[str, Any]], setting: str, seq0: int) -> None:
    """A layer's rows, as soon as it has run: ``at.cols`` the attention on the first token, ``at.out``
    the residual stream after the layer."""
    masses, resid = first_token_mass_per_seq(at.cols), at.out.detach().float().cpu()
    norms = resid.norm(dim=-1)
    ratios = first_norm_ratio(norms)
    for b in range(len(resid)):
        rows.append(dict(setting=setting, seq=seq0 + b, layer=at.layer, entropy=matrix_entropy(resid[b]),
                         first_norm=float(norms[b, 0]), first_norm_ratio=float(ratios[b]),
                         sink_rate=sink_metric(masses[b])))


def first_token_mass_per_seq(pattern: Float[Tensor, "batch head_index query_pos key_pos"]) -> Tensor:
    """Per sequence and head, the mean attention to the first token over the first 64 queries (``pattern``:
    the attention, or its columns from the first token's on)."""
    return torch.stack([first_token_mass(pattern[b:b + 1]) for b in range(len(pattern))]).float().cpu()



def compression_valley(model: Any, corpus: Corpus = None, *, layers: int | Sequence[int] | None = None,
                       seq_len: int = 256, n_seqs: int = 8, batch_size: int = 4, ablate: str | None = "zero_every",
                       calibration: Any = None, hooks: Any = ()) -> CompressionValley:
    """Per layer: matrix entropy, first-token norm and sink rate over a corpus, with and without
    the massive activations (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor, or
            None for the offline default text.
        layers: a layer or a sequence of layers (None: all).
        seq_len: tokens per sequence (BOS included; default 256), for text input.
        n_seqs: sequences (default 8), for text input.
        batch_size: sequences per forward pass (default 4).
        ablate: the intervention setting measured beside the original (a name in
            :data:`~massive_lens.interventions.REGISTRY`; default ``"zero_every"``), or None
            for the original only.
        calibration: where the ablation finds the massive activations: a corpus (None: the
            offline default text) or a :class:`~massive_lens.interventions.Calibration`;
            use other text than ``corpus``.
        hooks: extra ``(hook_name, function)`` pairs (or an intervention) attached in every
            pass, before the ablation.

    Returns:
        A :class:`CompressionValley`.

    Raises:
        MassiveLensError: for an unknown ``ablate`` setting, one that needs massive activations
            when the calibration text has none, bad ``layers``, ``batch_size`` below 1, or a
            corpus too short for one sequence.

    >>> from massive_lens import tiny_model
    >>> valley = compression_valley(tiny_model("llama"), "a b c d e f " * 40, seq_len=32, n_seqs=2, ablate=None)
    >>> sorted(valley.to_frame()["layer"].unique().tolist()), bool(valley.to_frame()["entropy"].between(0, 1).all())
    ([0, 1, 2, 3], True)
    """
    view = ModelView(model)
    chosen = view.chosen_layers(layers)
    if batch_size < 1:
        raise MassiveLensError(f"batch_size must be >= 1, got {batch_size}")
    if ablate is not None and ablate not in REGISTRY:
        raise MassiveLensError(f"unknown ablate setting {ablate!r}; choose one of {sorted(REGISTRY)} or None")
    extra = as_hooks(hooks)
    tokens = sequences(view, corpus, seq_len, n_seqs)
    rows = _measure(view, tokens, chosen, extra, ORIGINAL, batch_size)
    if ablate is not None:
        calib = calibrate(model, calibration, progress=False)
        iv = REGISTRY[ablate].build(model, calib)
        rows += _measure(view, tokens, chosen, extra + list(iv.fwd_hooks), ablate, batch_size)
    per_seq = pd.DataFrame(rows)
    frame = with_intervals(per_seq, ["setting", "layer"], METRICS)
    return CompressionValley(frame=frame, per_seq=per_seq, model_name=view.name, seq_len=int(tokens.shape[1]))
