"""Sun et al.'s split of each attention output into sink term + content term + b_O.

Per head at query ``q`` with sink set C, ``sum_{i in C} p_qi v_i`` (the sink term) plus
``sum_{i not in C} p_qi v_i`` (the content term), mapped through ``W_O`` into the residual
stream, so that sink + content + b_O reconstructs the attention output exactly; with how
constant each term is across query positions and texts. Grouped-query attention and value
biases are handled. On models with a post-attention norm (Gemma 2/3) the decomposed output is
the one *before* that norm (``blocks.{l}.attn.hook_out``); where the output projection has its
own hook (``attn.o.hook_out``) that is the output decomposed. An attention whose output the
split does not reconstruct raises a ``MassiveLensError`` instead of returning numbers.

>>> from massive_lens import tiny_model
>>> result = decompose_attention(tiny_model("llama"), ["Hello there.", "Bye now!"])
>>> result.reconstruction_error < 1e-4
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from massive_lens.attention.constancy import constancy, reductions
from massive_lens.attention.output_weights import (
    check_error,
    check_rows,
    check_shapes,
    head_gram,
    output_miss,
    output_weights,
)
from massive_lens.attention.sinks import Sinks, SinkSet, candidate_columns, post_attention_norm, sink_mask, sinks_from
from massive_lens.core.attention_pass import PassLayer, attention_output_hook, attention_pass, choose_path
from massive_lens.core.budget import LayerTrim
from massive_lens.core.charts import sink_content_axes
from massive_lens.core.criterion import SinkEvidence
from massive_lens.core.lse import EAGER, path_text
from massive_lens.core.model_view import ModelView
from massive_lens.core.results import Result

_EXCLUDED = "constancy statistics exclude the sink query positions (a sink attends to itself)"


@dataclass(frozen=True, kw_only=True)
class AttentionDecomposition(Result):
    """Sink and content terms of the attention output, in the residual stream.

    ``sink``/``content``: ``[layer, batch, pos, d_model]`` (summed over heads), ``bias``:
    ``[layer, d_model]`` (``b_O``, zeros when absent), for the layers in ``layers``.
    ``to_frame()``: one row per (``layer``, ``head``, ``term``) with ``norm`` (mean vector
    norm), ``rel_std_pos``/``cos_pos`` (spread and mean pairwise cosine across query
    positions of one text, averaged over texts), ``rel_std_text``/``cos_text`` (the same
    across the per-text mean vectors; NaN for one text). Sink query positions are excluded.
    ``attention``: ``"lse"`` (the attention on the sink columns from q, k and the SDPA kernel's
    log-sum-exp, the heads' outputs from the kernel) or ``"eager"`` (the pattern).
    """

    frame: pd.DataFrame
    errors: pd.DataFrame  # layer, rel_error
    layers: tuple[int, ...]
    sink: Float[Tensor, "layer batch pos d_model"]
    content: Float[Tensor, "layer batch pos d_model"]
    bias: Float[Tensor, "layer d_model"]
    sink_mask: Bool[Tensor, "batch pos"]
    sink_source: str
    model_name: str
    sinks: SinkSet | None = None  # the positions treated as sinks (count per sequence, token kinds)
    post_norm: bool = False  # the model normalizes the attention output after W_O (Gemma 2/3)
    attention: str = EAGER  # how attention was read: "lse" or "eager"

    @property
    def reconstruction_error(self) -> float:
        """Largest relative error ||z W_O + b_O - attn_out|| / ||attn_out|| over the layers, the heads'
        outputs z (the pattern applied to the values) through W_O, on up to ``CHECK_ROWS`` (8) evenly spaced
        query positions: sink + content is z split in two (the sink keys' share and the others'), each through
        W_O. The content term is the output less the sink term and b_O (finding the sinks on a long text: the
        other keys' share of z through W_O)."""
        return float(self.errors["rel_error"].max())

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> str:
        by = self.frame.groupby("term")[["norm", "rel_std_pos", "cos_pos", "rel_std_text", "cos_text"]].median()
        treated = f" ({self.sinks.describe()})" if self.sinks is not None else ""
        where = ("taken at attn.hook_out, before this model's post-attention norm (not linear), where the "
                 "terms sum exactly" if self.post_norm else "decomposed before any post-attention norm")
        lines = [f"{self.model_name}: attention output = sink term + content term + b_O, layers "
                 f"{self.layers[0]}-{self.layers[-1]}, sinks = {self.sink_source}{treated}; max relative "
                 f"reconstruction error {self.reconstruction_error:.1e} ({where}); {_EXCLUDED}; "
                 f"{path_text(self.attention)}.",
                 "median over heads:   norm   rel.std(pos)  cos(pos)  rel.std(texts)  cos(texts)"]
        for term, r in by.iterrows():
            lines.append(f"  {term:<8} {r.norm:>12.3f} {r.rel_std_pos:>12.3f} {r.cos_pos:>9.3f} "
                         f"{r.rel_std_text:>14.3f} {r.cos_text:>11.3f}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Per layer: mean norm of the sink and content terms, and the sink term's cosine."""
        return sink_content_axes(self.frame, ax=ax, title=f"{self.model_name}: sink vs content term")


def decompose_attention(model: Any, text: str | Sequence[str] | Tensor, *, layers: int | Sequence[int] | None = None,
                        sinks: Sinks = None, attention: str = "auto") -> AttentionDecomposition:
    """Split each attention output into sink term + content term + b_O (see module docstring).

    Args:
        model: a TransformerLens-style model.
        text: a string, a list of strings (padded into one batch) or a token tensor; for a
            vision model, ``pixel_values`` ``[batch, channels, height, width]``.
        layers: a layer or a sequence of layers to decompose (None: all).
        sinks: sink positions (a list of ints, the same for every sequence, or a bool
            ``[batch, pos]`` mask); None: the positions that act as sinks (:func:`find_sinks`),
            else the first token.
        attention: ``"auto"`` (the default: the eager pattern below 512 tokens, where it is the
            faster; from there the attention on the sink columns from q, k and the fused SDPA
            kernel's log-sum-exp where the model supports it, no pattern built; see
            :func:`~massive_lens.core.attention_pass.choose_path`), ``"lse"`` or ``"eager"``.

    Returns:
        An :class:`AttentionDecomposition`: the terms, their constancy per head, and the
        reconstruction error.

    Raises:
        MassiveLensError: if ``layers`` is empty or out of range, ``sinks`` is invalid (see
            :func:`sink_attention`), ``text`` is empty or too long, ``model`` is not a
            TransformerLens model, or a layer's attention cannot be split: no per-head ``W_O``,
            latent attention, or an output that sink + content + b_O does not reconstruct
            (relative error above 1e-3 in float32; a decomposition never returns unchecked), or
            ``attention="lse"`` on a model whose kernel cannot give the log-sum-exp.

    >>> from massive_lens import tiny_model
    >>> d = decompose_attention(tiny_model("qwen2"), "Hi there.", layers=1, sinks=[0])
    >>> d.layers, tuple(d.sink.shape)
    ((1,), (1, 1, 9, 64))
    """
    view = ModelView(model)
    layers = tuple(view.chosen_layers(layers))
    batch = view.tokenize(text)
    path = choose_path(view, attention, batch)
    weights = {layer: output_weights(view, layer) for layer in layers}
    given = None if sinks is None else sink_mask(model, batch, sinks, path)
    # the key columns kept per layer: the given sinks' or, when the sinks are found in this same pass,
    # every position that could turn out to be one (see candidate_columns)
    columns = candidate_columns(view, batch) if given is None else given.mask.any(0).nonzero()[:, 0]
    # sinks given: the output held whole at any length (z in the sink term's memory, as the split in the pass
    # held its two terms); found: whole up to HOLD_OUTPUT_BYTES (see _Terms)
    terms = _Terms(layers, tuple(batch.tokens.shape), next(iter(weights.values()))[0], whole=given is not None,
                   all_real=bool(batch.mask.all()))
    trim = LayerTrim(batch.mask.numel(), terms.sink.shape[-1], TRIM_EVERY)

    def take(at: PassLayer) -> None:
        # the heads' outputs z (the pattern applied to v, or the kernel's), the attention on the kept columns, v;
        # the output's check while the layer's own product left W_O in cache
        W_O, b_O = weights[at.layer]
        check_shapes(view, at.layer, at.shape, at.v, W_O, at.out)
        terms.check(at.layer, at.z, at.out, W_O, b_O, batch.mask)
        terms.hold(at.layer, at.z, at.cols.to(at.z.dtype), at.v[:, columns.to(at.v.device)], at.out)

    evidence = SinkEvidence(batch.mask, view.n_layers) if given is None else None  # the sink rule reads every layer
    terms.out_hooks = {i: attention_output_hook(view, i, path) for i in layers}  # as the pass reads them
    attention_pass(view, batch, take, path=path, columns=columns, want=("z", "v", "out"), layers=layers,
                   out_hooks=terms.out_hooks, evidence=evidence,
                   stop_after=None if given is None else view.hook_name(max(layers), "resid_post"))
    found = given if given is not None else sinks_from(evidence, view.token_kinds(batch), path)
    inside = found.mask[:, columns]
    if int(inside.sum()) < int(found.mask.sum()):  # a sink found outside the kept columns: a second pass
        return decompose_attention(model, text, layers=layers, sinks=found, attention=path)
    # every layer split after the pass, several at once (one operation for all of them where it can)
    terms.plan(inside, batch.mask, found.mask)
    step = max(1, SPLIT_BYTES // terms.layer_bytes)
    for start in range(0, len(layers), step):
        _split(view, layers[start:start + step], *terms.held(start, start + step), weights, terms)
        trim()
    terms.drop_held()
    trim.now()
    stats = constancy(terms.parts(), batch.mask & ~found.mask)  # [term head 5]
    rows = [(layer, h, term, *vals) for (layer, term), per_head in zip(terms.stats, stats.tolist(), strict=True)
            for h, vals in enumerate(per_head)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "term", "norm", "rel_std_pos", "cos_pos",
                                        "rel_std_text", "cos_text"])
    return AttentionDecomposition(
        frame=frame, errors=pd.DataFrame(terms.errors, columns=["layer", "rel_error"]), layers=layers,
        sink=terms.sink, content=terms.content, bias=terms.bias,
        sink_mask=found.mask, sink_source=found.source, model_name=view.name, sinks=found,
        post_norm=post_attention_norm(model), attention=path)


class _Terms:
    """The result, filled a few layers at a time after the pass: ``sink``/``content`` ``[layer batch pos
    d_model]`` on the CPU, one allocation each. Through the pass, every layer's heads' outputs ``z``, attention
    on the kept columns and attention output are held in one buffer each (not one per layer: the pass's
    transients would fragment around them). With ``whole`` (sinks given) or terms of at most
    ``HOLD_OUTPUT_BYTES``, the output is held whole in ``content`` (the content term, the output less the sink
    term and ``b_O``, replaces it) and ``z`` in ``sink``'s memory; else (finding the sinks on a long text, where
    a third buffer held through the forward would raise its peak) the output is not held, ``z`` is in
    ``content``'s memory, and the content term is taken through ``W_O`` at every row. ``z`` takes the first part
    of each layer's term (heads x d_head <= d_model), else a buffer of its own. The output's check (:meth:`check`)
    is taken in the pass, where the layer's own output projection has just read ``W_O``."""

    def __init__(self, layers: tuple[int, ...], shape: tuple[int, int], W_O: Tensor, whole: bool = False,
                 all_real: bool = True):
        self.all_real = all_real  # no pads: the check masks nothing
        self.index = {layer: i for i, layer in enumerate(layers)}
        heads, d_head, d_model = W_O.shape
        size = (len(layers), *shape, d_model)
        self.whole = whole or math.prod(size) * W_O.element_size() <= HOLD_OUTPUT_BYTES  # the output at every row
        self.content, self.sink = (torch.empty(size, dtype=W_O.dtype) for _ in range(2))
        z_size = (len(layers), shape[0], heads, shape[1], d_head)  # per head, as the pattern applied to v is made
        if heads * d_head <= d_model:  # z in the first part of each layer's term that replaces it once split
            host = (self.sink if self.whole else self.content).view(len(layers), -1)
            self._z = host[:, :math.prod(z_size[1:])].view(z_size)
        else:
            self._z = torch.empty(z_size, dtype=W_O.dtype)
        self._pattern: Tensor | None = None
        self._v: Tensor | None = None  # the kept columns' values
        self.bias = torch.empty(len(layers), d_model, dtype=W_O.dtype)  # b_O per layer
        self.layer_bytes = math.prod(size[1:]) * W_O.element_size()  # a layer's term
        self.stats = [(layer, term) for layer in layers for term in _TERMS]  # of each constancy sum kept (keep)
        self._sums: tuple[Tensor, ...] = ()
        self.errors: list[tuple[int, float]] = []
        # per layer ||z W_O + b_O - out|| and ||out|| (check): one buffer, no small allocation left between the pass's
        self._misses = torch.empty(len(layers), 2)
        self._rows_on: dict[torch.device, tuple[Tensor, Tensor]] = {}  # check rows and their real positions
        self.out_hooks: dict[int, str] = {}  # where each layer's attention output is read
        self._plan: tuple[Tensor, ...] = ()  # see plan
        self._on: dict[torch.device, tuple[Tensor, ...]] = {}

    def hold(self, layer: int, z: Tensor, pattern: Tensor, v: Tensor, out: Tensor) -> None:
        # one buffer per kind for every layer: no small allocation lands between the pass's transients
        if self._pattern is None:
            self._pattern, self._v = (torch.empty(len(self.index), *x.shape, dtype=x.dtype) for x in (pattern, v))
        i = self.index[layer]
        self._z[i].copy_(z.detach().transpose(1, 2))  # the pattern applied to v is made per head
        self._pattern[i].copy_(pattern.detach())
        self._v[i].copy_(v.detach())
        if self.whole:
            self.content[i].copy_(out.detach())

    def check(self, layer: int, z: Tensor, out: Tensor, W_O: Tensor, b_O: Tensor | None, valid: Tensor) -> None:
        """The reconstruction check of ``layer`` (:func:`check_rows`; judged by :meth:`error`): ``z [batch query
        head d_head]`` through ``W_O`` plus ``b_O`` against the output ``out [batch query d_model]`` on the check
        rows' real positions. Where it is small the output is the heads' outputs through ``W_O`` plus ``b_O``,
        and sink + content + ``b_O`` (the heads' outputs split in two, each through ``W_O``) rebuilds it."""
        if z.device not in self._rows_on:
            rows = check_rows(z.shape[1], z.device)
            self._rows_on[z.device] = rows, valid.to(z.device)[:, rows, None]
        rows, on = self._rows_on[z.device]
        self._misses[self.index[layer]] = output_miss(z, out, W_O, b_O, rows, None if self.all_real else on)
        self.out_dtype = out.dtype

    def error(self, layer: int) -> float:
        """:meth:`check`'s relative error of ``layer``."""
        miss, size = self._misses[self.index[layer]].tolist()
        return miss / max(size, 1e-12)

    def held(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Layers ``start:stop`` (in :attr:`index`' order): ``z``, the attention on the kept columns, their
        values and the output (None where it is not held)."""
        return (*(x[start:stop] for x in (self._z, self._pattern, self._v)),
                self.content[start:stop] if self.whole else None)

    def drop_held(self) -> None:
        """Free what was held for the split once every layer is split."""
        self._pattern = self._v = None

    def keep(self, start: int, *terms: tuple[Tensor, ...]) -> None:
        """Keep the constancy sums (:func:`reductions`, each ``[layer ...]``) of the layers from ``start``, per
        term (sink, content), in one buffer per sum for every layer and term (no small allocation per layer
        between the split's transients, which glibc could not give back)."""
        if not self._sums:
            self._sums = tuple(torch.empty(len(_TERMS) * len(self.index), *x.shape[1:], dtype=x.dtype,
                                           device=x.device) for x in terms[0])
        for t, parts in enumerate(terms):
            for buffer, x in zip(self._sums, parts, strict=True):
                buffer[len(_TERMS) * start + t:len(_TERMS) * (start + len(x)):len(_TERMS)].copy_(x)

    def parts(self) -> list[tuple[Tensor, ...]]:
        """The kept constancy sums, one tuple per :attr:`stats` entry."""
        return [tuple(buffer[j] for buffer in self._sums) for j in range(len(self.stats))]

    def plan(self, keys: Tensor, valid: Tensor, sinks: Tensor) -> None:
        """What every layer's split shares: the kept columns that are a sink in some sequence, which
        of them are each sequence's sinks (``keys [batch col]``) and the positions the statistics count
        (real, not a sink)."""
        used = keys.any(0).nonzero()[:, 0]
        self._plan, self._on = (used, keys[:, used], valid & ~sinks), {}

    def on(self, device: torch.device) -> tuple[Tensor, ...]:
        """:meth:`plan`'s tensors on ``device``."""
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in self._plan)
        return self._on[device]


def _split(view: ModelView, layers: Sequence[int], z: Tensor, pattern: Tensor, v: Tensor, out: Tensor | None,
           weights: dict[int, tuple[Tensor, Tensor | None]], terms: _Terms) -> None:
    """Consecutive layers' terms at once, from the heads' outputs ``z [layer batch head query d_head]``, the
    attention on the kept key columns ``pattern [layer batch head query col]`` and their values ``v [layer
    batch col kv_head d_head]`` (which columns are sinks: :meth:`_Terms.plan`). The sink term is each sink's
    value through ``W_O``, weighted; the content term is the rest, the attention output ``out [layer batch
    query d_model]`` less the sink term and ``b_O`` (its per-head statistics from the other keys' share of the
    heads' outputs, through ``W_O``); summed over heads (the per-head terms are read only through their
    factors; where ``out`` is None, the content term is ``z_content W_O`` at every row). Each layer's
    reconstruction error (:meth:`_Terms.check`, taken in the pass) is judged here: what it catches, an output
    that is not ``z W_O + b_O`` (a gate or a norm after the heads), shows at every row. All but the products
    with each layer's ``W_O``: one operation for all the layers."""
    device, first = z.device, terms.index[layers[0]]
    W_Os = [weights[layer][0].to(z) for layer in layers]
    used, keys, keep = terms.on(device)
    at_sinks = pattern.to(device)[..., used] * keys[:, None, None, :].to(pattern.dtype)  # [layer batch head query sink]
    group = z.shape[2] // v.shape[3]  # query heads per kv head
    v = v.to(device)[:, :, used].transpose(2, 3).repeat_interleave(group, dim=2)  # [layer batch head sink d_head]
    z_content = (at_sinks @ v).neg_().add_(z)  # [layer batch head query d_head]: the other keys'
    # per head, each term is a few coefficients times a basis (the sinks' values through W_O; W_O's rows): its
    # constancy sums are read from those factors, the per-head vectors [batch, pos, d_model] never built
    gram = torch.stack([head_gram(W_O, z, view.block(layer).attn) for W_O, layer in zip(W_Os, layers, strict=True)])
    content = reductions(z_content, keep, gram=gram[:, None])  # coefficients: through W_O below
    whole = out is not None
    # through each layer's W_O: the sinks' values and the content sums and, where the output is not held, the
    # content term at every row
    left = torch.cat([v, torch.stack(content[:2], 3)], 3)  # [layer batch head sink+2 d_head]
    projected = left.new_empty(*left.shape[:-1], W_Os[0].shape[-1])
    target = terms.content[first:first + len(layers)]  # z is not read after z_content: the terms may overwrite it
    same = target.dtype == z.dtype and target.device == device
    through = None if whole else target if same else z_content.new_empty(*z.shape[:2], z.shape[3], W_Os[0].shape[-1])
    for i, W_O in enumerate(W_Os):
        torch.matmul(left[i], W_O, out=projected[i])
        if through is not None:
            torch.matmul(z_content[i].transpose(1, 2).flatten(2), W_O.flatten(0, 1), out=through[i])
    n_sinks = v.shape[3]
    sink_values = projected[..., :n_sinks, :]  # [layer batch head sink d_model]: each sink's value through W_O
    held = terms.sink[first:first + len(layers)]  # z's memory where the output is held whole: z is read no more
    sink = held if held.dtype == z.dtype and held.device == device else None
    sink = torch.matmul(at_sinks.transpose(2, 3).flatten(3), sink_values.flatten(2, 3), out=sink)  # [.. query d_model]
    stats = (reductions(at_sinks, keep, basis=sink_values),
             (projected[..., n_sinks, :], projected[..., n_sinks + 1, :], *content[2:]))
    bias = torch.stack([torch.zeros(W_O.shape[-1], dtype=z.dtype, device=device) if weights[layer][1] is None
                        else weights[layer][1].to(z) for W_O, layer in zip(W_Os, layers, strict=True)])
    for layer in layers:
        err = terms.error(layer)
        check_error(view, layer, err, terms.out_dtype, terms.out_hooks[layer])
        terms.errors.append((layer, err))
    terms.keep(first, *stats)
    if not whole:  # the output not held (a long text): the content term through W_O
        if through is not target:
            target.copy_(through)
    elif out.dtype == target.dtype and out.device == device:
        torch.sub(out, sink, out=target).sub_(bias[:, None, None])  # the output less sink and b_O (in place if held)
    else:
        target.copy_(out.to(device) - sink.to(out.dtype) - bias[:, None, None].to(out.dtype))
    if sink is not held:
        held.copy_(sink)
    terms.bias[first:first + len(layers)].copy_(bias)


_TERMS = ("sink", "content")

# the layers' terms ([layer, batch, pos, d_model]) split at once (the split's transients are a few times that):
# every layer of SmolLM2 at 128 tokens, one at a time from about 1,000 tokens
SPLIT_BYTES = 4 << 20

# a term's buffer ([layer, batch, pos, d_model]) up to which, when the sinks are found in the pass, the attention
# output is held whole (its content term then costs no product); above it not at all
HOLD_OUTPUT_BYTES = 32 << 20

# the split's freed transients handed back every TRIM_EVERY layers at length (core.budget.LayerTrim) and once after
# it (the pass trims its own layers, core.pass_reader.TRIM_EVERY). Measured when this module trimmed in the pass:
# at 2,048 tokens (one thread, docs/benchmarks.md round 4) every layer 1.18x the SDPA forward's time, 0.85x its
# memory; every third 1.14x, 0.89x; never 1.09x, 1.54x (freed transients between held buffers stay resident).
# Round 5, what is held in one buffer per kind (_Terms), benchmarks.length: every 5th layer 1.05x, 0.90x; every 10th
# 1.05-1.12x, 0.99-1.13x (memory over the goal); every 3rd 1.08-1.13x, 0.86-0.96x
TRIM_EVERY = 5
