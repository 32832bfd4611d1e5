"""Why the first token: the sink's circuit, split exactly and then cut.

A sink head puts most of its attention on the first token because the logit ``s_i = c q_i . k_sink``
is large for every query ``i``. Ran-Milo et al. (2026) trace GPT-2's sink to the product of the
query bias, the first MLP's output on the position embedding, and ``W_K``'s structure.
:func:`sink_circuit` asks the same of any model, per sink head (the top heads by attention to the
first token, the census's primary sink):

- **key side**: the sink position's residual at that layer, split by its writers (embedding,
  position embedding where the model has one, each attention and MLP output), and across them the
  massive dims against all others, carried through the layer's own norm (its scale taken at the
  actual input: the norm is linear once its scale is fixed), ``W_K``, ``b_K`` (its own part, like
  the norm's bias) and the rotary rotation at the sink's position
  (:mod:`~massive_lens.attention.circuit_split`);
- **query side**: ``b_Q`` (where the model has one) against the content, averaged over queries,
  with the spread.

The parts add up to the logit the model computes (checked per head, ``check`` in ``.heads``).
With a ``corpus``, each removal alone (:mod:`~massive_lens.attention.circuit_causal`) says which
part the sink needs: the massive dims of the key input, the dominant writer, ``b_Q``, the
direction the sink key shares with the queries; each beside controls of the same size (the
runner-up writer's part, random key directions of the same norm). A head **singles out** its
dominant writer only when removing it kills the sink there and the controls do not (paired 95%
intervals over sequences); otherwise the sink is **distributed** over the writers named. The
summary leads with that verdict.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from massive_lens.attention.circuit_causal import CAUSAL_COLUMNS, CONTROL_DRAWS, causal_check, removal_line
from massive_lens.attention.circuit_split import TOL, CircuitCapture, split_layer, visible_token
from massive_lens.core.checks import as_int, as_pair, as_seconds, full_precision
from massive_lens.core.criterion import Criterion, SinkRule, as_criterion, as_rule
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.stats import rel_error
from massive_lens.errors import MassiveLensError

N_HEADS = 12  # sink heads split by default: the top heads by attention to the first token
COLUMNS = ["layer", "head", "side", "part", "component", "writer_layer", "dims", "contribution", "spread"]
HEAD_COLUMNS = ["layer", "head", "kv_head", "sink_mass", "logit", "logit_spread", "margin", "margin_spread", "check",
                "dominant", "dominant_share", "runner_up", "runner_up_share", "massive_share", "b_q", "b_q_spread",
                "content", "content_spread"]
VERDICT_COLUMNS = ["layer", "head", "sink_mass", "margin", "dominant", "dominant_share", "massive_share", "verdict",
                   "why", "killed_by", "survives"]
NAMED_SHARE = 0.9  # a distributed verdict names the largest writers until they give this share of the positive sum


@dataclass(frozen=True, kw_only=True)
class SinkCircuit(Result):
    """The attention logit on the first token of each sink head, split into parts (see the module
    docstring), and, with a corpus, what each removal does.

    ``to_frame()``: one row per (head, part): ``layer``, ``head``, ``side`` (``key``/``query``),
    ``part`` (``embed``, ``pos_embed``, ``attn 3``, ``mlp 0``, ``norm bias``, ``b_K``; ``b_Q``,
    ``content``), ``component`` (``embed``/``attn``/``mlp``/``bias``/``query``), ``writer_layer``
    (-1 for non-block parts), ``dims`` (``massive``/``other``/``all``), ``contribution`` (mean
    over queries and sequences of its share of the logit, in logit units), ``spread`` (its standard
    deviation over queries). ``.heads``: per head ``sink_mass``, ``logit`` (mean, and
    ``logit_spread``), ``check`` (largest relative error of the parts' sum against the model's
    scores), ``margin`` (the sink logit's margin over the content logits, ``s_sink -
    logsumexp(s_content)`` per query, mean, and ``margin_spread``), the ``dominant`` key-side writer
    and its ``dominant_share`` of the logit, the ``runner_up`` and its share, ``massive_share`` (the
    massive dims' share; NaN where no dim is massive at the sink in that layer), ``b_q``/``content``
    (query side, with spreads). ``.causal``: per head and removal ``mass_before``/``mass_after``
    (with ``_low``/``_high``, 95% interval over sequences), ``loss_ratio`` (every sink head cut at
    once, paired interval), ``kills``, ``margin``, and the controls of the same size with paired
    intervals (see :mod:`~massive_lens.attention.circuit_causal`). :meth:`verdicts`: per head,
    singled out or distributed, and why.
    """

    frame: pd.DataFrame
    heads: pd.DataFrame
    causal: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=CAUSAL_COLUMNS))
    model_name: str
    sink_token: str
    n_seqs: int
    threshold: float = SinkRule().threshold

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def _named(self, layer: int, head: int) -> str:
        """The head's largest key-side writers, until they give ``NAMED_SHARE`` of the positive sum
        (at least two, at most four), with their shares of that positive sum (a share of the net logit
        reads large where the parts nearly cancel)."""
        f = self.frame
        part = f[(f["layer"] == layer) & (f["head"] == head) & f["component"].isin(["embed", "attn", "mlp"])]
        writers = part.groupby("part")["contribution"].sum().sort_values(ascending=False)
        total, names, acc = float(writers.clip(lower=0).sum()), [], 0.0
        for name, c in writers.items():
            if len(names) >= 4 or (len(names) >= 2 and acc >= NAMED_SHARE * total):
                break
            names.append(f"{name} {max(float(c), 0.0) / total:.0%}" if total > 0 else str(name))
            acc += max(float(c), 0.0)
        return ", ".join(names)

    def verdicts(self) -> pd.DataFrame:
        """Per sink head: whether one writer of the sink's key is **singled out** (removing its part
        kills the sink while the controls of the same size, the runner-up writer's part and random key
        directions of the same norm, do not, each leaving more attention by a paired 95% interval over
        sequences) or the sink is **distributed** over the writers it names (``verdict``, and ``why``);
        which removals kill the sink there (``killed_by``) and which do not (``survives``; a removal
        that removes nothing, as ``massive dims`` at a layer without massive dims, is in neither).
        Without a causal check ``verdict`` says so.

        Returns:
            One row per head with the columns ``VERDICT_COLUMNS``.
        """
        rows = []
        c_all = self.causal
        for r in self.heads.itertuples():
            c = c_all[(c_all["layer"] == r.layer) & (c_all["head"] == r.head)]
            if "applies" in c:
                c = c[c["applies"].astype(bool)]
            w = c[c["removal"] == "dominant writer"]
            verdict, why = "no causal check (pass corpus=)", ""
            runner = getattr(r, "runner_up", "")  # (results saved before the controls have no runner-up)
            if len(w) and "random_after" not in w:
                verdict = "no controls (a result saved before them: run sink_circuit again)"
            elif len(w):
                x = w.iloc[0]
                controls = f"runner-up {runner} leaves {x.runner_up_after:.2f}, " if runner and \
                    x.runner_up_after == x.runner_up_after else ""
                controls += f"random directions of the same norm leave {x.random_after:.2f} (worst draw " \
                    f"{x.random_after_min:.2f})"
                if bool(x.get("specific", False)):
                    verdict = f"singled out: {r.dominant}"
                    why = (f"removing it drops the attention from {x.mass_before:.2f} to {x.mass_after:.2f} "
                           f"[{x.mass_after_low:.2f}, {x.mass_after_high:.2f}]; {controls}")
                elif not x.kills:  # no single part is enough: the margin outlasts the largest one
                    named = self._named(r.layer, r.head)
                    verdict = f"not singled out: its largest writer's removal leaves the sink ({named})"
                    why = f"removing {r.dominant} leaves {x.mass_after:.2f} of {x.mass_before:.2f}"
                else:
                    verdict = f"distributed over {self._named(r.layer, r.head)}"
                    if bool(x.get("controls_kill", False)):
                        why = f"removing {r.dominant} kills it, but so does a control: {controls}"
                    else:
                        why = (f"removing {r.dominant} leaves {x.mass_after:.2f}, not clearly below the controls: "
                               f"{controls}")
            rows.append(dict(layer=r.layer, head=r.head, sink_mass=r.sink_mass,
                             margin=getattr(r, "margin", float("nan")),
                             dominant=r.dominant, dominant_share=r.dominant_share, massive_share=r.massive_share,
                             verdict=verdict, why=why, killed_by=", ".join(c.loc[c["kills"].astype(bool), "removal"]),
                             survives=", ".join(c.loc[~c["kills"].astype(bool), "removal"])))
        return pd.DataFrame(rows, columns=VERDICT_COLUMNS)

    def _verdict_line(self) -> str:
        if "random_after" not in self.causal:
            return (f"{self.model_name}: no writer singled out or not: this result was saved before the controls of "
                    "the same size (run sink_circuit again); the removals below stand alone")
        v = self.verdicts()
        single = v[v["verdict"].str.startswith("singled out")]
        named = single["dominant"].value_counts()
        line = (f"{self.model_name}: {len(single)} of {len(v)} sink heads single out one writer of the sink's key"
                + (" (" + ", ".join(f"{name} in {n}" for name, n in named.items()) + ")" if len(single) else "")
                + f" against controls of the same size (the runner-up writer's part, {CONTROL_DRAWS} random key "
                f"directions of the same norm; paired 95% intervals over {int(self.causal['n_seqs'].iloc[0])} corpus "
                "sequences)")
        spread = v[~v["verdict"].str.startswith("singled out")]
        if len(spread):
            line += f"; in {len(spread)} no writer is singled out: " + "; ".join(
                f"L{int(r.layer)}H{int(r.head)} ({r.why.split(':')[0]}; writers {r.verdict.split('(')[-1].rstrip(')')})"
                if r.verdict.startswith("not singled out") else
                f"L{int(r.layer)}H{int(r.head)} distributed over {r.verdict.removeprefix('distributed over ')} "
                f"({r.why.split(':')[0]})"
                for r in spread.head(4).itertuples()) + ("; ..." if len(spread) > 4 else "")
        return line

    def summary(self) -> str:
        h = self.heads.sort_values("sink_mass", ascending=False)
        top = h.iloc[0]
        drawn = h["dominant"].value_counts()
        share = (f"the massive dims giving {top.massive_share:.0%}" if top.massive_share == top.massive_share
                 else "no massive dims at this layer")
        lead = (f"the sink at '{visible_token(self.sink_token)}' in layer {int(top.layer)} (head {int(top['head'])}: "
                f"attention {top.sink_mass:.2f} on the split text, logit margin {top.get('margin', float('nan')):.3g} "
                f"over the content keys) is drawn by the key from {top.dominant} ({top.dominant_share:.0%} of its "
                f"logit {top.logit:.3g}; runner-up {top.get('runner_up', '') or 'none'}), {share}")
        parts = self.frame[(self.frame["layer"] == top.layer) & (self.frame["head"] == top["head"])
                           & (self.frame["side"] == "key")].groupby("part")["contribution"].sum()
        if len(parts) and parts.min() < -0.5 * abs(top.logit):  # a part that pulls the logit down
            lead += f", against {parts.idxmin()} {parts.min():.3g}"
        lead += (f", b_Q {top.b_q:.3g} +- {top.b_q_spread:.2g} against content {top.content:.3g} +- "
                 f"{top.content_spread:.2g}" if abs(top.b_q) > 0 else ", no query bias")
        with_massive = h["massive_share"].dropna()
        massive = (f"the massive dims give a median {with_massive.median():.0%} of the logit over the "
                   f"{len(with_massive)} "
                   "heads whose layer has massive dims at the sink" if len(with_massive)
                   else "no massive dims at the sink in these heads' layers")
        lines = [lead, f"over the {len(h)} sink heads the dominant key writer is "
                 + ", ".join(f"{name} in {n}" for name, n in drawn.items())
                 + f"; {massive}; the parts add up to the model's scores to {h['check'].max():.1e} (the norm's scale "
                 "taken at the actual input)"]
        if len(self.causal):  # the verdict first, then each removal
            lines = [self._verdict_line(), "split: " + lines[0], lines[1]]
            lines += [removal_line(self.causal, r, self.threshold) for r in self.causal["removal"].unique()]
        else:
            lines[0] = f"{self.model_name}: " + lines[0]
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """The logit split per head: stacked bars of the key-side parts, each writer that gives at
        least a tenth of some head's logit on its own (massive and other dims apart), the rest of the
        writers as one bar; the black mark is their sum, the logit; a red cross ``b_Q``'s part of it,
        on the query side."""
        ax = ensure_axes(ax, (max(6.0, 0.6 * len(self.heads) + 3), 4.5))
        key = self.frame[self.frame["side"] == "key"].copy()
        logits = self.heads.set_index(["layer", "head"])["logit"].abs()
        writer = key["component"].isin(["embed", "attn", "mlp"])
        by_part = key[writer].groupby(["layer", "head", "part"])["contribution"].sum().reset_index()
        by_part["share"] = by_part["contribution"].abs() / [max(float(logits.loc[(a, b)]), 1e-12) for a, b in
                                                           zip(by_part["layer"], by_part["head"], strict=True)]
        shown = set(by_part.loc[by_part["share"] >= 0.1, "part"])
        key["group"] = [f"{p} ({d} dims)" if p in shown else ("other writers" if w else p)
                        for p, d, w in zip(key["part"], key["dims"], writer, strict=True)]
        table = key.pivot_table(index=["layer", "head"], columns="group", values="contribution", aggfunc="sum")
        labels = [f"L{layer}H{head}" for layer, head in table.index]
        pos, neg = [0.0] * len(table), [0.0] * len(table)
        for col in table.columns:
            vals = table[col].fillna(0).tolist()
            base = [p if v >= 0 else n for v, p, n in zip(vals, pos, neg, strict=True)]
            ax.bar(labels, vals, bottom=base, label=col)
            pos = [p + max(v, 0) for v, p in zip(vals, pos, strict=True)]
            neg = [n + min(v, 0) for v, n in zip(vals, neg, strict=True)]
        ax.scatter(labels, [self.heads.set_index(["layer", "head"]).loc[i, "logit"] for i in table.index],
                   color="black", marker="_", s=200, zorder=3, label="logit (sum)")
        bq = [self.heads.set_index(["layer", "head"]).loc[i, "b_q"] for i in table.index]
        if any(abs(v) > 0 for v in bq):  # the query side: b_Q's part of the same logit
            ax.scatter(labels, bq, color="red", marker="x", zorder=3, label="b_Q's part (query side)")
        ax.set_ylim(min(min(neg), 0) * 1.08 - 0.1, max(max(pos), 0) * 1.08 + 0.1)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set(ylabel="mean logit on the sink", title=f"{self.model_name}: the sink's logit split per head")
        ax.tick_params(axis="x", rotation=60, labelsize=7)
        ax.legend(fontsize=6, ncol=2)
        return ax


def _component(name: str) -> tuple[str, int]:
    kind, _, layer = name.partition(" ")
    if kind in ("attn", "mlp"):
        return kind, int(layer)
    return ("embed", -1) if kind in ("embed", "pos_embed") else ("bias", -1)


def _head_rows(split: Any, keep: Any, layer: int, head: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    kv = head // (split.q.shape[2] // split.keys.shape[2])
    v = split.valid
    q = split.q[:, :, head]  # [B P dh]
    parts = split.scale * torch.einsum("bqe,bpe->bqp", q, split.keys[:, :, kv])[v]  # [n part]
    total = keep.scores[:, head][v]
    check = rel_error(parts.sum(-1), total)
    rows = []
    for i, (name, dims) in enumerate(zip(split.names, split.dims, strict=True)):
        comp, wl = _component(name)
        rows.append(dict(layer=layer, head=head, side="key", part=name, component=comp, writer_layer=wl, dims=dims,
                         contribution=float(parts[:, i].mean()), spread=float(parts[:, i].std(correction=0))))
    bias = split.scale * torch.einsum("bqe,be->bq", split.q_bias[:, :, head], keep.k[:, kv])[v]
    content = total - bias
    for name, x in (("b_Q", bias), ("content", content)):
        rows.append(dict(layer=layer, head=head, side="query", part=name, component="query", writer_layer=-1,
                         dims="all", contribution=float(x.mean()), spread=float(x.std(correction=0))))
    frame = pd.DataFrame(rows[:-2])
    writers = frame[frame["component"].isin(["embed", "attn", "mlp"])].groupby("part")["contribution"].sum()
    writers = writers.sort_values(ascending=False)
    logit = float(total.mean())
    massive = float(frame.loc[frame["dims"] == "massive", "contribution"].sum())
    any_massive = bool(keep.massive.any())  # no dim massive at the sink here: no share to give (NaN, not 0)
    margin = total - keep.content_lse[:, head][v]
    nan = float("nan")
    info = dict(layer=layer, head=head, kv_head=kv, sink_mass=float(keep.pattern[:, head][v].mean()), logit=logit,
                logit_spread=float(total.std(correction=0)), margin=float(margin.mean()),
                margin_spread=float(margin.std(correction=0)), check=check, dominant=str(writers.index[0]),
                dominant_share=float(writers.iloc[0]) / logit if logit else nan,
                runner_up=str(writers.index[1]) if len(writers) > 1 else "",
                runner_up_share=float(writers.iloc[1]) / logit if logit and len(writers) > 1 else nan,
                massive_share=massive / logit if logit and any_massive else nan, b_q=float(bias.mean()),
                b_q_spread=float(bias.std(correction=0)), content=float(content.mean()),
                content_spread=float(content.std(correction=0)))
    return rows, info


def chosen_heads(view: ModelView, cap: CircuitCapture, heads: Any, n_heads: int, threshold: float
                 ) -> list[tuple[int, int]]:
    """The (layer, head) pairs to split: ``heads`` checked, or the top ``n_heads`` by attention
    to the sink among those above ``threshold``."""
    mass = {}
    for layer, keep in cap.keep.items():
        valid = cap.batch.mask.clone().to(keep.pattern.device)
        valid[:, : cap.sink + 1] = False
        per = (keep.pattern * valid[:, None]).sum((0, 2)) / valid.sum().clamp(min=1)
        mass.update({(layer, h): float(m) for h, m in enumerate(per.tolist())})
    if heads is None:
        ranked = sorted((m, key) for key, m in mass.items() if m > threshold)[::-1]
        if not ranked:
            best = max(mass.values(), default=0.0)
            raise MassiveLensError(f"{view.name}: no sink in the text: no head gives the first token more than "
                                   f"{threshold:g} of its attention (the most is {best:.2f}); give a longer text "
                                   "or pass heads=[(layer, head), ...]")
        return sorted(key for _, key in ranked[:n_heads])
    out = []
    for item in heads:
        item = as_pair(item, "heads")  # a bool is no layer, a float no head
        if (item[0], item[1]) not in mass:
            raise MassiveLensError(f"{view.name}: head {tuple(item)} is out of range (layers {sorted(cap.keep)}, "
                                   f"{view.model.cfg.n_heads} heads)")
        if mass[item[0], item[1]] <= threshold:
            raise MassiveLensError(f"{view.name}: head {tuple(item)} gives the first token only "
                                   f"{mass[item[0], item[1]]:.2f} of its attention (<= {threshold:g}): it is not a "
                                   "sink head; choose heads that attend to the sink (heads=None picks them)")
        out.append((item[0], item[1]))
    return out


def sink_circuit(model: Any, text: Any, *, heads: Sequence[Any] | None = None, n_heads: int = N_HEADS,
                 layers: int | Sequence[int] | None = None, corpus: Any = None, n_seqs: int = 16,
                 seq_len: int = 128, criterion: Criterion | None = None, rule: SinkRule | None = None,
                 max_seconds: float | None = None, progress: bool = True, seed: int = 0) -> SinkCircuit:
    """Split each sink head's attention logit on the first token into its parts, exactly, and
    (with ``corpus``) cut each part alone (see the module docstring).

    Args:
        model: a TransformerLens-style model (bridge or HookedTransformer) with attention layers.
        text: a string, a list of strings or a token tensor; the first token is the sink.
        heads: (layer, head) pairs to split; None: the top ``n_heads`` by attention to the first
            token among those above the sink rule's threshold.
        n_heads: how many heads ``heads=None`` picks (default 12).
        layers: the layers to read (None: all).
        corpus: token batches for the causal check (a token tensor, texts, a file); None: no check.
        n_seqs: the causal check's sequences (from ``corpus``).
        seq_len: their length in tokens.
        criterion: what counts as a massive dim (default ``Criterion()``).
        rule: the sink rule whose threshold names sink heads (default ``SinkRule()``).
        max_seconds: refuse the causal check when its cost, estimated before it starts from the
            split's own pass (1 + 4 passes over the corpus, 1 + 3 without a query bias), is over
            this (None: no bound).
        progress: show a tqdm bar counting the causal check's passes.
        seed: seeds the random directions of the controls.

    Returns:
        A :class:`SinkCircuit`.

    Raises:
        MassiveLensError: no sink in the text, a head without attention to the sink, layers out
            of range, a model without attention, parts that do not add up to the logit, or a
            causal check estimated over ``max_seconds``.

    >>> from massive_lens import tiny_model
    >>> c = sink_circuit(tiny_model("qwen2"), "Hello there, world. " * 4, n_heads=2,
    ...                  rule=SinkRule(threshold=0.05))
    >>> bool(c.heads["check"].max() < 1e-4), sorted(c.frame["side"].unique())
    (True, ['key', 'query'])
    """
    view = ModelView(model)
    if not view.serves_patterns:  # nnsight: no per-head hooks, norm sites or TransformerLens-style weights
        raise view.unsupported("sink_circuit (its per-head query, key, score and pattern hooks, each block's "
                               "attention and MLP outputs and the norm's scale)")
    full_precision(view.dtype, view.name, "sink_circuit", TOL)  # before any pass: half precision fails its checks
    rule, criterion = as_rule(rule), as_criterion(criterion)
    n_heads, max_seconds = as_int(n_heads, "n_heads", low=1), as_seconds(max_seconds)
    as_int(seed, "seed")  # a seed is an integer: 1.5 is none
    if heads is not None and (isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence) or not heads):
        raise MassiveLensError(f"heads must be a non-empty list of (layer, head) pairs, or None to pick the top "
                               f"n_heads sink heads; got {heads!r}")
    chosen = view.chosen_layers(layers)
    batch = view.tokenize(text)
    if int(batch.lengths.min()) < 2:
        raise MassiveLensError("sink_circuit needs at least one query after the first token; give a longer text")
    cap = CircuitCapture(view, batch, chosen, criterion)
    start = time.perf_counter()
    last = view.block_hook(max(chosen), "resid_post") if view.has_hook(max(chosen), "resid_post") else None
    cap.run(lambda hooks: view.forward(batch, hooks, stop_after=last, must_stop=False))
    token_seconds = (time.perf_counter() - start) / batch.tokens.numel()
    picked = chosen_heads(view, cap, heads, n_heads, rule.threshold)
    rows, infos, splits = [], [], {}
    for layer, head in picked:
        if layer not in splits:
            splits[layer] = split_layer(view, cap, layer)
        r, info = _head_rows(splits[layer], cap.keep[layer], layer, head)
        rows += r
        infos.append(info)
    head_frame = pd.DataFrame(infos, columns=HEAD_COLUMNS)
    causal = (causal_check(view, head_frame, corpus, n_seqs=n_seqs, seq_len=seq_len,
                           criterion=criterion, threshold=rule.threshold,
                           token_seconds=token_seconds, max_seconds=max_seconds, progress=progress, seed=seed)
              if corpus is not None else pd.DataFrame(columns=CAUSAL_COLUMNS))
    token = view.str_tokens(batch)[0][0] if batch.pixel_values is None else "[first]"
    return SinkCircuit(frame=pd.DataFrame(rows, columns=COLUMNS), heads=head_frame, causal=causal,
                       model_name=view.name, sink_token=token, n_seqs=len(batch.tokens), threshold=rule.threshold)
