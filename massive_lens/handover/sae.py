"""How well does a sparse autoencoder reconstruct the massive and sink positions?

An SAE trained on a model's residual stream sees, in every sequence, a first token (and
sometimes a few more positions) whose norm is hundreds of times the typical one: the massive
activations and attention sinks of :func:`~massive_lens.exclusion_mask`. A squared-error loss
then spends much of its budget there, and latents appear that fire only there.
:func:`sae_check` runs the model on a corpus, takes the activations at the SAE's hook, encodes
and decodes them with the SAE, and splits the reconstruction error by position: at massive
positions, at sinks, at all the positions the exclusion mask leaves out, and at the rest.

It works with a SAELens ``SAE`` (the hook name is read from ``sae.cfg.hook_name`` or
``sae.cfg.metadata.hook_name``, the width from ``sae.cfg.d_in``), or any object with
``encode``, ``decode`` and such a ``cfg``; sae-lens itself is never imported.

A tiny model whose first token carries 3,000 in dim 5, and a stand-in SAE whose error is a
tenth of each activation (so it grows with the norm):

>>> import torch
>>> from types import SimpleNamespace
>>> from massive_lens import tiny_model
>>> model = tiny_model("llama")
>>> with torch.no_grad():
...     model.W_E[model.tokenizer.bos_token_id, 5] = 3000.0
>>> d = model.cfg.d_model
>>> class TenthOffSAE:  # in practice a SAELens SAE
...     cfg = SimpleNamespace(d_in=d, hook_name="blocks.1.hook_resid_post")
...     def encode(self, x): return torch.cat([x, -x], -1).relu()
...     def decode(self, z): return 0.9 * (z[..., :d] - z[..., d:])
>>> check = sae_check(model, TenthOffSAE(), "Some text to read. " * 20, seq_len=16, n_seqs=2)
>>> round(check.error_share("excluded"), 3), check.to_frame()["group"].tolist()
(1.0, ['massive', 'sink', 'excluded', 'rest', 'all'])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, SinkRule
from massive_lens.core.fmt import num, pct
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.handover.masks import exclusion_mask

GROUPS = ("massive", "sink", "excluded", "rest", "all")
GROUP_COLUMNS = ["group", "n_positions", "position_share", "mse", "error_share", "fvu", "fvu_own", "rel_error"]
LATENT_COLUMNS = ["latent", "only", "fires_massive", "fires_sink", "fires_excluded", "mean_act"]


@dataclass(frozen=True, kw_only=True)
class SAECheck(Result):
    """An SAE's reconstruction error, split by position kind.

    ``to_frame()``: one row per ``group``: ``massive`` (positions with a token-specific
    massive activation), ``sink`` (attention sinks of the chosen levels), ``excluded``
    (either: :func:`~massive_lens.exclusion_mask`'s positions), ``rest`` (the others) and
    ``all``; massive and sink overlap (the first token is usually both). Columns:
    ``n_positions``, ``position_share``, ``mse`` (mean squared error per entry),
    ``error_share`` (the group's share of the total squared error), ``fvu`` (squared error
    over squared distance from the mean activation of *all* positions, so the groups'
    FVUs add up, weighted by variance, to the overall one), ``fvu_own`` (the same around the
    group's own mean: what an SAE evaluated on that group alone reports; NaN where the
    group's vectors are all alike, e.g. only first tokens) and ``rel_error`` (squared error
    over squared norm). ``latents``: the latents that fire (act > 0) only at excluded
    positions: ``only`` (``massive``, ``sink``, ``massive+sink``), position counts and the
    ``mean_act`` where they fire. ``sq_error``, ``massive``, ``sink``: per position
    ``[seq, pos]``. ``n_dead``: latents that never fire on the corpus.
    """

    groups: pd.DataFrame
    latents: pd.DataFrame
    sq_error: Float[Tensor, "seq pos"]
    massive: Bool[Tensor, "seq pos"]
    sink: Bool[Tensor, "seq pos"]
    model_name: str
    hook: str
    d_in: int
    d_sae: int
    n_dead: int
    levels: tuple[str, ...]

    def to_frame(self) -> pd.DataFrame:
        return self.groups.copy()

    def _row(self, group: str) -> Any:
        if group not in GROUPS:
            raise MassiveLensError(f"group must be one of {GROUPS}, got {group!r}")
        return self.groups.set_index("group").loc[group]

    def error_share(self, group: str = "excluded") -> float:
        """The share of the total squared error at one group's positions.

        Args:
            group: one of ``GROUPS`` (``massive``, ``sink``, ``excluded``, ``rest``, ``all``).

        Returns:
            The ``error_share`` column's value.

        Raises:
            MassiveLensError: for an unknown group.
        """
        return float(self._row(group)["error_share"])

    def fvu(self, group: str = "all") -> float:
        """The fraction of variance unexplained at one group's positions.

        Args:
            group: one of ``GROUPS``.

        Returns:
            The ``fvu`` column's value (around the mean of all positions).

        Raises:
            MassiveLensError: for an unknown group.
        """
        return float(self._row(group)["fvu"])

    def summary(self) -> str:
        ex, rest, every = self._row("excluded"), self._row("rest"), self._row("all")
        only = self.latents["only"].value_counts()
        kinds = ", ".join(f"{k} {c}" for k, c in only.items())
        n_seqs, seq_len = self.sq_error.shape
        return (f"{self.model_name}, SAE at {self.hook} ({self.d_sae} latents), {n_seqs} x {seq_len} "
                f"tokens: FVU {every.fvu:.4g} overall, {rest.fvu_own:.4g} on the kept positions (around their "
                f"own mean). The {int(ex.n_positions)} excluded positions ({pct(ex.position_share)}; massive "
                f"{int(self.massive.sum())}, {'/'.join(self.levels) or 'no'} sinks {int(self.sink.sum())}) carry "
                f"{pct(ex.error_share)} of the squared error (MSE {num(ex.mse)} vs {num(rest.mse)} elsewhere; "
                f"relative error {ex.rel_error:.3g} vs {rest.rel_error:.3g}). {self.n_dead} dead latents; "
                f"{len(self.latents)} fire only at excluded positions{f' ({kinds})' if kinds else ''}")

    def plot(self, ax: Any = None) -> Any:
        """Per group: its share of the positions and of the squared error."""
        ax = ensure_axes(ax, (6, 3.5), layout=None)
        f = self.groups[self.groups["group"] != "all"]
        x = torch.arange(len(f)).numpy()
        ax.bar(x - 0.2, f["position_share"], width=0.4, label="share of positions")
        ax.bar(x + 0.2, f["error_share"], width=0.4, label="share of squared error")
        ax.set_xticks(x, f["group"])
        ax.set(ylabel="share", title=f"{self.model_name}: SAE error at {self.hook}")
        ax.legend()
        return ax


def _config(sae: Any) -> tuple[str, int]:
    """The SAE's hook name and input width, from its config (sae-lens versions differ)."""
    if not (callable(getattr(sae, "encode", None)) and callable(getattr(sae, "decode", None))):
        raise MassiveLensError(f"sae must be a SAELens SAE (or any object with encode, decode and cfg); got a "
                               f"{type(sae).__name__} with no encode/decode. Load one with SAE.from_pretrained(...)")
    cfg = getattr(sae, "cfg", None)
    hook = getattr(cfg, "hook_name", None) or getattr(getattr(cfg, "metadata", None), "hook_name", None)
    if not isinstance(hook, str) or not hook:
        raise MassiveLensError(f"cannot tell which hook the {type(sae).__name__} reads: neither sae.cfg.hook_name nor "
                               "sae.cfg.metadata.hook_name is set; set it, e.g. sae.cfg.metadata.hook_name = "
                               "'blocks.6.hook_resid_post'")
    d_in = getattr(cfg, "d_in", None)
    if isinstance(d_in, bool) or not isinstance(d_in, int) or d_in < 1:
        raise MassiveLensError(f"the {type(sae).__name__}'s cfg.d_in (its input width) must be a positive int, "
                               f"got {d_in!r}")
    return hook, d_in


def sae_check(
    model: Any,
    sae: Any,
    corpus: Corpus = None,
    *,
    seq_len: int = 128,
    n_seqs: int = 8,
    levels: str | Sequence[str] = ("primary",),
    outliers: str = "exclude",
    criterion: Criterion | None = None,
    rule: SinkRule | None = None,
) -> SAECheck:
    """The SAE's reconstruction error at massive and sink positions against the rest (see
    the module docstring).

    Args:
        model: a TransformerLens-style model (left as found).
        sae: a SAELens ``SAE`` at one of ``model``'s hooks, or any object with ``encode``,
            ``decode`` and ``cfg.d_in`` and ``cfg.hook_name`` (or ``cfg.metadata.hook_name``).
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor,
            or None for the offline default text.
        seq_len: tokens per sequence read from a text corpus.
        n_seqs: sequences read from a text corpus.
        levels: as for :func:`~massive_lens.exclusion_mask`.
        outliers: as for :func:`~massive_lens.exclusion_mask`.
        criterion: as for :func:`~massive_lens.exclusion_mask`.
        rule: as for :func:`~massive_lens.exclusion_mask`.

    Returns:
        An :class:`SAECheck`: ``.to_frame()`` (one row per group), ``.latents``,
        ``.error_share(group)``, ``.fvu(group)``.

    Raises:
        MassiveLensError: for an object that is not an SAE, an SAE whose hook the model lacks
            or whose width is not the activation's, a reconstruction with NaN or inf, or what
            :func:`~massive_lens.exclusion_mask` refuses.
    """
    hook, d_in = _config(sae)
    view = ModelView(model)
    if hook not in view.hook_names:
        raise MassiveLensError(f"{view.name} has no hook {hook!r}, which the SAE reads: an SAE for another model "
                               f"kind or hook naming; see model.hook_dict for the hooks it has")
    tokens = sequences(view, corpus, seq_len, n_seqs)
    x = view.activation(view.full_batch(tokens), hook)
    x = x.flatten(2) if x.ndim > 3 else x  # hook_z: [seq pos head d_head] -> [seq pos head*d_head]
    if x.ndim != 3 or x.shape[-1] != d_in:
        raise MassiveLensError(f"the SAE takes d_in={d_in} but {view.name}'s {hook} gives {tuple(x.shape)}: an SAE "
                               "for another model or hook")
    param = next(iter(sae.parameters()), None) if callable(getattr(sae, "parameters", None)) else None
    errors, fires, act_sum = [], [], 0.0
    with torch.no_grad():  # the SAE first, the (costlier) exclusion mask once it has worked
        for s, row in enumerate(x):  # one sequence at a time: [pos d_in] -> [pos d_sae] stays small
            acts = sae.encode(row if param is None else row.to(param.device, param.dtype))
            if not isinstance(acts, torch.Tensor):
                raise MassiveLensError(f"the SAE's encode returned a {type(acts).__name__}, not a tensor of feature "
                                       "activations [pos, d_sae]; sae_check needs an SAE whose encode and decode "
                                       "take and give tensors (as sae-lens's do)")
            recon = sae.decode(acts).float().cpu()
            if recon.shape != row.shape or not bool(torch.isfinite(recon).all()):
                what = "holds NaN or inf" if recon.shape == row.shape else f"has shape {tuple(recon.shape)}"
                peak = num(float(row.abs().max()))
                raise MassiveLensError(f"the SAE's reconstruction of {hook} (sequence {s}) {what}, not finite "
                                       f"values of shape {tuple(row.shape)}; check its weights (torch.isfinite) and "
                                       f"that its dtype holds the activations (largest |x| {peak})")
            errors.append((recon - row).pow(2).sum(-1))
            acts = acts.float().cpu()
            fires.append(acts > 0)
            act_sum = act_sum + acts.clamp(min=0).sum(0)
    sq_error, fired = torch.stack(errors), torch.stack(fires)  # [seq pos], [seq pos d_sae]
    ex = exclusion_mask(model, tokens, levels=levels, outliers=outliers, criterion=criterion, rule=rule)
    frame = ex.to_frame()
    massive, sink = torch.zeros_like(ex.mask), torch.zeros_like(ex.mask)
    massive[frame.loc[frame["massive"], "seq"].tolist(), frame.loc[frame["massive"], "pos"].tolist()] = True
    sinks = frame[frame["level"] != ""]
    sink[sinks["seq"].tolist(), sinks["pos"].tolist()] = True
    masks = dict(massive=massive, sink=sink, excluded=ex.mask, rest=~ex.mask, all=torch.ones_like(ex.mask))
    return SAECheck(groups=_groups(x, sq_error, masks), latents=_latents(fired, masks, act_sum), sq_error=sq_error,
                    massive=massive, sink=sink, model_name=view.name, hook=hook, d_in=d_in, d_sae=int(fired.shape[-1]),
                    n_dead=int((~fired.flatten(0, 1).any(0)).sum()), levels=ex.levels)


def _div(a: float, b: float | int) -> float:
    return a / b if b > 0 else float("nan")


def _groups(x: Float[Tensor, "seq pos d"], sq_error: Float[Tensor, "seq pos"],
            masks: dict[str, Tensor]) -> pd.DataFrame:
    x = x.double()
    total, n_all = float(sq_error.double().sum()), x.shape[0] * x.shape[1]
    mean = x.flatten(0, 1).mean(0)
    rows = []
    for group in GROUPS:
        chosen, err = x[masks[group]], float(sq_error[masks[group]].double().sum())
        n = len(chosen)
        dev = float((chosen - mean).pow(2).sum()) if n else 0.0
        own = float((chosen - chosen.mean(0)).pow(2).sum()) if n > 1 else 0.0
        norm = float(chosen.pow(2).sum())
        own = own if own > 1e-9 * norm else 0.0  # all alike (e.g. only first tokens): no variance of their own
        rows.append((group, n, n / n_all, _div(err, n * x.shape[-1]), _div(err, total), _div(err, dev),
                     _div(err, own), _div(err, norm)))
    return pd.DataFrame(rows, columns=GROUP_COLUMNS)


def _latents(fired: Bool[Tensor, "seq pos d_sae"], masks: dict[str, Tensor], act_sum: Any) -> pd.DataFrame:
    count = {g: fired[masks[g]].sum(0) for g in ("massive", "sink", "excluded", "rest")}
    rows = []
    for latent in ((count["excluded"] > 0) & (count["rest"] == 0)).nonzero().flatten().tolist():
        n = int(count["excluded"][latent])  # where it fires at all: act_sum is over every position
        rows.append((latent, "+".join(g for g in ("massive", "sink") if int(count[g][latent])),
                     int(count["massive"][latent]), int(count["sink"][latent]), n, float(act_sum[latent]) / n))
    return pd.DataFrame(rows, columns=LATENT_COLUMNS)
