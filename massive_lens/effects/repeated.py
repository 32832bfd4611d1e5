"""The repeated-token circuit (Yona et al., ICML 2025, "Interpreting the Repeated Token Phenomenon").

A model's first token becomes an attention sink because the model can tell it is first: in
the first layers it attends only to itself, and an MLP neuron then amplifies its norm into a
massive activation. Repeat one token many times after the first token and the first token's
share of each repeat's attention is diluted, so the repeats' early attention outputs drift
towards what the token would give *as a first token*; past some length the same neuron fires
and the repeats turn into sinks themselves.

:func:`repeated_token_probe` runs ``[first] + [token] * n`` (``first`` is BOS when the model
prepends one, else the token itself, unless given) and reports:

- per position, the residual norm at the **sink layer** (where the first token's norm peaks)
  over the first token's (``norm_ratio``), its cosine with the token's own first-token
  residual there (``cos_first``, from a pass over ``[token]`` alone), and whether the sink census
  counts the position as a sink (``sink``); ``onset``: the first repeat whose ``norm_ratio``
  reaches ``like`` (default 0.25);
- per layer-0 head, how far its output at the repeats is from the token's first-token output
  (relative distance), over the first and the last eighth of the repeats (``heads``): the
  **marking head** is the one whose output converges most;
- the **neuron** that amplifies: the largest MLP neuron contribution to the first token's
  massive dim at the onset, from :func:`~massive_lens.trace_origin`;
- the **patch**: that neuron's activation set to zero at every position but the first. Its
  effect on the repeated sequence (``patched_ratio``, the KL divergence of the next-token
  distribution, ``kl``) and on ordinary text (perplexity with and without it on ``text``, which
  must not get worse).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from massive_lens.attention import sink_census
from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import bootstrap_mean
from massive_lens.errors import MassiveLensError
from massive_lens.metrics import perplexity
from massive_lens.origin import trace_origin


@dataclass(frozen=True, kw_only=True)
class RepeatedToken(Result):
    """What a long repetition does, the circuit behind it and the patch that stops it (see the
    module docstring).

    ``to_frame()``: one row per position: ``pos``, ``norm``, ``norm_ratio``, ``cos_first``,
    ``sink`` (the census counts it), ``patched_ratio``, ``kl`` (nats, patched against original,
    of the next-token distribution at that position). ``heads``: per layer-0 ``head``, ``early``,
    ``late`` (relative distance of its output to the token's first-token output) and
    ``converges`` (early - late). ``ppl``: ``setting`` (``original``/``patched``), ``perplexity``
    on ordinary text, with ``perplexity_low``/``perplexity_high`` for the patched/original ratio.
    """

    frame: pd.DataFrame
    heads: pd.DataFrame
    ppl: pd.DataFrame
    model_name: str
    token: str
    n: int
    layer: int
    dim: int
    onset: int
    neuron_layer: int
    neuron: int
    like: float
    first: str = ""

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    @property
    def marking_head(self) -> int:
        return int(self.heads.loc[self.heads["converges"].idxmax(), "head"]) if len(self.heads) else -1

    def summary(self) -> str:
        f = self.frame[self.frame["pos"] > 0]
        text = (f"{self.model_name}: {self.token!r} repeated {self.n} times after {self.first or 'itself'!r}; sink "
                f"layer {self.layer} (the first "
                f"token's norm peaks there, dim {self.dim}); repeats reach at most {f['norm_ratio'].max():.2f} of "
                f"the first token's norm, {int(f['sink'].sum())} of them act as sinks (census)")
        if self.first == self.token:
            text += (" (the first token is the repeated one: a causal model with rotary positions computes the "
                     "same state at every position, so the repeats match the first token trivially; give first=)")
        if self.onset < 0:
            return text + f"; none reaches {self.like:g} of its norm, so there is no circuit to patch at this length"
        if self.neuron < 0:
            return text + (f"; from position {self.onset} they reach {self.like:g} of it, but trace_origin names "
                           f"no MLP neuron writing dim {self.dim} there (no amplifying neuron, nothing patched)")
        ppl = self.ppl.set_index("setting")
        after = f[f["pos"] >= self.onset]
        text += (f"; from position {self.onset} the repeats look like the first token (norm >= {self.like:g} of it, "
                 f"cosine to the token's own first-token state {after['cos_first'].median():.2f}); layer-0 head "
                 f"{self.marking_head} converges most to its first-token output; neuron {self.neuron} of layer "
                 f"{self.neuron_layer} amplifies. Patched (neuron zeroed after the first token): repeats at most "
                 f"{f['patched_ratio'].max():.2f} of the first token's norm, next-token KL {after['kl'].mean():.3g} "
                 f"nats after the onset and {f[f['pos'] < self.onset]['kl'].mean():.3g} before; ordinary-text "
                 f"perplexity {ppl.loc['original', 'perplexity']:.3f} -> {ppl.loc['patched', 'perplexity']:.3f} "
                 f"(ratio 95% CI {ppl.loc['patched', 'ratio_low']:.4f}-{ppl.loc['patched', 'ratio_high']:.4f})")
        return text

    def plot(self, ax: Any = None) -> Any:
        """Each position's norm over the first token's at the sink layer, original and patched."""
        ax = ensure_axes(ax, (8, 4))
        f = self.frame[self.frame["pos"] > 0]
        ax.plot(f["pos"], f["norm_ratio"], label="original", lw=1)
        if f["patched_ratio"].notna().any():
            ax.plot(f["pos"], f["patched_ratio"], label=f"neuron {self.neuron_layer}.{self.neuron} zeroed", lw=1)
        ax.axhline(self.like, color="grey", ls=":", lw=1)
        if self.onset > 0:
            ax.axvline(self.onset, color="C3", ls="--", lw=1, label=f"onset {self.onset}")
        ax.set(xlabel="position", ylabel=f"norm / first token's (layer {self.layer})", yscale="log",
               title=f"{self.model_name}: {self.token!r} x {self.n}")
        ax.legend(fontsize=8)
        return ax


def _pass(view: ModelView, ids: Tensor, hooks: list) -> tuple[Tensor, dict[str, Any], Tensor]:
    """Residual norms ``[layer, pos]``, what the hooks kept (``resid`` per layer, layer-0 ``z``) and the
    next-token log-probabilities ``[pos, d_vocab]``."""
    seen: dict[str, Any] = {"norms": {}, "resid": {}}

    def resid(x: Tensor, hook: Any, *, layer: int) -> None:
        seen["norms"][layer] = x[0].detach().float().norm(dim=-1).cpu()
        seen["resid"][layer] = x[0].detach().float().cpu()

    def z0(x: Tensor, hook: Any) -> None:
        seen["z"] = x[0].detach().float().cpu()

    mine = [(view.hook_name(layer, "resid_post"), partial(resid, layer=layer)) for layer in range(view.n_layers)]
    logits = view.forward(view.full_batch(ids), list(hooks) + mine + [(view.hook_name(0, "attn.hook_z"), z0)])
    norms = torch.stack([seen["norms"][layer] for layer in range(view.n_layers)])
    return norms, seen, logits[0].float().log_softmax(-1).cpu()


def _zero_neuron(post: Tensor, hook: Any, *, neuron: int) -> Tensor:
    post = post.clone()
    post[:, 1:, neuron] = 0.0
    return post


def patch_hooks(view: ModelView, layer: int, neuron: int) -> list[tuple[str, Any]]:
    """The patch: MLP ``neuron`` of ``layer`` zeroed at every position but the first."""
    return [(view.hook_name(layer, "mlp.hook_post"), partial(_zero_neuron, neuron=neuron))]


def _head_rows(z: Tensor, first: Tensor) -> pd.DataFrame:
    """Per head: relative distance of the repeats' outputs to the first-token output, early and late."""
    dist = (z[1:] - first[None]).norm(dim=-1) / first.norm(dim=-1).clamp(min=1e-12)[None]  # [repeat head]
    k = max(1, len(dist) // 8)
    early, late = dist[:k].mean(0), dist[-k:].mean(0)
    return pd.DataFrame({"head": range(len(early)), "early": early.tolist(), "late": late.tolist(),
                         "converges": (early - late).tolist()})


def repeated_token_probe(model: Any, token: str | int, n: int, *, like: float | int = 0.25, text: Corpus = None,
                         seq_len: int = 128, n_seqs: int = 8, first: str | int | None = None) -> RepeatedToken:
    """Repeat ``token`` ``n`` times after the first token; find where the repeats start to look like
    the first token, the layer-0 head and the neuron behind it, and patch it (see the module docstring).

    Args:
        model: a TransformerLens-style model with MLP neurons (``mlp.hook_post``).
        token: the token, as text (it must be one token) or an id.
        n: repeats after the first token (``n + 1`` tokens within the context).
        like: the share of the first token's norm at which a repeat counts as looking like it
            (default 0.25).
        text: ordinary text for the patch's perplexity check (a corpus; None: the offline default text).
        seq_len: tokens per sequence of that check (default 128).
        n_seqs: sequences of that check (default 8).
        first: the token before the repeats, as text (one token) or an id (None: BOS when the
            model prepends one, else the repeated token itself, for which the probe is trivial;
            a model without BOS needs one, e.g. its document separator ``"<|endoftext|>"``).

    Returns:
        A :class:`RepeatedToken`.

    Raises:
        MassiveLensError: if ``token`` is not exactly one token, ``n`` is below 8 or beyond the
            context, or ``like`` is not in (0, 1].

    >>> from massive_lens import tiny_model
    >>> probe = repeated_token_probe(tiny_model("llama"), "a", 16, n_seqs=2, seq_len=16, text="x y z " * 20)
    >>> len(probe.to_frame()), len(probe.heads) == tiny_model("llama").cfg.n_heads
    (17, True)
    """
    view = ModelView(model)
    token_id = _one_token(view, token)
    if isinstance(n, bool) or not isinstance(n, int) or n < 8:
        raise MassiveLensError(f"n must be an integer >= 8 (repeats after the first token), got {n!r}")
    if isinstance(like, bool) or not isinstance(like, (int, float)) or not 0 < like <= 1:
        raise MassiveLensError(f"like is a share of the first token's norm in (0, 1], got {like!r}")
    bos = view.tokenizer.bos_token_id if getattr(view.cfg, "default_prepend_bos", True) else None
    first_id = _one_token(view, first) if first is not None else token_id if bos is None else bos
    ids = torch.tensor([[first_id] + [token_id] * n])
    view.check_length(ids.shape[1])
    norms, seen, logp = _pass(view, ids, [])
    layer = int(norms[:, 0].argmax())
    dim = int(seen["resid"][layer][0].abs().argmax())
    _, alone, _ = _pass(view, torch.tensor([[token_id]]), [])
    ratio = norms[layer] / norms[layer, 0]
    cos = torch.nn.functional.cosine_similarity(seen["resid"][layer], alone["resid"][layer][0][None], dim=-1)
    census = sink_census(model, ids, batch_size=1)
    sinks = set(census.frame[census.frame["level"] != "transient"]["pos"].tolist())
    hits = (ratio[1:] >= like).nonzero()
    onset = int(hits[0]) + 1 if len(hits) else -1
    frame = pd.DataFrame({"pos": range(ids.shape[1]), "norm": norms[layer].tolist(), "norm_ratio": ratio.tolist(),
                          "cos_first": cos.tolist(), "sink": [p in sinks for p in range(ids.shape[1])],
                          "patched_ratio": float("nan"), "kl": float("nan")})
    heads = _head_rows(seen["z"], alone["z"][0])
    tok_text, first_text = view.tokenizer.decode([token_id]), view.tokenizer.decode([first_id])
    mlp = pd.DataFrame()
    if onset > 0:
        trace = trace_origin(model, ids[0, :onset + 1], dim=dim, pos=onset)
        mlp = trace.neurons[(trace.neurons["layer"] <= layer) & (trace.neurons["contribution"] > 0)]
    if not len(mlp):  # nothing looks like the first token, or no MLP neuron writes its dim there
        return RepeatedToken(frame=frame, heads=heads, ppl=pd.DataFrame(), model_name=view.name, token=tok_text, n=n,
                             layer=layer, dim=dim, onset=onset, neuron_layer=-1, neuron=-1, like=like, first=first_text)
    top = mlp.loc[mlp["contribution"].idxmax()]
    n_layer, neuron = int(top["layer"]), int(top["neuron"])
    patch = patch_hooks(view, n_layer, neuron)
    p_norms, _, p_logp = _pass(view, ids, patch)
    frame["patched_ratio"] = (p_norms[layer] / p_norms[layer, 0]).tolist()
    frame["kl"] = (logp.exp() * (logp - p_logp)).sum(-1).tolist()
    ordinary = sequences(view, text, seq_len, n_seqs)
    base = perplexity(model, ordinary, progress=False)
    patched = perplexity(model, ordinary, hooks=patch, progress=False)
    low, high = bootstrap_mean(patched.per_seq - base.per_seq)
    ppl = pd.DataFrame([dict(setting="original", perplexity=base.perplexity, ratio=1.0, ratio_low=1.0, ratio_high=1.0),
                        dict(setting="patched", perplexity=patched.perplexity,
                             ratio=patched.perplexity / base.perplexity, ratio_low=float(torch.tensor(low).exp()),
                             ratio_high=float(torch.tensor(high).exp()))])
    return RepeatedToken(frame=frame, heads=heads, ppl=ppl, model_name=view.name, token=tok_text, n=n, layer=layer,
                         dim=dim, onset=onset, neuron_layer=n_layer, neuron=neuron, like=like, first=first_text)


def _one_token(view: ModelView, token: str | int) -> int:
    """The id of ``token`` (text that must be exactly one token, or an id)."""
    if isinstance(token, str):
        ids = view.tokenize(token, prepend_bos=False).tokens[0].tolist()
        if len(ids) != 1:
            raise MassiveLensError(f"{token!r} is {len(ids)} tokens for {view.name}; give one token (or its id)")
        return ids[0]
    return int(view.check_tokens(torch.tensor([token]))[0])

