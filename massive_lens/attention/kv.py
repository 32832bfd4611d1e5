"""The key side and the value side of an attention sink.

Why does a sink draw attention, and why does that attention do nothing? Gu et al. (ICLR 2025)
read the sink as a **key bias**: the sink's key points where the queries point, so every
query's logit on it is nearly one constant per head. Guo et al. (2024, "Active-Dormant
Attention Heads") read the value side as a **drain**: the sink's value is small, so the
attention it absorbs adds little (attention to the sink x sink value norm is small). Jin et
al. (ICML 2025) find **massive values in queries and keys** concentrated in a few rotary
frequency pairs, mostly the low-frequency ones, which RoPE barely turns.

:func:`sink_kv` measures all of it in one forward pass, per layer and head (a query head ``h``
reads kv head ``h // (n_heads // n_kv_heads)``), reducing each layer's queries, keys, values and
attention on the sink columns as the attention pass (:mod:`massive_lens.core.attention_pass`)
hands them over, from the eager hooks or the fused kernel alike:

- ``key_ratio``: the sink's key norm over the median key norm of the other real tokens;
- ``key_cos_query``: cosine of the sink's key to the mean query (real, non-sink queries);
- ``bias_share``: how much of each query's logit on the sink one constant per head explains,
  ``mean(s)^2 / mean(s^2)`` over the logits ``s = q . k_sink`` of the real non-sink queries
  after the sink (1: a pure key bias);
- ``value_ratio``: the sink's value norm over the other tokens' median;
- ``sink_mass``, ``drain``: the attention real non-sink queries after a sink put on the sinks,
  and that times the sink's value norm; ``sink_term``: the mean norm of ``sum_{i in sinks} p_qi v_i``, the head's
  sink term of ``decompose_attention`` before ``W_O`` (equal to ``drain`` for one sink);
- ``.bands``: per head and rotary pair ``i`` (dims ``i`` and ``i + rotary_dim/2``, HF's
  rotate-half layout), the largest query and key amplitude ``sqrt(x_i^2 + x_{i+half}^2)`` over
  real positions, and the pair's frequency. A model without rotary embeddings has none, and
  the summary says so.

Keys and queries are read after the rotary embedding (on the eager path where the model has a
hook for it, ``attn.hook_rot_q``/``hook_rot_k``; the fused kernel's always are), so logits and
cosines are the ones the model computes; norms and pair amplitudes do not change under the rotation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool
from torch import Tensor

from massive_lens.attention.sinks import Sinks, SinkSet, candidate_columns, sink_mask, sinks_from
from massive_lens.core.attention_pass import PassLayer, attention_reading, choose_path
from massive_lens.core.criterion import SinkEvidence
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

COLUMNS = ["layer", "head", "kv_head", "key_norm", "key_median", "key_ratio", "key_cos_query", "bias_share",
           "value_norm", "value_median", "value_ratio", "sink_mass", "drain", "sink_term"]
BAND_COLUMNS = ["layer", "head", "band", "frequency", "q_max", "k_max"]
# sinks found in the same pass: where the layers read (q, k, v; float32) take at most this many bytes they are
# kept whole until the sinks are known (the cheaper at short lengths: the reduction on the sinks' columns only)
WHOLE_BYTES = 2 ** 27
# the layers tabled at once once the sinks are known: their sink terms per query and head ([layer, batch, pos, head,
# d_head] float32) within this many bytes (every layer of SmolLM2 at 128 tokens; three at 2,048)
ROWS_BYTES = 16 << 20


@dataclass(frozen=True, kw_only=True)
class SinkKV(Result):
    """The sink's keys and values per layer and head (see the module docstring for each column).

    ``to_frame()`` columns: ``layer``, ``head``, ``kv_head``, ``key_norm``, ``key_median``,
    ``key_ratio``, ``key_cos_query``, ``bias_share``, ``value_norm``, ``value_median``,
    ``value_ratio``, ``sink_mass``, ``drain``, ``sink_term``. ``.bands``: ``layer``, ``head``,
    ``band``, ``frequency``, ``q_max``, ``k_max`` (empty without rotary embeddings).
    """

    frame: pd.DataFrame
    bands: pd.DataFrame
    model_name: str
    sink_source: str
    rotary: bool
    sinks: SinkSet | None = None

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        f = self.frame.median(numeric_only=True)
        treated = f" ({self.sinks.describe()})" if self.sinks is not None else ""
        text = (f"{self.model_name}, sinks = {self.sink_source}{treated}; median over heads: sink key norm "
                f"{f['key_ratio']:.2g}x the other tokens' median, cosine to the mean query {f['key_cos_query']:.2f}, "
                f"{f['bias_share']:.0%} of each query's logit on the sink is one constant per head; sink value norm "
                f"{f['value_ratio']:.2g}x the others', attention to the sink {f['sink_mass']:.2f} x value norm "
                f"{f['value_norm']:.3g} = drain {f['drain']:.3g}")
        return text + "; " + self.band_summary()

    def band_summary(self) -> str:
        """Where the largest query and key amplitudes sit among the rotary frequency pairs."""
        if not self.rotary or self.bands.empty:
            return "no rotary embeddings: no frequency bands to read (Jin et al.'s test does not apply)"
        n = int(self.bands["band"].max()) + 1
        low = self.bands["band"] >= n - max(n // 4, 1)  # the lowest-frequency quarter of the pairs
        parts = []
        for side in ("q", "k"):
            top = self.bands.loc[self.bands.groupby(["layer", "head"])[f"{side}_max"].idxmax()]
            share = float(low.loc[top.index].mean())
            parts.append(f"{share:.0%} of heads have their largest |{side}| in the lowest-frequency quarter "
                         f"of the {n} rotary pairs")
        return "; ".join(parts)

    def plot(self, ax: Any = None) -> Any:
        """Per layer, the median over heads of the key and value norm ratios and the drain."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        by = self.frame.groupby("layer")[["key_ratio", "value_ratio", "drain", "bias_share"]].median()
        for col, label in (("key_ratio", "sink key norm / others' median"),
                           ("value_ratio", "sink value norm / others' median"),
                           ("bias_share", "logit share of one constant per head"),
                           ("drain", "attention to sink x sink value norm")):
            ax.plot(by.index, by[col], marker="o", markersize=3, label=label)
        ax.set(xlabel="layer", ylabel="median over heads", yscale="log",
               title=f"{self.model_name}: sink keys and values")
        ax.legend(fontsize=7)
        return ax


def _rotary(view: ModelView) -> tuple[int, float] | None:
    """(rotary dim, base) of a model with rotary embeddings, else None."""
    if getattr(view.cfg, "positional_embedding_type", None) != "rotary":
        return None
    return int(getattr(view.cfg, "rotary_dim", None) or view.cfg.d_head), float(getattr(view.cfg, "rotary_base", 10000))


def _norm_stats(norms: Tensor, group: int, sink: Bool[Tensor, "batch pos"], other: Bool[Tensor, "batch pos"]
                ) -> tuple[Tensor, Tensor]:
    """Per layer and query head (``group`` of them read each kv head of ``norms [layer batch pos kv_head]``):
    mean norm at the sinks, median norm at the other positions."""
    n = norms.repeat_interleave(group, dim=-1)  # [layer batch pos head]
    return n[:, sink].mean(1), n[:, other].median(1).values


@dataclass(frozen=True, kw_only=True)
class _Partial:
    """Layers reduced against every key column that could be a sink (``columns``), before the sinks are
    known: what :func:`_layer_rows` needs of them once they are, a few numbers per position or per column
    except the attention on the columns, which the sink term needs per query. Each tensor has the layers
    first."""

    layers: list[int]
    group: int  # query heads per kv head
    k_norm: Tensor  # [layer b pos kv_head] float32
    v_norm: Tensor
    k_col: Tensor  # [layer b col kv_head d] float32: the keys, values and queries at the columns
    v_col: Tensor
    q_col: Tensor  # [layer b col head d]
    q_rest: Tensor  # [layer head d] float64: the sum of the queries at the real positions that are not columns
    s1: Tensor  # [layer b head col] float64: the sums of the logits q . k_col, and their squares, over those
    s2: Tensor  # queries after the column
    cols: Tensor  # [layer b head q col]: the attention on the columns


def _partial(layers: list[int], q: Tensor, k: Tensor, v: Tensor, cols: Tensor, columns: Tensor, real: Tensor
             ) -> _Partial:
    """Layers' queries, keys and values ``[layer b pos head d]`` and attention on the columns, reduced against
    every one of ``columns`` [col], all layers in each operation."""
    q, k, v = q.detach().float(), k.detach().float(), v.detach().float()
    group = q.shape[3] // k.shape[3]
    rest = real.clone()
    rest[:, columns] = False  # real queries that are not columns: never sinks, whichever columns are
    k_col = k[:, :, columns]
    pos = torch.arange(q.shape[2], device=q.device)
    after = (rest[:, :, None] & (pos[:, None] > columns[None])[None]).float()  # [b q col]
    logits = torch.einsum("lbqhd,lbchd->lbhqc", q, k_col.repeat_interleave(group, dim=3)) * after[:, None]
    q_col = q[:, :, columns]
    if bool(real.all()):  # every position real: the sum over all of them less the columns' (no gather of the rest)
        q_rest = q.sum((1, 2), dtype=torch.float64) - q_col.sum((1, 2), dtype=torch.float64)
    else:
        q_rest = q[:, rest].sum(1, dtype=torch.float64)
    return _Partial(layers=layers, group=group, k_norm=k.norm(dim=-1), v_norm=v.norm(dim=-1), k_col=k_col,
                    v_col=v[:, :, columns], q_col=q_col, q_rest=q_rest, s1=logits.sum(3, dtype=torch.float64),
                    s2=logits.pow(2).sum(3, dtype=torch.float64), cols=cols.detach())


def _layer_rows(part: _Partial, columns: Tensor, sink: Tensor, real: Tensor) -> list[list[Any]]:
    """The layers' rows from their :class:`_Partial` against ``columns``, now that the sinks (``sink [batch
    pos]``, every one among the columns) are known: every layer in each operation."""
    group, heads = part.group, part.q_col.shape[3]
    other = real & ~sink
    k_sink, k_med = _norm_stats(part.k_norm, group, sink, other)
    v_sink, v_med = _norm_stats(part.v_norm, group, sink, other)
    col_other = other[:, columns]  # [b col]: columns that are real non-sink queries
    mean_q = ((part.q_rest + part.q_col[:, col_other].sum(1, dtype=torch.float64)) / other.sum().clamp(min=1)).float()
    key = sink[:, columns].any(0).nonzero()[:, 0].to(columns.device)  # the columns that are sinks somewhere
    on, key_pos = sink[:, columns[key]], columns[key]  # [b key]: which of them are sinks in each sequence
    k_col = part.k_col[:, :, key].repeat_interleave(group, dim=3)  # [layer b key head d]
    cos = torch.nn.functional.cosine_similarity(k_col[:, on], mean_q[:, None], dim=-1).mean(1)
    # the logits of the real non-sink queries after a sink on it: the other queries' sums, plus the columns' own
    rest = real.clone()
    rest[:, columns] = False
    later = torch.arange(real.shape[1], device=real.device)[:, None] > key_pos[None]  # [q key]
    n_rest = (rest[:, :, None] & later[None]).sum(1)  # [b key]: the other queries after each
    pairs = (col_other[:, :, None] & (columns[:, None] > key_pos[None])[None] & on[:, None, :]).float()  # [b col key]
    logits = torch.einsum("lbqhd,lbchd->lbhqc", part.q_col, k_col) * pairs[:, None]  # [layer b h col key]
    n = ((n_rest * on).sum() + pairs.sum()).clamp(min=1)
    s1 = ((part.s1[..., key] * on[:, None]).sum((1, 3)) + logits.sum((1, 3, 4), dtype=torch.float64)) / n
    s2 = ((part.s2[..., key] * on[:, None]).sum((1, 3)) + logits.pow(2).sum((1, 3, 4), dtype=torch.float64)) / n
    p = part.cols[..., key].float() * on[:, None, None, :].float()  # [layer b h q key]: the attention on the sinks
    queries = (other & (sink.long().cumsum(1) > 0)).float()  # non-sink queries that can see a sink
    mass = torch.einsum("lbhqc,bq->lh", p, queries) / queries.sum().clamp(min=1)
    term = torch.einsum("lbhqc,lbchd->lbqhd", p, part.v_col[:, :, key].repeat_interleave(group, dim=3)).norm(dim=-1)
    term = torch.einsum("lbqh,bq->lh", term, queries) / queries.sum().clamp(min=1)
    share = (s1 ** 2 / s2.clamp(min=1e-30)).float()
    cols = torch.stack([k_sink, k_med, k_sink / k_med.clamp(min=1e-12), cos, share, v_sink,
                        v_med, v_sink / v_med.clamp(min=1e-12), mass, mass * v_sink, term], -1).double().cpu().tolist()
    return [[layer, h, h // group, *cols[i][h]] for i, layer in enumerate(part.layers) for h in range(heads)]


def _band_amplitudes(q: Tensor, k: Tensor, real: Tensor, rotary: tuple[int, float]) -> Tensor:
    """``[2, head, half]``: the largest query and key amplitude of each rotary pair over the real positions."""
    dim, half = rotary[0], rotary[0] // 2
    group = q.shape[2] // k.shape[2]
    every = bool(real.all())
    amp = []
    for x, repeat in ((q, 1), (k, group)):
        x = x.detach().float()
        a = x[..., :half].pow(2) + x[..., half:dim].pow(2)  # [b p head half]: squared (sqrt is monotone: taken last)
        top = a.flatten(0, 1).amax(0) if every else a[real].amax(0)
        amp.append(top.repeat_interleave(repeat, dim=0))  # [head half]
    return torch.stack(amp).sqrt().cpu()


def _band_frame(bands: dict[int, Tensor], rotary: tuple[int, float] | None) -> pd.DataFrame:
    """:data:`BAND_COLUMNS`, one row per layer, head and rotary pair (in that order), from each layer's
    :func:`_band_amplitudes`."""
    if rotary is None or not bands:
        empty = pd.DataFrame([], columns=BAND_COLUMNS)
        return empty.astype({"layer": int, "head": int, "band": int})
    dim, base = rotary
    layers = sorted(bands)
    amp = torch.stack([bands[layer] for layer in layers], 1).double()  # [2 layer head half]
    n_layers, heads, half = amp.shape[1:]
    at = np.indices((n_layers, heads, half)).reshape(3, -1)
    freq = (base ** (-2 * torch.arange(half, dtype=torch.float64) / dim)).numpy()
    return pd.DataFrame({"layer": np.asarray(layers, dtype=np.int64)[at[0]], "head": at[1].astype(np.int64),
                         "band": at[2].astype(np.int64), "frequency": freq[at[2]],
                         "q_max": amp[0].flatten().numpy(), "k_max": amp[1].flatten().numpy()})


class _Reduce:
    """Each layer as the attention pass hands it over, held in one buffer per kind for every layer (allocated at
    the first: no long-lived allocation lands between a later layer's activations, where glibc's heap would keep
    them; the peak at 4,096 tokens on SmolLM2 was 1.44x the SDPA forward's with a copy per layer): reduced against
    the key ``columns`` (:func:`_partial`), or, where the sinks are still to be found and the layers' queries, keys
    and values fit :data:`WHOLE_BYTES`, as read (reduced on the sinks' columns only once they are known). Once the
    sinks are (:meth:`finish`), the rows of every layer at once."""

    def __init__(self, view: ModelView, real: Tensor, columns: Tensor, rotary: tuple[int, float] | None,
                 n_layers: int, whole: bool):
        self.view, self.real, self.columns, self.rotary = view, real, columns, rotary
        self.bands: dict[int, Tensor] = {}  # layer -> its _band_amplitudes
        self.n_layers, self.whole = n_layers, whole
        self.layers: list[int] = []  # in the buffers' order
        self.buffers: dict[str, Tensor] = {}
        self.apart: list[tuple[int, dict[str, Tensor]]] = []  # layers that do not fit the buffers (another device)
        self.group, self.term_bytes = 1, 1

    def add(self, at: PassLayer) -> None:
        q, k, v = at.q, at.k, at.v
        shaped = all(t.ndim == 4 and tuple(t.shape[:2]) == tuple(self.real.shape) for t in (q, k, v))
        if not shaped or q.shape[2] % k.shape[2] or k.shape[2] != v.shape[2] or at.shape[1] != q.shape[2]:
            raise MassiveLensError(f"{self.view.name}: layer {at.layer} has q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                   f"v {tuple(v.shape)}, pattern {tuple(at.shape)}; sink_kv needs [batch, pos, "
                                   "head, d_head] with query heads a multiple of the kv heads and one pattern per "
                                   "query head (multi-head latent attention compresses its keys and values, and is "
                                   "not read)")
        real, columns = self.real.to(q.device), self.columns.to(q.device)
        if self.rotary is not None:
            self.bands[at.layer] = _band_amplitudes(q, k, real, self.rotary)
        read = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "cols": at.cols.detach()}
        if not self.whole:  # reduced now against every column (the layers as read would not fit)
            part = _partial([at.layer], *(x[None] for x in read.values()), columns, real)
            read = {f.name: getattr(part, f.name)[0] for f in dataclasses.fields(part) if f.name not in _NOT_HELD}
        self.group = q.shape[2] // k.shape[2]
        self.term_bytes = q[..., 0, 0].numel() * q.shape[2] * v.shape[3] * 4  # a layer's sink terms, per query head
        self._hold(at.layer, read)

    def _hold(self, layer: int, fields: dict[str, Tensor]) -> None:
        if not self.buffers:
            self.buffers = {name: x.new_empty((self.n_layers, *x.shape)) for name, x in fields.items()}
        if len(self.layers) >= self.n_layers or any(self.buffers[name].shape[1:] != x.shape or
                                                    self.buffers[name].device != x.device
                                                    for name, x in fields.items()):  # another device: a split model
            self.apart.append((layer, {name: x.clone() for name, x in fields.items()}))
            return
        for name, x in fields.items():
            self.buffers[name][len(self.layers)].copy_(x)
        self.layers.append(layer)

    def finish(self, sink: Tensor) -> list[list[Any]] | None:
        """Every layer's rows, now that the sinks are known; None where a sink is not among the columns."""
        on = torch.isin(self.columns, sink.any(0).nonzero()[:, 0])
        if int(on.sum()) != int(sink.any(0).sum()):
            return None
        step = max(1, ROWS_BYTES // self.term_bytes)  # the held layers tabled at once
        held = [(self.layers[i:i + step], {name: x[i:min(i + step, len(self.layers))] for name, x in
                                           self.buffers.items()}) for i in range(0, len(self.layers), step)]
        rows = []
        for layers, fields in held + [([layer], {name: x[None] for name, x in f.items()}) for layer, f in self.apart]:
            dev = fields["cols"].device
            columns, real = self.columns.to(dev), self.real.to(dev)
            if self.whole:  # kept as read: reduced as the sinks given would be
                columns = columns[on.to(dev)]
                part = _partial(layers, fields["q"], fields["k"], fields["v"], fields["cols"][..., on.to(dev)],
                                columns, real)
            else:
                part = _Partial(layers=layers, group=self.group, **fields)
            rows += _layer_rows(part, columns, sink.to(dev), real)
        self.buffers.clear()
        self.apart.clear()
        return sorted(rows, key=lambda row: row[0])  # by layer (a layer on another device was held apart)


_NOT_HELD = ("layers", "group")


def _others(found: SinkSet, real: Tensor) -> Tensor:
    """The sinks' mask on the real positions, refused where every real position is one."""
    sink = found.mask & real
    if not bool((real & ~sink).any()):
        raise MassiveLensError("every real position is a sink: sink_kv needs other tokens to compare with; "
                               "give a longer text")
    return sink


def sink_kv(model: Any, text: str | Sequence[str] | Tensor, *, sinks: Sinks = None,
            layers: int | Sequence[int] | None = None, attention: str = "auto") -> SinkKV:
    """The sink's keys (a key bias?) and values (a drain?) per layer and head, and the largest
    query and key amplitudes per rotary frequency pair (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor.
        sinks: sink positions (a list of ints, a bool ``[batch, pos]`` mask, or a ``SinkSet`` that
            ``find_sinks`` gave for the same text); None: the
            positions that act as sinks (``find_sinks``'s rule, read in the same forward pass: each layer is
            reduced against every position that could be a sink, and a sink elsewhere costs one more), else
            the first token.
        layers: a layer or a sequence of layers (None: all).
        attention: ``"auto"`` (the default: the eager hooks below 512 tokens, where they are the
            faster; from there the queries, keys and values of the fused SDPA kernel and the attention
            on the sinks from its log-sum-exp where the model supports it, no pattern built; see
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"`` or ``"eager"``.

    Returns:
        A :class:`SinkKV`.

    Raises:
        MassiveLensError: if ``layers`` or ``sinks`` is invalid, every real position is a sink
            (nothing to compare with), the model has no per-head query/key/value hooks (on the eager
            path), or ``attention="lse"`` on a model whose kernel cannot give the log-sum-exp.

    >>> from massive_lens import tiny_model
    >>> kv = sink_kv(tiny_model("llama"), "Hello there, world.", sinks=[0])
    >>> kv.rotary, bool((kv.to_frame()["bias_share"] <= 1 + 1e-6).all())
    (True, True)
    """
    view = ModelView(model)
    chosen = view.chosen_layers(layers)
    batch = view.tokenize(text)
    path = choose_path(view, attention, batch)
    found = None if sinks is None else sink_mask(model, batch, sinks, path)
    sink = None if found is None else _others(found, batch.mask)
    rotary = _rotary(view)
    # the key columns read: every sink, in some sequence (or every position that could be one)
    columns = candidate_columns(view, batch) if sink is None else sink.any(0).nonzero()[:, 0]
    evidence = SinkEvidence(batch.mask, view.n_layers) if sink is None else None
    # the layers kept as read where the sinks are to be found and their q, k, v (float32) fit WHOLE_BYTES
    width = getattr(view.cfg, "n_heads", 1) * getattr(view.cfg, "d_head", getattr(view.cfg, "d_model", 1))
    whole = sink is None and len(chosen) * batch.mask.numel() * 4 * 3 * width <= WHOLE_BYTES
    reduce = _Reduce(view, batch.mask, columns, rotary, len(chosen), whole)
    reader = attention_reading(view, reduce.add, path=path, batch=batch, columns=columns, want=("q", "k", "v"),
                               layers=chosen, evidence=evidence)
    with reader:
        view.forward(batch, reader.hooks, stop_after=view.hook_name(view.n_layers - 1 if sink is None else max(chosen),
                                                                    "resid_post"))
    if sorted(reader.done) != chosen:
        raise MassiveLensError(f"{view.name}: the query, key, value and pattern hooks did not all fire in layers "
                               f"{sorted(set(chosen) - reader.done)}; sink_kv cannot read them")
    if evidence is not None:
        found = sinks_from(evidence, view.token_kinds(batch), path)
        sink = _others(found, batch.mask)
    rows = reduce.finish(sink)
    if rows is None:  # a sink found outside the columns read: a second pass
        return sink_kv(model, text, sinks=found, layers=layers, attention=path)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame[["layer", "head", "kv_head"]] = frame[["layer", "head", "kv_head"]].astype(int)
    band_frame = _band_frame(reduce.bands, rotary)
    return SinkKV(frame=frame, bands=band_frame, model_name=view.name, sink_source=found.source,
                  rotary=rotary is not None, sinks=found)
