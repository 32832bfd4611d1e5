"""A census of attention sinks: every position that acts as one, its level and its life.

The first token is not the only sink. Sun et al. (2024) saw massive activations on the
first strong delimiter too; Wong et al. (2025, "Secondary Attention Sinks") describe weaker,
shorter-lived sinks that middle-layer MLPs make of ordinary tokens. :func:`sink_census`
finds them all in one forward pass, keeping nothing of an attention pattern beyond its layer:

- a position **acts as a sink at layer l** when at least one head of layer l gives it more
  than the sink rule's threshold (0.3, Gu et al.) of its attention, averaged over the (up to
  64) real queries after it, Gu et al.'s per-head test applied to that position
  (:func:`~massive_lens.core.criterion.key_attention`; a position with fewer than the rule's
  ``min_queries`` later queries is not judged);
- its **life** is the first and last such layer; its **peak** the layer where one head gives it
  the most attention; its **norm** and **cosine to the first token** are those of the residual
  that the peak layer's attention reads (``hook_resid_pre``);
- the **MLP that made it** is the layer before the peak whose MLP grew the position's residual
  norm the most (``||resid_post|| - ||resid_mid||``), with that MLP's neuron that writes the
  most there (``|activation| x ||W_out row||``; ``trace_origin`` gives the full ledger).

**Levels** (the rule, in this order): ``primary`` is the first token, and any position that
the sink rule of :class:`~massive_lens.core.criterion.SinkRule` counts as a sink (drawing
attention from >= 30% of all heads, or carrying a persistent massive activation), the rule
that ``find_sinks``, ``decompose_attention`` and the interventions use (column ``in_rule``);
``secondary`` is any other position that acts as a sink in at least ``min_layers`` layers
(default the rule's ``min_layers``, 2); ``transient`` is the rest (sink-like attention in
fewer layers: one head that likes one token is not a sink).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention.null_mass import NullReader
from massive_lens.core.attention_pass import PassLayer, attention_pass, choose_path
from massive_lens.core.budget import trim_allocator
from massive_lens.core.corpora import sequences
from massive_lens.core.criterion import Criterion, SinkEvidence, SinkRule, as_rule
from massive_lens.core.lse import EAGER, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.pass_reader import attention_layers
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.tokens import TOKEN_KINDS, Batch
from massive_lens.core.weight_cache import derived
from massive_lens.errors import MassiveLensError

LEVELS = ("primary", "secondary", "transient")
COLUMNS = ["seq", "pos", "token", "token_kind", "level", "layer", "first_layer", "last_layer", "n_layers",
           "peak_mass", "heads", "norm", "norm_ratio", "cos_first", "mlp_layer", "mlp_growth", "neuron", "in_rule"]


@dataclass(frozen=True, kw_only=True)
class SinkCensus(Result):
    """Every position that acts as a sink, with its level and life (see the module docstring).

    ``to_frame()``: one row per sink: ``seq``, ``pos``, ``token``, ``token_kind``, ``level``
    (``primary``/``secondary``/``transient``), ``layer`` (the peak layer), ``first_layer``,
    ``last_layer``, ``n_layers`` (layers where it acts as a sink), ``peak_mass`` (the largest
    attention one head gives it), ``heads`` (heads over the threshold at the peak), ``norm``
    (residual norm read at the peak), ``norm_ratio`` (``norm`` / the first token's there),
    ``cos_first`` (cosine of its residual to the first token's there), ``mlp_layer``,
    ``mlp_growth`` (the MLP before the peak that grew its norm most, and by how much; -1 and
    NaN at layer 0), ``neuron`` (that MLP's neuron writing most there; -1 when the MLP has no
    per-neuron weights), ``in_rule`` (the sink rule counts it). ``.by_kind``: per token kind
    over the sequences, how often it became a secondary sink and at which layers; ``.by_layer``:
    per layer and level, the sinks acting there, and, only where the attention has a null slot
    (``null_kind``: a learned sink logit or a trained slot variant), ``null_mass``: that layer's mean
    over heads of :func:`~massive_lens.attention.null_mass.null_mass` (the real queries after the
    first token, over all sequences). ``attention``: ``"lse"`` (each key's attention
    from q, k and the SDPA kernel's log-sum-exp, no pattern) or ``"eager"`` (the pattern).
    ``dependence``: a :class:`~massive_lens.interventions.dependence.SinkDependence` attached with
    :meth:`with_dependence` (None: not measured, and the summary says so: a head's attention to
    a sink is not its dependence on it).
    """

    frame: pd.DataFrame
    by_kind: pd.DataFrame
    by_layer: pd.DataFrame
    model_name: str
    n_seqs: int
    n_layers: int
    rule: SinkRule = field(default_factory=SinkRule)
    min_layers: int = 2
    attention: str = EAGER
    dependence: Result | None = None
    null_kind: str = ""  # the attention's null slot ("": none, and no null_mass column)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def with_dependence(self, dependence: Result) -> SinkCensus:
        """This census with ``dependence`` (``sink_dependence(model, text)`` on the same text), which
        its summary then reports beside the sink mass.

        Args:
            dependence: a :class:`~massive_lens.interventions.SinkDependence` of the same text.

        Returns:
            A copy of this census that carries it.

        >>> from massive_lens import tiny_model
        >>> census = sink_census(tiny_model("llama"), "Hello there, world. " * 4)
        >>> "dependence was not measured" in census.summary()
        True
        """
        return replace(self, dependence=dependence)

    def level(self, name: str) -> pd.DataFrame:
        """The rows of one level.

        Args:
            name: ``"primary"``, ``"secondary"`` or ``"transient"``.

        Returns:
            The rows of ``to_frame()`` at that level.
        """
        return self.frame[self.frame["level"] == name]

    def summary(self) -> str:
        f, parts = self.frame, []
        prim = self.level("primary")
        if len(prim):
            per = len(prim) / max(self.n_seqs, 1)
            first = prim[prim["pos"] == 0]
            what = (f"first token {_tokens(first)}" if len(first) == len(prim) else
                    f"{_tokens(prim)}, {len(first)} of them the first token")
            parts.append(f"{per:.3g} primary sink{'s' if per != 1 else ''} per sequence ({what}, layers "
                         f"{_span(prim)}, peak mass {prim['peak_mass'].median():.2f})")
        else:
            parts.append("no primary sink (the first token draws no sink-like attention)")
        sec = self.level("secondary")
        if len(sec):
            share = sec["seq"].nunique() / max(self.n_seqs, 1)
            made = sec["mlp_layer"][sec["mlp_layer"] >= 0]
            parts.append(f"secondary sinks on {_tokens(sec)} in {share:.0%} of sequences, layers {_span(sec)}, "
                         f"peak mass {sec['peak_mass'].median():.2f}, norm about {sec['norm_ratio'].median():.2g}x "
                         "the first token's" + (f", grown most by MLP {int(made.mode().iloc[0])}" if len(made) else ""))
        else:
            parts.append("no secondary sinks")
        n_tr = int((f["level"] == "transient").sum())
        parts.append(f"{n_tr} transient (sink-like attention in fewer than {self.min_layers} layers)")
        if self.null_kind:
            null = self.by_layer.drop_duplicates("layer").set_index("layer")["null_mass"]
            parts.append(f"null mass ({self.null_kind}) mean over heads and layers {null.mean():.2f}, highest at "
                         f"layer {int(null.idxmax())} ({null.max():.2f})")
        text = (f"{self.model_name}, {self.n_seqs} sequence(s), sink = a head gives it > {self.rule.threshold:g} "
                "of its attention: " + "; ".join(parts) + f" ({path_text(self.attention)})")
        if self.dependence is None:
            return text + (". Peak mass is where heads look, not what they need: dependence was not measured "
                           "(massive_lens.interventions.sink_dependence: the loss change without each sink head's "
                           "sink attention, and its no-op / broadcast label; census.with_dependence(...))")
        return text + "\n" + self.dependence.summary()

    def plot(self, ax: Any = None) -> Any:
        """Per layer: the share of sequences with a sink of each level acting there."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        for lvl, group in self.by_layer.groupby("level"):
            share = group.set_index("layer")["sequences"].reindex(range(self.n_layers), fill_value=0) / self.n_seqs
            ax.plot(share.index, share.values, marker="o", markersize=3, label=lvl)
        ax.set(xlabel="layer", ylabel="share of sequences with a sink acting",
               title=f"{self.model_name}: sink census", ylim=(0, 1.05))
        ax.legend()
        return ax


def _tokens(rows: pd.DataFrame, top: int = 3) -> str:
    counts = rows["token"].value_counts().head(top)
    return ", ".join(repr(t) for t in counts.index)


def _span(rows: pd.DataFrame) -> str:
    low, high = int(rows["first_layer"].median()), int(rows["last_layer"].median())
    return f"{low}-{high}" if high > low else f"{low}"


class _Tally:
    """Per layer, reduced inside the hooks: for each position the heads that treat it as a sink,
    the most attention one head gives it, its residual norm and cosine to the first token, the
    MLP's norm growth and the neuron that writes most there."""

    def __init__(self, view: ModelView, batch: Batch, rule: SinkRule, evidence: SinkEvidence):
        self.view, self.batch, self.rule, self.evidence = view, batch, rule, evidence
        shape = (view.n_layers, *batch.tokens.shape)
        self.heads = torch.zeros(shape, dtype=torch.long)
        self.mass, self.norm, self.cos, self.growth = (torch.zeros(shape) for _ in range(4))
        self.mid = torch.zeros(shape)
        self.neuron = torch.full(shape, -1, dtype=torch.long)
        self.w_out_norm: dict[int, Tensor] = {}
        for layer in range(view.n_layers):
            w = view.mlp_w_out(layer)
            if w is not None:
                # kept between calls while the weights are unchanged (a read of the weights instead of two)
                self.w_out_norm[layer] = derived(w, None, "row_norms",
                                                 lambda weight: _row_norms(weight.detach().float()))

    def hooks(self) -> list[tuple[str, Any]]:
        out = []
        for layer in range(self.view.n_layers):
            for hook, fn in (("resid_pre", self._pre), ("resid_mid", self._mid), ("mlp.hook_post", self._post),
                             ("resid_post", self._post_resid)):
                if self.view.has_hook(layer, hook) and (hook != "mlp.hook_post" or layer in self.w_out_norm):
                    out.append((self.view.block_hook(layer, hook), partial(fn, layer=layer)))
        return out

    def attention(self, at: PassLayer) -> None:
        """One layer from the attention pass: each key's attention from the band of queries after it
        (the pass feeds the sink rule's evidence the same reduction)."""
        mass, count = at.band
        mass = (mass * (count >= self.rule.min_queries)[:, None]).cpu()
        self.heads[at.layer] = (mass > self.rule.threshold).sum(1)
        self.mass[at.layer] = mass.max(1).values

    def check_finite(self) -> None:
        """The overflow error naming the first residual hook (in forward order) whose norm is NaN or
        inf at a real position, if any: every NaN or inf in a block reaches its residual stream."""
        real = self.batch.mask
        for layer in range(self.view.n_layers):
            for name, norms in (("resid_pre", self.norm), ("resid_mid", self.mid), ("resid_post", self.growth)):
                if not bool(torch.isfinite(norms[layer][real]).all()):
                    raise self.view.overflow_error(self.view.hook_name(layer, name))

    def _pre(self, resid: Tensor, hook: Any, *, layer: int) -> None:
        x = resid.detach().float()
        norm = x.norm(dim=-1)
        dot = torch.einsum("bpd,bd->bp", x, x[:, 0])  # the cosine to the first token, from the norms just taken
        self.norm[layer] = norm.cpu()
        self.cos[layer] = (dot / (norm * norm[:, :1]).clamp(min=1e-8)).cpu()
        if not self.view.has_hook(0, "resid_mid"):
            self.mid[layer] = self.norm[layer]  # no resid_mid: the growth is the whole block's

    def _mid(self, resid: Tensor, hook: Any, *, layer: int) -> None:
        self.mid[layer] = resid.detach().float().norm(dim=-1).cpu()

    def _post(self, act: Tensor, hook: Any, *, layer: int) -> None:
        score = act.detach().float().abs().mul_(self.w_out_norm[layer].to(act.device))  # abs's copy, scaled in place
        self.neuron[layer] = score.argmax(-1).cpu()

    def _post_resid(self, resid: Tensor, hook: Any, *, layer: int) -> None:
        self.growth[layer] = resid.detach().float().norm(dim=-1).cpu() - self.mid[layer]


def _row_norms(w: Tensor) -> Tensor:
    """Each row's norm, summed along the stored layout (``W_out`` is often the transpose of the
    stored ``down_proj`` weight; a strided norm reads it several times slower)."""
    if w.T.is_contiguous() and not w.is_contiguous():
        return w.T.pow(2).sum(0).sqrt()
    return w.pow(2).sum(-1).sqrt()


def _rows(tally: _Tally, in_rule: Tensor, kinds: Tensor, tokens: list[list[str]], min_layers: int,
          seq0: int) -> list[dict[str, Any]]:
    acts = tally.heads > 0  # [layer batch pos]
    rows = []
    for b, p in (acts.any(0) & tally.batch.mask).nonzero().tolist():
        on = acts[:, b, p].nonzero().flatten()
        peak = int(tally.mass[:, b, p].argmax())
        before = tally.growth[:peak, b, p]
        mlp = int(before.argmax()) if peak > 0 else -1
        level = ("primary" if p == 0 or bool(in_rule[b, p]) else
                 "secondary" if len(on) >= min_layers else "transient")
        rows.append(dict(
            seq=seq0 + b, pos=p, token=tokens[b][p], token_kind=TOKEN_KINDS[int(kinds[b, p])], level=level,
            layer=peak, first_layer=int(on[0]), last_layer=int(on[-1]), n_layers=len(on),
            peak_mass=float(tally.mass[peak, b, p]), heads=int(tally.heads[peak, b, p]),
            norm=float(tally.norm[peak, b, p]),
            norm_ratio=float(tally.norm[peak, b, p] / tally.norm[peak, b, 0].clamp(min=1e-12)),
            cos_first=float(tally.cos[peak, b, p]), mlp_layer=mlp,
            mlp_growth=float(before[mlp]) if mlp >= 0 else float("nan"),
            neuron=int(tally.neuron[mlp, b, p]) if mlp >= 0 else -1, in_rule=bool(in_rule[b, p])))
    return rows


def _token_strings(view: ModelView, batch: Batch) -> list[list[str]]:
    try:
        strings = view.str_tokens(batch)
    except MassiveLensError:  # no tokenizer: the ids
        strings = [[str(t) for t in row] for row in batch.tokens.tolist()]
    width = batch.tokens.shape[1]
    return [row + [""] * (width - len(row)) for row in strings]


def sink_census(model: Any, text: str | Sequence[str] | Tensor, *, seq_len: int | None = None, n_seqs: int = 8,
                batch_size: int = 4, rule: SinkRule | None = None, criterion: Criterion | None = None,
                min_layers: int | None = None, attention: str = "auto") -> SinkCensus:
    """Every position that acts as an attention sink, its level (primary, secondary,
    transient) and its life, over one text or a corpus (see the module docstring).

    Args:
        model: a TransformerLens-style model, or an nnsight model (the LSE path only).
        text: a string, a list of strings (padded into one batch) or a token tensor; with
            ``seq_len``, a corpus (a file, ``"hf:NAME"``, texts) cut into ``n_seqs`` sequences.
        seq_len: cut ``text`` as a corpus into sequences of this many tokens (None: as given).
        n_seqs: how many sequences to take from a corpus (with ``seq_len``).
        batch_size: sequences per forward pass.
        rule: the sink rule (None: ``SinkRule()``): its ``threshold`` makes a head treat a
            position as a sink; the whole rule decides ``in_rule`` and the primary level.
        criterion: when an activation is massive, for the rule (None: ``Criterion()``).
        min_layers: layers a non-primary position must act as a sink in to be ``secondary``
            (None: the rule's ``min_layers``).
        attention: ``"auto"`` (the default: the eager pattern below 512 tokens, where it is the
            faster; from there each key's attention from q, k and the fused SDPA kernel's
            log-sum-exp where the model supports it, no pattern built; see
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"`` or ``"eager"``.

    Returns:
        A :class:`SinkCensus`.

    Raises:
        MassiveLensError: if ``min_layers`` or ``batch_size`` is below 1, the model has no
            attention pattern, the text cannot be read (see ``find_sinks``), or ``attention="lse"``
            on a model whose kernel cannot give the log-sum-exp.

    >>> from massive_lens import tiny_model
    >>> census = sink_census(tiny_model("llama"), "Hello there, world. " * 4)
    >>> set(census.to_frame()["level"]) <= {"primary", "secondary", "transient"}
    True
    """
    rule = as_rule(rule)
    min_layers = rule.min_layers if min_layers is None else min_layers
    if isinstance(min_layers, bool) or not isinstance(min_layers, int) or min_layers < 1 or batch_size < 1:
        raise MassiveLensError(f"min_layers and batch_size must be integers >= 1, got {min_layers!r}, {batch_size!r}")
    view = ModelView(model)
    whole = view.full_batch(sequences(view, text, seq_len, n_seqs)) if seq_len is not None else view.tokenize(text)
    path = choose_path(view, attention, whole)  # an nnsight model: the LSE path, or a MassiveLensError saying so
    if view.serves_patterns and not attention_layers(view):  # a capability (nnsight's layers: the pass's)
        raise MassiveLensError(f"{view.name} has no attention pattern in any layer (a recurrent or state-space "
                               "model?): sink_census reads the attention that positions draw")
    rows: list[dict[str, Any]] = []
    kind_seqs = torch.zeros(len(TOKEN_KINDS))
    seq0, null_sums, n_null = 0, {}, 0.0
    for batch in whole.split(batch_size):
        evidence = SinkEvidence(batch.mask, view.n_layers, rule, criterion)
        tally, nulls = _Tally(view, batch, rule, evidence), NullReader(view)
        hooks = tally.hooks()
        # the tally's residual norms at every layer are the overflow check (NaN or inf reach them)
        attention_pass(view, batch, partial(_take, tally=tally, nulls=nulls), path=path, band=True,
                       evidence=evidence, hooks=hooks, **nulls.reads,
                       stop_after=view.hook_name(view.n_layers - 1, "resid_post"), check_finite=False)
        sums, n = nulls.head_sums(batch.mask)  # the null slot's mass, pooled over the batches
        null_sums, n_null = {lay: null_sums.get(lay, 0) + s for lay, s in sums.items()}, n_null + float(n)
        tally.check_finite()
        kinds = view.token_kinds(batch)
        present = torch.zeros(len(batch.tokens), len(TOKEN_KINDS), dtype=torch.bool)
        present.scatter_(1, kinds.masked_fill(~batch.mask, kinds[0, 0]), True)
        kind_seqs += present.sum(0)
        rows += _rows(tally, evidence.mask(), kinds, _token_strings(view, batch), min_layers, seq0)
        seq0 += len(batch.tokens)
        del tally, evidence, hooks
        trim_allocator()  # a pass's freed activations do not pile up as resident memory
    frame = pd.DataFrame(rows, columns=COLUMNS)
    by_layer = _by_layer(frame, view.n_layers)
    if nulls.kind:  # the attention's own off-switch, per layer: the mean over heads of null_mass's numbers
        null = {lay: float((s / max(n_null, 1.0)).mean()) for lay, s in null_sums.items()}
        by_layer["null_mass"] = [null.get(lay, float("nan")) for lay in by_layer.layer]
    return SinkCensus(frame=frame, by_kind=_by_kind(frame, kind_seqs), by_layer=by_layer,
                      model_name=view.name, n_seqs=seq0, n_layers=view.n_layers, rule=rule, min_layers=min_layers,
                      attention=path, null_kind=nulls.kind)


def _take(at: PassLayer, *, tally: _Tally, nulls: NullReader) -> None:
    tally.attention(at)
    nulls.take(at)


def _by_kind(frame: pd.DataFrame, kind_seqs: Tensor) -> pd.DataFrame:
    """Per token kind: ``sequences`` holding it, ``secondary`` (sequences where it is a secondary
    sink), ``frequency`` (their ratio), ``positions`` (secondary sink positions), ``first_layer``,
    ``last_layer`` (medians), ``tokens`` (the commonest token strings)."""
    sec = frame[frame["level"] == "secondary"]
    rows = []
    for i, kind in enumerate(TOKEN_KINDS):
        n = int(kind_seqs[i])
        if not n:
            continue
        mine = sec[sec["token_kind"] == kind]
        rows.append(dict(token_kind=kind, sequences=n, secondary=int(mine["seq"].nunique()),
                         frequency=mine["seq"].nunique() / n, positions=len(mine),
                         first_layer=float(mine["first_layer"].median()) if len(mine) else float("nan"),
                         last_layer=float(mine["last_layer"].median()) if len(mine) else float("nan"),
                         tokens=_tokens(mine) if len(mine) else ""))
    return pd.DataFrame(rows, columns=["token_kind", "sequences", "secondary", "frequency", "positions",
                                       "first_layer", "last_layer", "tokens"])


def _by_layer(frame: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    """Per layer and level: ``sinks`` whose life covers the layer and ``sequences`` holding one."""
    layer = torch.arange(n_layers)[:, None, None]
    first, last = (torch.tensor(frame[c].to_numpy(dtype="int64")) for c in ("first_layer", "last_layer"))
    level = torch.tensor(frame["level"].map(LEVELS.index).to_numpy(dtype="int64"))
    seq = torch.unique(torch.tensor(frame["seq"].to_numpy(dtype="int64")), return_inverse=True)[1]
    # [layer level row]: the rows alive at the layer, at the level
    alive = (first <= layer) & (last >= layer) & (level == torch.arange(len(LEVELS))[None, :, None])
    seqs = torch.zeros(len(frame), int(seq.max()) + 1 if len(frame) else 0)
    seqs[torch.arange(len(frame)), seq] = 1.0  # [row sequence]
    return pd.DataFrame({"layer": layer.flatten().repeat_interleave(len(LEVELS)).numpy(),
                         "level": list(LEVELS) * n_layers, "sinks": alive.sum(-1).flatten().numpy(),
                         "sequences": ((alive.float() @ seqs) > 0).sum(-1).flatten().numpy()})
