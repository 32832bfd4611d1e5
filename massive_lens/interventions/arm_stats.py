"""The controls of zero ablation: what the ``resample``, ``noise`` and ``template`` arms take
from calibration, and how they draw the values they write.

Zeroing a massive activation tests more than "does the model need this value": it also
moves the residual stream far from anything the model has seen, so the loss it causes can
come from the shock alone. Vision transformers show how much that matters: zeroing their
register tokens costs up to 36.6 points, while replacing them with the mean, matched noise or
another input's registers costs about one (arXiv 2604.14433). Beside ``zero`` and ``mean``,
:func:`~massive_lens.interventions.ablate_massive` therefore has three more arms, each
measured on calibration text (never the evaluation text):

- ``resample``: each massive entry takes a value that the same dim had at the same layer in
  a calibration sequence, at a token of the same kind (``bos``, ``first``, ``delimiter``,
  ``other``); the pool is every token-specific massive entry of the calibration text;
- ``noise``: each takes a draw of a Gaussian with that dim's calibration mean and variance
  at that layer (over its massive entries);
- ``template``: the spike is clamped (set to zero, as ``zero`` does) and every later norm's
  output at the targeted positions is set to the calibrated *post-norm vector* of the
  spike-carrying tokens (the mean over calibration positions that carried a massive
  activation before that layer). Spike-carrying tokens normalise to nearly constant vectors
  (arXiv 2606.02288), so this restores what the layers read while the value itself is gone:
  on a first-token sink, whose vectors are identical across inputs, it is the untouched model.

The draws use a seeded generator (``seed``), so a table is reproducible.

>>> pool = torch.tensor([[0, 0, 0, 5, 100.0], [0, 1, 0, 5, 120.0], [0, 0, 2, 5, -3.0]])
>>> draw = Resample(pool, layer=0, dims=[5], seed=0, kinds=torch.zeros(2, 3, dtype=torch.long))
>>> values = draw((2, 3))
>>> sorted(set(values.flatten().tolist())) <= [100.0, 120.0]
True
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.core.fmt import ratio
from massive_lens.core.tokens import TOKEN_KINDS

ARMS = ("resample", "noise", "template")
POOL_COLUMNS = ("layer", "seq", "kind", "dim", "value")  # the columns of Calibration.pool
FINAL = "final"  # the template row of the final norm (index n_layers)
NORMS = ("ln1.hook_out", "ln2.hook_out")  # the template's two columns per block


def empty_pool() -> Tensor:
    return torch.zeros(0, len(POOL_COLUMNS), dtype=torch.float64)


def build_pool(entries: Tensor, kinds: Tensor) -> Tensor:
    """The resample pool: ``entries`` rows (layer, seq, pos, dim, value) with each position's token
    kind (``kinds [seq pos]``) in place of the position."""
    if not len(entries):
        return empty_pool()
    kind = kinds[entries[:, 1].long(), entries[:, 2].long()].double()
    return torch.stack([entries[:, 0], entries[:, 1], kind, entries[:, 3], entries[:, 4]], 1)


def fallback_kinds(batch: int, pos: int) -> Tensor:
    """Token kinds when none are given: the first token ``bos``, the rest ``other`` (a draw whose
    kind is missing from the pool falls back to the first token's kinds or any kind)."""
    kinds = torch.full((batch, pos), TOKEN_KINDS.index("other"), dtype=torch.long)
    kinds[:, 0] = TOKEN_KINDS.index("bos")
    return kinds


class Resample:
    """A draw for ``resample``: ``draw((batch, pos))`` gives ``[batch pos n_dims]`` values, each
    taken from the pool's entries of that dim at ``layer`` and the position's token kind (``kinds
    [batch pos]`` of the tokens it runs on; None or another shape: :func:`fallback_kinds`; the
    first-token kinds ``bos``/``first`` stand in for each other, then any kind)."""

    def __init__(self, pool: Tensor, *, layer: int, dims: Sequence[int], seed: int, fallback: Tensor | None = None,
                 kinds: Tensor | None = None):
        self.gen, self.kinds = torch.Generator().manual_seed(seed), kinds
        self.values: list[dict[int, Tensor]] = []
        firsts = {TOKEN_KINDS.index("bos"), TOKEN_KINDS.index("first")}
        for j, dim in enumerate(dims):
            rows = pool[(pool[:, 0] == layer) & (pool[:, 3] == dim)]
            every = rows[:, 4].float()
            if not len(every):  # no token-specific entry (should not happen): the calibration mean
                every = fallback[j:j + 1].float() if fallback is not None else torch.zeros(1)
            by_kind: dict[int, Tensor] = {-1: every}
            for k in range(len(TOKEN_KINDS)):
                group = rows[rows[:, 2] == k][:, 4].float()
                if not len(group) and k in firsts:
                    group = rows[torch.isin(rows[:, 2].long(), torch.tensor(sorted(firsts)))][:, 4].float()
                by_kind[k] = group if len(group) else every
            self.values.append(by_kind)

    def __call__(self, shape: tuple[int, int]) -> Float[Tensor, "batch pos n_dims"]:
        given = self.kinds is not None and tuple(self.kinds.shape) == tuple(shape)
        kinds = self.kinds.cpu() if given else fallback_kinds(*shape)
        out = torch.zeros(*shape, len(self.values))
        for j, by_kind in enumerate(self.values):
            for k in kinds.unique().tolist():
                where = kinds == k
                group = by_kind.get(int(k), by_kind[-1])
                pick = torch.randint(len(group), (int(where.sum()),), generator=self.gen)
                out[..., j][where] = group[pick]
        return out


class Noise:
    """A draw for ``noise``: ``mean + std * N(0, 1)`` per dim, ``[batch pos n_dims]``."""

    def __init__(self, mean: Tensor, var: Tensor, *, seed: int):
        self.mean, self.std = mean.float(), var.float().clamp(min=0).sqrt()
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, shape: tuple[int, int]) -> Float[Tensor, "batch pos n_dims"]:
        return self.mean + self.std * torch.randn(*shape, len(self.mean), generator=self.gen)


class TemplateTally:
    """The template's calibration, reduced in the hooks: per block norm (``ln1``/``ln2``
    output) and the final norm, the sum of the output vectors at positions that carried a
    token-specific massive activation at an earlier ``resid_post``, and their count."""

    def __init__(self, n_layers: int, d_model: int):
        self.n_layers = n_layers
        self.sums = torch.zeros(n_layers + 1, len(NORMS), d_model, dtype=torch.float64)
        self.counts = torch.zeros(n_layers + 1, len(NORMS), dtype=torch.float64)
        self.carried: Tensor | None = None

    def start(self, mask: Bool[Tensor, "batch pos"]) -> None:
        """A new chunk: nothing carried yet; ``mask`` the real positions."""
        self.mask, self.carried = mask.cpu(), torch.zeros_like(mask, dtype=torch.bool).cpu()

    def carry(self, specific: Bool[Tensor, "batch pos d_model"]) -> None:
        """After a ``resid_post``: positions with a token-specific massive entry carry one from now on."""
        self.carried |= specific.any(-1).cpu() & self.mask

    def hooks(self, view: Any) -> list[tuple[str, Any]]:
        out = [(view.block_hook(layer, name), partial(self._add, row=layer, col=col))
               for layer in range(1, self.n_layers) for col, name in enumerate(NORMS) if view.has_hook(layer, name)]
        return out + final_norm_hooks(view, partial(self._add, row=self.n_layers, col=0))

    def _add(self, act: Tensor, hook: Any, *, row: int, col: int) -> None:
        where = self.carried.to(act.device)
        if bool(where.any()) and act.shape[:2] == where.shape:
            self.sums[row, col] += act.detach()[where].double().sum(0).cpu()
            self.counts[row, col] += float(where.sum())

    def template(self) -> Float[Tensor, "layer_plus_final norm d_model"]:
        """The mean output vectors; zero where no carrying position was seen (see :meth:`seen`)."""
        return (self.sums / self.counts.clamp(min=1)[..., None]).float()

    def seen(self) -> Bool[Tensor, "layer_plus_final norm"]:
        """Where the template was measured (a carrying position passed that norm)."""
        return self.counts > 0


def template_hooks(view: Any, template: Tensor, seen: Tensor, *, after: int, put: Any) -> list[tuple[str, Any]]:
    """The hooks that set the norms' outputs of every layer after ``after`` (and the final norm)
    to ``template`` at the targeted positions, where the template was measured (``seen``)."""
    n_layers = template.shape[0] - 1
    out = []
    for layer in range(after + 1, n_layers):
        for col, name in enumerate(NORMS):
            if view.has_hook(layer, name) and bool(seen[layer, col]):
                out.append((view.block_hook(layer, name), partial(put, vector=template[layer, col])))
    if bool(seen[n_layers, 0]):
        out += final_norm_hooks(view, partial(put, vector=template[n_layers, 0]))
    return out


class _AfterLastBlock:
    """Opens after the last block's ``resid_post``, closes once ``fn`` has run on the final norm's output."""

    def __init__(self, fn: Any):
        self.fn, self.open = fn, False

    def shut(self, act: Tensor, hook: Any) -> None:
        self.open = False

    def opens(self, act: Tensor, hook: Any) -> None:
        self.open = True

    def final(self, act: Tensor, hook: Any) -> Tensor | None:
        if not self.open:  # the final norm run before the blocks (NanoChat's normalized embeddings)
            return None
        self.open = False
        return self.fn(act, hook)


def final_norm_hooks(view: Any, fn: Any) -> list[tuple[str, Any]]:
    """Hooks that run ``fn`` on ``ln_final.hook_out`` only where the final norm reads the last
    block's output: NanoChat also runs its final norm on the embeddings, before block 0, and a
    hook there must not edit them. None when the model has no ``ln_final.hook_out``.

    >>> from massive_lens import tiny_model
    >>> from massive_lens.core.model_view import ModelView
    >>> names = [name for name, _ in final_norm_hooks(ModelView(tiny_model("llama")), lambda act, hook: act)]
    >>> names[0], names[-1]
    ('hook_embed', 'ln_final.hook_out')
    """
    if "ln_final.hook_out" not in view.hook_names:
        return []
    gate = _AfterLastBlock(fn)
    start = [("hook_embed", gate.shut)] if "hook_embed" in view.hook_names else []
    return [*start, (view.hook_name(view.n_layers - 1, "resid_post"), gate.opens), ("ln_final.hook_out", gate.final)]


def arm_fill(calib: Any, mode: str, layer: int, dims: Sequence[int], *, seed: int,
             kinds: Tensor | None = None) -> Tensor | Resample | Noise:
    """What ``mode`` writes into ``dims`` at ``layer``: the calibration means (``mean``), zeros
    (``zero``, ``template``: the clamp) or a draw (``resample``, ``noise``), seeded by ``seed`` and
    the layer."""
    at = calib.dims_at[layer].tolist() if layer in calib.dims_at else []
    cols = [at.index(d) for d in dims]
    mean = calib.means_at[layer][cols] if cols else torch.zeros(0)
    if mode == "mean":
        return mean
    if mode == "noise":
        return Noise(mean, calib.vars_at[layer][cols], seed=seed + layer)
    if mode == "resample":
        return Resample(calib.pool, layer=layer, dims=dims, seed=seed + layer, fallback=mean, kinds=kinds)
    return torch.zeros(len(dims))


def refuse_old(calib: Any, mode: str, model_name: str) -> str | None:
    """Why ``calib`` cannot serve the arm ``mode`` (a Calibration saved before the arms' statistics
    were kept), or None."""
    if mode not in ARMS or (calib.vars_at and calib.template.numel() and calib.template_seen.numel()):  # kept together
        return None
    return (f"{model_name}: this Calibration has no statistics for the {mode!r} arm (variances, resample pool, "
            "post-norm template: it was saved by an older massive_lens); calibrate again: calibrate(model, text)")


FAMILIES = (("zero", ("mean", "resample", "noise", "template")),
            ("zero_every", ("mean_every", "resample_every", "noise_every")))


def arm_lines(frame: pd.DataFrame) -> list[str]:
    """The summary's check of every zero-ablation verdict against its controls: a zero row whose
    interval lies above 1 is set beside ``mean``/``resample``/``noise``/``template``; it is flagged
    ``zero only`` when a control's whole interval lies below zero's (the loss is then the shock of
    the zero, not the loss of the value), or when no control was run."""
    rows, out = frame.set_index("setting"), []
    for zero, controls in FAMILIES:
        if zero not in rows.index or not float(rows.loc[zero, "ratio_low"]) > 1:
            continue
        z = rows.loc[zero]
        head = f"{zero} x{ratio(z['ratio'])} [{ratio(z['ratio_low'])}, {ratio(z['ratio_high'])}]"
        run = [c for c in controls if c in rows.index]
        if not run:
            out.append(f"{head}: zero only; mean/resample/noise were not run, so this may be the shock of a zero "
                       "rather than the loss of the value (add settings 'mean', 'resample', 'noise')")
            continue
        said = ", ".join(f"{c} x{ratio(rows.loc[c, 'ratio'])} [{ratio(rows.loc[c, 'ratio_low'])}, "
                         f"{ratio(rows.loc[c, 'ratio_high'])}]" for c in run)
        milder = [c for c in run if float(rows.loc[c, "ratio_high"]) < float(z["ratio_low"])]
        if milder:
            out.append(f"{head}: zero only; {'/'.join(run)} say {said}: {', '.join(milder)} cost(s) clearly less, "
                       "so much of zero's loss is the shock of the zero, not the loss of the value")
        else:
            out.append(f"{head}: the controls agree ({said}): no control costs clearly less than zero")
    return out
