"""The exact split of the attention logit on the sink, for :func:`~massive_lens.attention.sink_circuit`.

One forward pass keeps, per layer, what the logit ``s_i = c * q_i . k_sink`` is made of (``c`` the
attention's scale): the sink position's residual by its writers (``hook_embed``, ``hook_pos_embed``,
each block's attention and MLP output as added to the residual: after the post-norm where the
model has one, the rule of :func:`~massive_lens.origin.blocks.block_plan`),
the layer's norm at the sink (input, scale, output) and, from the attention pass
(:mod:`~massive_lens.core.attention_pass`), the sink's key, every query, the sink column of
the attention scores and pattern. Afterwards each writer part ``p`` is carried to the key:

    key(p) = R_sink( knorm( W_K^T ( C(p) * w / scale ) ) )

with ``C`` the LayerNorm centring (RMSNorm: none), ``w`` the norm's weight and ``scale`` the norm's
(and the key norm's, where the model has one) scale **measured at the actual input**, so every step
is linear and the parts (plus the norm's bias and ``b_K``, each its own part) add up to the key
exactly. The form of each norm (centring, ``w`` or ``1 + w``) is read off its own output, never
from the architecture's name; a key, a score or a norm that the parts do not reproduce is a
:class:`MassiveLensError` naming what differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.attention_pass import PassLayer, attention_reading, choose_path
from massive_lens.core.criterion import Criterion, massive_mask
from massive_lens.core.layer_attention import rest_lse
from massive_lens.core.model_view import ModelView
from massive_lens.core.pass_reader import missing_attention, rotates
from massive_lens.core.stats import rel_error
from massive_lens.core.tokens import Batch
from massive_lens.errors import MassiveLensError

TOL = 1e-4  # relative, float32: what "exact" means here
# what the split reads of each layer's attention from the pass: every query and the sink's key as the
# scores use them, the scores and the pattern on the sink's column, the content keys' log-sum-exp, and
# the rotary cos/sin (on the kernel: its module's inputs; the eager path where they lack them, core.lse.lse_rotary)
WANTS = ("q", "k", "scores", "rest_lse", "rotary")


@dataclass
class LayerKeep:
    """What the pass and the hooks kept of one layer (sink rows, or every query for ``q``)."""

    x: Tensor | None = None  # [B d] the norm's input at the sink
    scale: Tensor | None = None  # [B 1]
    out: Tensor | None = None  # [B d] the norm's output at the sink
    massive: Tensor | None = None  # [B d] bool: massive dims at the sink (this layer's input)
    k: Tensor | None = None  # [B kv dh] the sink's key as the scores read it
    q: Tensor | None = None  # [B P H dh] every query as the scores read it
    scores: Tensor | None = None  # [B H P] the sink column of the scores
    content_lse: Tensor | None = None  # [B H P] log-sum-exp of each query's scores on the other keys
    pattern: Tensor | None = None  # [B H P] the sink column of the pattern
    cos: Tensor | None = None  # [B? P r]
    sin: Tensor | None = None
    kn: dict[str, Tensor] = field(default_factory=dict)  # key norm at the sink: in, scale, out
    qn_scale: Tensor | None = None  # [B P H 1] query norm scale

    def put(self, attr: str, value: Tensor) -> None:
        """Keep ``value`` as ``attr`` (what a hook read)."""
        setattr(self, attr, value)


def _sink_row(x: Tensor, sink: int) -> Tensor:
    return x.detach()[:, sink].float().clone()


def visible_token(token: str) -> str:
    """``token`` with its whitespace shown (``'\\n'`` as ``⏎``, a tab as ``⇥``, ``'\\r'`` as ``␍``; a token of
    spaces only as ``␣``), so a whitespace token never prints blank.

    >>> visible_token(" \\n"), visible_token("  "), visible_token(" the")
    (' ⏎', '␣␣', ' the')
    """
    shown = token.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "␍")
    return shown.replace(" ", "␣") if not shown.strip() else shown


def content_lse(scores: Tensor, keys: Tensor, sink: int = 0) -> Tensor:
    """[B H P]: the log-sum-exp of each query's scores over the keys it sees other than the sink
    (``keys`` [B P] the real positions; causal), so ``scores[..., sink] - content_lse`` is the sink
    logit's margin over the content logits, ``log(p_sink / (1 - p_sink))``: a key-side removal of
    ``d`` from the sink's logit leaves it a sink while ``d`` is under that margin plus ``log(7/3)``
    (:func:`~massive_lens.core.layer_attention.rest_lse`, the pass's ``rest_lse``)."""
    return rest_lse(scores, keys, [sink])


class CircuitCapture:
    """One pass that keeps, per chosen layer, a :class:`LayerKeep`, and each writer's output at the
    sink (``writers``: name -> [B d]). The attention (queries, the sink's key, the scores and the
    pattern on the sink's column, the content keys' log-sum-exp, the rotary cos/sin) is the attention
    pass's (:func:`~massive_lens.core.attention_pass.attention_reading`, its path chosen by
    :func:`~massive_lens.core.attention_pass.choose_path` for :data:`WANTS`); the writers' outputs and the
    norms' sites are ordinary hooks on the same forward. :meth:`run` runs a forward under both."""

    def __init__(self, view: ModelView, batch: Batch, layers: list[int], criterion: Criterion, sink: int = 0):
        self.view, self.batch, self.layers, self.criterion, self.sink = view, batch, layers, criterion, sink
        self.keep = {layer: LayerKeep() for layer in layers}
        self.writers: dict[str, Tensor] = {}
        self.path = choose_path(view, "auto", batch, want=WANTS)
        self.buffers: dict[str, Tensor] = {}  # what is kept of every layer, allocated once (see :meth:`kept`)
        self.rotary: list[tuple[Tensor, Tensor, Any]] = []  # each distinct (cos, sin) read, and its copy

    def run(self, forward: Callable[[list[tuple[str, Any]]], Any]) -> Any:
        """``forward(hooks)`` (one forward of the capture's batch with ``hooks``) under the capture's
        reading; returns what ``forward`` returns."""
        hooks = self.hooks()
        reader = attention_reading(self.view, self.on_layer, path=self.path, batch=self.batch, columns=[self.sink],
                                   want=WANTS, layers=self.layers)
        with reader:
            out = forward([*hooks, *reader.hooks])
        for layer in sorted(set(self.layers) - reader.done):
            why = reader.unread(layer) or "its attention was not read"
            raise MassiveLensError(f"{self.view.name}, layer {layer}: {why}; sink_circuit cannot read them")
        return out

    def on_layer(self, at: PassLayer) -> None:
        """Keep what the pass read of one layer (its sink column, every query, the sink's key)."""
        keep, s = self.keep[at.layer], self.sink
        keep.k = _sink_row(at.k, s)
        keep.q = self.kept("q", at.layer, at.q)
        keep.scores = self.kept("scores", at.layer, at.scores[..., 0])
        keep.pattern = self.kept("pattern", at.layer, at.cols[..., 0])
        keep.content_lse = self.kept("content_lse", at.layer, at.rest_lse)
        if at.rotary is not None:  # one copy of each (cos, sin): the layers share them
            seen = next((copy for cos, sin, copy in self.rotary if cos is at.rotary[0] and sin is at.rotary[1]), None)
            if seen is None:
                seen = tuple(x.detach().float().clone() for x in at.rotary)
                self.rotary.append((*at.rotary, seen))
            keep.cos, keep.sin = seen

    def kept(self, name: str, layer: int, x: Tensor) -> Tensor:
        """A float32 copy of ``x`` in this layer's slice of one buffer for every layer, allocated at the
        first layer: the layers' copies (every query's ``q``: O(length x d_model) a layer) are one block
        of memory, not many between the forward's activations, where the heap would keep those freed."""
        if name not in self.buffers:
            self.buffers[name] = torch.empty((len(self.layers), *x.shape), dtype=torch.float32, device=x.device)
        if self.buffers[name].shape[1:] != x.shape:  # a layer of another shape (other heads): a copy of its own
            return x.detach().float().clone()
        return self.buffers[name][self.layers.index(layer)].copy_(x.detach())

    def hooks(self) -> list[tuple[str, Any]]:
        """The writers' outputs at the sink and the norms' sites of each chosen layer (the attention is
        the pass's: :meth:`run`)."""
        v, out = self.view, []
        for name in ("hook_embed", "hook_pos_embed"):
            if name in v.hook_names:
                out.append((name, self._writer(name.removeprefix("hook_"))))
        for layer in range(max(self.layers)):
            for kind, post in (("attn", "ln1_post.hook_out"), ("mlp", "ln2_post.hook_out")):
                hook = post if v.has_hook(layer, post) else f"hook_{kind}_out"  # what the residual adds
                if not v.has_hook(layer, hook):
                    raise MassiveLensError(f"{v.name}: block {layer} shows no {kind} output (hook_{kind}_out): "
                                           "sink_circuit splits the sink's residual by the attention and MLP "
                                           "outputs of every earlier block (state-space and recurrent blocks "
                                           "have none); pass layers before it, or a model whose blocks all "
                                           "attend")
                out.append((v.hook_name(layer, hook), self._writer(f"{kind} {layer}")))
        for layer in self.layers:
            for hook, fn in self._norm_hooks(layer):
                out.append((v.hook_name(layer, hook), fn))
        return out

    def _writer(self, name: str) -> Any:
        def keep(x: Tensor, hook: Any) -> None:
            self.writers[name] = _sink_row(x, self.sink)
        return keep

    def _norm_hooks(self, layer: int) -> list[tuple[str, Any]]:
        v, keep, s = self.view, self.keep[layer], self.sink
        if not v.has_hook(layer, "ln1.hook_in") or not v.has_hook(layer, "ln1.hook_scale"):
            raise MassiveLensError(f"{v.name}: layer {layer} has no ln1.hook_in/hook_scale; sink_circuit splits the "
                                   "key through the norm before attention and needs its input and scale")
        why = missing_attention(v, layer, set(WANTS))
        if why is not None:
            raise MassiveLensError(f"{v.name}: {why}: sink_circuit needs an attention layer")
        valid = self.batch.mask

        def norm_in(x: Tensor, hook: Any) -> None:
            keep.x = _sink_row(x, s)
            keep.massive = massive_mask(x.detach(), self.criterion, valid.to(x.device))[:, s].cpu()

        def setter(attr: str) -> Any:
            def fn(x: Tensor, hook: Any) -> None:
                keep.put(attr, _sink_row(x, s))
            return fn

        n_pos = self.batch.tokens.shape[1]

        def kn(key: str) -> Any:  # a per-head norm: [B P head dh] or HF's [B head P dh]
            def fn(x: Tensor, hook: Any) -> None:
                keep.kn[key] = _sink_row(x if x.shape[1] == n_pos else x.transpose(1, 2), s)
            return fn

        def qn(x: Tensor, hook: Any) -> None:
            keep.qn_scale = (x if x.shape[1] == n_pos else x.transpose(1, 2)).detach().float().clone()

        hooks = [("ln1.hook_in", norm_in), ("ln1.hook_scale", setter("scale")), ("ln1.hook_out", setter("out"))]
        if v.has_hook(layer, "attn.k_norm.hook_scale"):
            hooks += [(f"attn.k_norm.hook_{k}", kn(k)) for k in ("in", "scale", "out")]
        if v.has_hook(layer, "attn.q_norm.hook_scale"):
            hooks.append(("attn.q_norm.hook_scale", qn))
        return hooks


def norm_params(module: Any) -> tuple[Tensor | None, Tensor | None]:
    """(weight, bias) of a norm module (a bridge's wrapped module, or TransformerLens's ``w``/``b``)."""
    inner = getattr(module, "original_component", None) or module
    weight = getattr(inner, "weight", None)
    weight = weight if isinstance(weight, Tensor) else getattr(inner, "w", None)
    bias = getattr(inner, "bias", None)
    bias = bias if isinstance(bias, Tensor) else getattr(inner, "b", None)
    return (weight.detach().float() if isinstance(weight, Tensor) else None,
            bias.detach().float() if isinstance(bias, Tensor) else None)


@dataclass(frozen=True)
class NormMap:
    """A norm made linear at its measured scale: ``part -> C(part) * w / scale`` (+ ``bias`` apart)."""

    centre: bool
    weight: Tensor  # effective: w or 1 + w
    bias: Tensor | None

    def __call__(self, part: Tensor, scale: Tensor) -> Tensor:
        if self.centre:
            part = part - part.mean(-1, keepdim=True)
        return part * self.weight / scale


def read_norm(module: Any, x: Tensor, scale: Tensor, out: Tensor, where: str) -> NormMap:
    """The form of a norm that reproduces ``out`` from ``x`` and ``scale`` (centring or not,
    weight ``w`` or ``1 + w``), checked; else a clear error."""
    weight, bias = norm_params(module)
    ones = torch.ones(x.shape[-1])
    best = None
    for centre in (False, True):
        for w in ([weight, 1 + weight] if weight is not None else [ones]):
            m = NormMap(centre, w.to(x.device), None if bias is None else bias.to(x.device))
            got = m(x, scale) + (0 if m.bias is None else m.bias)
            err = rel_error(got, out)
            if err < TOL:
                return m
            best = err if best is None else min(best, err)
    raise MassiveLensError(f"{where}: the norm's output is not (x or x - mean(x)) * w / scale + b at its measured "
                           f"scale (closest form off by {best:.1e} relative), so it cannot be made linear at that "
                           "scale and nothing can be split through it")


def rotate(v: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    """HF's rotate-half rotary embedding of ``v`` [..., dh] with ``cos``/``sin`` [..., r] (r <= dh:
    partial rotary leaves the rest); identity without rotary."""
    if cos is None or sin is None:
        return v
    r = cos.shape[-1]
    a = v[..., :r]
    half = torch.cat([-a[..., r // 2:], a[..., : r // 2]], -1)
    return torch.cat([a * cos + half * sin, v[..., r:]], -1)


@dataclass(frozen=True)
class LayerSplit:
    """The key side of one layer, per sequence: ``keys`` [B part kv dh] (each part's contribution
    to the sink key), ``names`` and ``dims`` ('massive'/'other'/'all') of the parts; ``scale`` the
    attention's logit scale; ``q`` [B P H dh] the queries; ``q_bias`` [B P H dh] the part of each
    query that is ``b_Q`` (zeros without one); ``valid`` [B P] the queries read (real, after the sink)."""

    keys: Tensor
    names: list[str]
    dims: list[str]
    scale: float
    q: Tensor
    q_bias: Tensor
    valid: Tensor
    key_error: float
    has_bq: bool


def _bias(attn: Any, name: str, heads: int, dh: int) -> Tensor | None:
    try:
        b = getattr(attn, name, None)
    except Exception:  # noqa: BLE001 - bridges raise many kinds for weights they cannot expose
        b = None
    if not isinstance(b, Tensor) or b.numel() != heads * dh or not bool(b.detach().abs().max() > 0):
        return None
    return b.detach().float().reshape(heads, dh)


def split_layer(view: ModelView, cap: CircuitCapture, layer: int) -> LayerSplit:
    """The key parts of ``layer`` for every sequence, checked to add up to the sink's key."""
    keep, block, where = cap.keep[layer], view.block(layer), f"{view.name}, layer {layer}"
    silent = [name for name, got in (("ln1 input", keep.x), ("ln1 scale", keep.scale), ("ln1 output", keep.out))
              if got is None]
    if silent:
        raise MassiveLensError(f"{where}: the hooks of the {', '.join(silent)} did not fire; sink_circuit cannot "
                               "read them")
    names = ["embed"] + (["pos_embed"] if "pos_embed" in cap.writers else [])
    names += [f"{kind} {i}" for i in range(layer) for kind in ("attn", "mlp")]
    missing = [n for n in names if n not in cap.writers]
    if missing:
        raise MassiveLensError(f"{where}: the writers {missing} did not fire; sink_circuit cannot split the residual")
    parts = torch.stack([cap.writers[n].to(keep.x.device) for n in names], 1)  # [B W d]
    err = rel_error(parts.sum(1), keep.x)
    if err > TOL:
        raise MassiveLensError(f"{where}: the embeddings and the block outputs do not add up to the residual the "
                               f"attention reads (off by {err:.1e} relative); the block adds something no hook shows")
    norm = read_norm(block.ln1, keep.x, keep.scale, keep.out, f"{where} (ln1)")
    mask = keep.massive.to(parts.device)[:, None, :].float()
    split = torch.cat([parts * mask, parts * (1 - mask)], 1)  # [B 2W d]: massive dims, other dims
    normed = norm(split, keep.scale[:, None])
    labels = names + names
    dims = ["massive"] * len(names) + ["other"] * len(names)
    if norm.bias is not None:
        normed = torch.cat([normed, norm.bias.expand(len(parts), 1, -1)], 1)
        labels, dims = labels + ["norm bias"], dims + ["all"]
    attn = block.attn
    try:
        w_k = getattr(attn, "W_K", None)
    except Exception:  # noqa: BLE001 - latent attention's bridge raises for W_K
        w_k = None
    kv, dh = keep.k.shape[-2:]
    if not isinstance(w_k, Tensor) or tuple(w_k.shape) != (kv, view.d_model, dh):
        raise MassiveLensError(f"{where}: W_K is {None if not isinstance(w_k, Tensor) else tuple(w_k.shape)}, not "
                               f"[{kv}, {view.d_model}, {dh}]; sink_circuit needs the key projection per kv head "
                               "(a fused or compressed key, as in latent attention, is not split)")
    keys = torch.einsum("bpd,hde->bphe", normed, w_k.detach().float().to(normed.device))
    b_k = _bias(attn, "b_K", kv, dh)
    if b_k is not None:
        keys = torch.cat([keys, b_k.to(keys.device).expand(len(keys), 1, kv, dh)], 1)
        labels, dims = labels + ["b_K"], dims + ["all"]
    if keep.kn:
        kmap = read_norm(block.attn.k_norm, keep.kn["in"], keep.kn["scale"], keep.kn["out"], f"{where} (k_norm)")
        wide = keep.kn["in"].shape[-1] == kv * dh and kv > 1  # one norm over every head's key (OLMoE)
        flat = keys.flatten(2) if wide else keys
        flat = kmap(flat, keep.kn["scale"][:, None])
        keys = flat.unflatten(2, (kv, dh)) if wide else flat
        if kmap.bias is not None:
            keys = torch.cat([keys, kmap.bias.reshape(kv, dh).expand(len(keys), 1, kv, dh)], 1)
            labels, dims = labels + ["k_norm bias"], dims + ["all"]
    cos = None if keep.cos is None else keep.cos.expand(len(keys), -1, -1)[:, cap.sink]
    sin = None if keep.sin is None else keep.sin.expand(len(keys), -1, -1)[:, cap.sink]
    keys = rotate(keys, None if cos is None else cos[:, None, None], None if sin is None else sin[:, None, None])
    # (a rotary model without cos/sin hooks: the sink's own rotation is checked against its key just below)
    key_error = rel_error(keys.sum(1), keep.k)
    if key_error > TOL:
        raise MassiveLensError(f"{where}: the key parts do not add up to the sink's key (off by {key_error:.1e} "
                               "relative): the key is not W_K^T norm(x) + b_K under a rotate-half rotary "
                               "embedding (e.g. an interleaved rotary layout or a key transform sink_circuit does "
                               "not know)")
    heads = keep.q.shape[2]
    b_q = _bias(attn, "b_Q", heads, dh)
    q_bias = torch.zeros_like(keep.q)
    if b_q is not None:
        q_bias = b_q.to(q_bias.device).expand_as(q_bias).clone()
        if keep.qn_scale is not None:
            raise MassiveLensError(f"{where}: a query bias followed by a query norm: b_Q's share of each query "
                                   "is not split by sink_circuit (the key side would be; pass heads of another layer)")
        if keep.cos is None and rotates(view, layer):
            raise MassiveLensError(f"{where}: the model rotates its queries but shows no attn.hook_cos/hook_sin, so "
                                   "b_Q cannot be carried to each query's position; sink_circuit needs those hooks")
        if keep.cos is not None:
            c, s = keep.cos.expand(len(q_bias), -1, -1), keep.sin.expand(len(q_bias), -1, -1)
            q_bias = rotate(q_bias, c[:, :, None], s[:, :, None])
    valid = cap.batch.mask.clone().to(keep.q.device)
    valid[:, : cap.sink + 1] = False
    group = heads // kv
    raw = torch.einsum("bqhe,bhe->bhq", keep.q, keep.k.repeat_interleave(group, 1))
    w = valid[:, None].expand_as(raw)
    scale = float((raw * keep.scores)[w].sum() / (raw * raw)[w].sum().clamp(min=1e-30))
    score_error = rel_error(scale * raw[w], keep.scores[w]) if bool(w.any()) else 0.0
    if score_error > TOL:
        raise MassiveLensError(f"{where}: the attention scores on the sink are not a constant times q . k (off by "
                               f"{score_error:.1e} relative): soft-capped or position-biased (ALiBi) scores, or query "
                               "and key hooks that do not hold what the scores multiply, are not split by "
                               "sink_circuit")
    return LayerSplit(keys=keys, names=labels, dims=dims, scale=scale, q=keep.q, q_bias=q_bias, valid=valid,
                      key_error=key_error, has_bq=b_q is not None)
