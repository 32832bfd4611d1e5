"""The key side and the value side of an attention sink.

Why does a sink draw attention, and why does that attention do nothing? Gu et al. (ICLR 2025)
read the sink as a **key bias**: the sink's key points where the queries point, so every
query's logit on it is nearly one constant per head. Guo et al. (2024, "Active-Dormant
Attention Heads") read the value side as a **drain**: the sink's value is small, so the
attention it absorbs adds little (attention to the sink x sink value norm is small). Jin et
al. (ICML 2025) find **massive values in queries and keys** concentrated in a few rotary
frequency pairs, mostly the low-frequency ones, which RoPE barely turns.

:func:`sink_kv` measures all of it in one forward pass, per layer and head (a query head ``h``
reads kv head ``h // (n_heads // n_kv_heads)``), reducing each layer's queries, keys, values
and pattern inside its hooks:

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

Keys and queries are read after the rotary embedding where the model has a hook for it
(``attn.hook_rot_q``/``hook_rot_k``), so logits and cosines are the ones the model computes;
norms and pair amplitudes do not change under the rotation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool
from torch import Tensor

from massive_lens.attention.sinks import Sinks, SinkSet, sink_mask
from massive_lens.core.gather import LayerGather
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError

COLUMNS = ["layer", "head", "kv_head", "key_norm", "key_median", "key_ratio", "key_cos_query", "bias_share",
           "value_norm", "value_median", "value_ratio", "sink_mass", "drain", "sink_term"]
BAND_COLUMNS = ["layer", "head", "band", "frequency", "q_max", "k_max"]


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


def _norm_stats(x: Tensor, sink: Bool[Tensor, "batch pos"], other: Bool[Tensor, "batch pos"]) -> tuple[Tensor, Tensor]:
    """Per head: mean norm at the sinks, median norm at the other positions."""
    n = x.norm(dim=-1)  # [batch pos head]
    return n[sink].mean(0), n[other].median(0).values


def _layer_rows(layer: int, q: Tensor, k: Tensor, v: Tensor, pattern: Tensor, sink: Tensor, real: Tensor
                ) -> list[list[Any]]:
    heads = q.shape[2]
    group = heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2).float(), v.repeat_interleave(group, dim=2).float()
    q = q.float()
    other = real & ~sink
    k_sink, k_med = _norm_stats(k, sink, other)
    v_sink, v_med = _norm_stats(v, sink, other)
    mean_q = q[other].mean(0)  # [head d]
    cos = torch.nn.functional.cosine_similarity(k[sink], mean_q[None], dim=-1).mean(0)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k)
    pos = torch.arange(q.shape[1], device=q.device)
    pairs = (other[:, :, None] & sink[:, None, :] & (pos[:, None] > pos[None])[None]).float()  # [b q k]
    n = pairs.sum().clamp(min=1)
    s1 = torch.einsum("bhqk,bqk->h", logits, pairs) / n
    s2 = torch.einsum("bhqk,bqk->h", logits.pow(2), pairs) / n
    p = pattern.float() * sink[:, None, None, :].float()
    queries = (other & (sink.long().cumsum(1) > 0)).float()  # non-sink queries that can see a sink
    mass = torch.einsum("bhqk,bq->h", p, queries) / queries.sum().clamp(min=1)
    term = torch.einsum("bhqk,bkhd->bqhd", p, v).norm(dim=-1)  # [b q h]
    term = torch.einsum("bqh,bq->h", term, queries) / queries.sum().clamp(min=1)
    cols = torch.stack([k_sink, k_med, k_sink / k_med.clamp(min=1e-12), cos, s1 ** 2 / s2.clamp(min=1e-30), v_sink,
                        v_med, v_sink / v_med.clamp(min=1e-12), mass, mass * v_sink, term], 1).double().cpu().tolist()
    return [[layer, h, h // group, *cols[h]] for h in range(heads)]


def _band_rows(layer: int, q: Tensor, k: Tensor, real: Tensor, rotary: tuple[int, float]) -> list[list[Any]]:
    dim, base = rotary
    half = dim // 2
    group = q.shape[2] // k.shape[2]
    amp = []
    for x in (q.float(), k.float().repeat_interleave(group, dim=2)):
        a = (x[..., :half].pow(2) + x[..., half:dim].pow(2)).sqrt()  # [b p head half]
        amp.append(a[real].amax(0))  # [head half]
    freq = (base ** (-2 * torch.arange(half, dtype=torch.float64) / dim)).tolist()
    q_max, k_max = amp[0].double().cpu().tolist(), amp[1].double().cpu().tolist()
    return [[layer, h, i, freq[i], q_max[h][i], k_max[h][i]] for h in range(q.shape[2]) for i in range(half)]


def sink_kv(model: Any, text: str | Sequence[str] | Tensor, *, sinks: Sinks = None,
            layers: int | Sequence[int] | None = None) -> SinkKV:
    """The sink's keys (a key bias?) and values (a drain?) per layer and head, and the largest
    query and key amplitudes per rotary frequency pair (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor.
        sinks: sink positions (a list of ints, a bool ``[batch, pos]`` mask, or a ``SinkSet`` that
            ``find_sinks`` gave for the same text); None: the
            positions that act as sinks (``find_sinks``, one more forward pass), else the first token.
        layers: a layer or a sequence of layers (None: all).

    Returns:
        A :class:`SinkKV`.

    Raises:
        MassiveLensError: if ``layers`` or ``sinks`` is invalid, every real position is a sink
            (nothing to compare with), or the model has no per-head query/key/value hooks.

    >>> from massive_lens import tiny_model
    >>> kv = sink_kv(tiny_model("llama"), "Hello there, world.", sinks=[0])
    >>> kv.rotary, bool((kv.to_frame()["bias_share"] <= 1 + 1e-6).all())
    (True, True)
    """
    view = ModelView(model)
    chosen = view.chosen_layers(layers)
    batch = view.tokenize(text)
    found = sink_mask(model, batch, sinks)
    sink = found.mask & batch.mask
    if not bool((batch.mask & ~sink).any()):
        raise MassiveLensError("every real position is a sink: sink_kv needs other tokens to compare with; "
                               "give a longer text")
    rotary = _rotary(view)
    rows: list[list[Any]] = []
    bands: list[list[Any]] = []

    def ready(layer: int, *acts: Tensor) -> None:
        q, k, v, pattern = (act.detach() for act in acts)
        shaped = all(t.ndim == 4 and tuple(t.shape[:2]) == tuple(sink.shape) for t in (q, k, v))
        if not shaped or q.shape[2] % k.shape[2] or k.shape[2] != v.shape[2] or pattern.shape[1] != q.shape[2]:
            raise MassiveLensError(f"{view.name}: layer {layer} has q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                                   f"{tuple(v.shape)}, pattern {tuple(pattern.shape)}; sink_kv needs [batch, pos, "
                                   "head, d_head] with query heads a multiple of the kv heads and one pattern per "
                                   "query head (multi-head latent attention compresses its keys and values, and is "
                                   "not read)")
        s, r = sink.to(q.device), batch.mask.to(q.device)
        rows.extend(_layer_rows(layer, q, k, v, pattern, s, r))
        if rotary is not None:
            bands.extend(_band_rows(layer, q, k, r, rotary))

    gather, hooks = LayerGather(("q", "k", "v", "pattern"), ready), []
    for layer in chosen:
        rot = view.has_hook(layer, "attn.hook_rot_q")
        for key, name in (("q", "attn.hook_rot_q" if rot else "attn.hook_q"), ("k", "attn.hook_rot_k" if rot else
                          "attn.hook_k"), ("v", "attn.hook_v"), ("pattern", "attn.hook_pattern")):
            hooks.append((view.hook_name(layer, name), gather.hook(key, layer)))
    view.forward(batch, hooks, stop_after=view.hook_name(max(chosen), "resid_post"))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    if sorted(set(frame["layer"])) != chosen:
        raise MassiveLensError(f"{view.name}: the query, key, value and pattern hooks did not all fire in layers "
                               f"{sorted(set(chosen) - set(frame['layer']))}; sink_kv cannot read them")
    frame[["layer", "head", "kv_head"]] = frame[["layer", "head", "kv_head"]].astype(int)
    band_frame = pd.DataFrame(bands, columns=BAND_COLUMNS)
    band_frame[["layer", "head", "band"]] = band_frame[["layer", "head", "band"]].astype(int)
    return SinkKV(frame=frame, bands=band_frame, model_name=view.name, sink_source=found.source,
                  rotary=rotary is not None, sinks=found)
