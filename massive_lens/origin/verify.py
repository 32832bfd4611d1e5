"""Causal checks of an origin story (``trace_origin(..., verify=True)``).

Zero the named birth neurons (and, separately, only their ``W_out[neuron, dim]`` weights),
then measure how much of the massive value is left at its peak layer and at the last layer,
and, with a corpus, how perplexity changes. Weights are always restored.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.model_lock import model_lock
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import Batch
from massive_lens.metrics import perplexity
from massive_lens.origin.capture import Capture
from massive_lens.origin.neurons import named, w_out

VERIFY_COLUMNS = ["pos", "dim", "intervention", "scope", "layer", "neurons", "value", "ablated", "remaining",
                  "last_layer", "value_last", "ablated_last", "remaining_last", "ppl", "ppl_ablated"]
VERIFY_SEQ_LEN, VERIFY_SEQS = 128, 4  # the corpus sequences perplexity is measured on


@contextlib.contextmanager
def zeroed_weights(view: ModelView, entries: Sequence[tuple[int, int, int]]) -> Iterator[None]:
    """Temporarily zero ``W_out[neuron, dim]`` of each (layer, neuron, dim); always restored.

    The model's lock is held from the first edit until the last weight is back, so another
    thread's analysis of the same model waits instead of seeing the zeroed weights."""
    saved = []
    with model_lock(view.model), contextlib.ExitStack() as restore:
        restore.callback(_put_back, saved)
        with torch.no_grad():
            for layer, n, d in entries:
                weight = w_out(view, layer)
                saved.append((weight, n, d, weight[n, d].clone()))
                weight[n, d] = 0.0
        yield


def _put_back(saved: list) -> None:
    with torch.no_grad():
        for weight, n, d, value in reversed(saved):
            weight[n, d] = value


def _mask_hook(mask: Float[Tensor, "batch d_mlp"]):
    """Multiply each batch row's neuron activations by its row of ``mask`` (0 = zeroed)."""

    def hook(post: Tensor, hook: Any) -> Tensor:
        return post * mask.to(post.device, post.dtype)[:, None, :]

    return hook


def neuron_hooks(view: ModelView, masks: dict[int, Tensor]) -> list[tuple[str, Any]]:
    return [(view.hook_name(layer, "mlp.hook_post"), _mask_hook(mask)) for layer, mask in masks.items()]


def _masks(by_layers: Sequence[dict[int, list[int]]], d_mlp: int) -> dict[int, Tensor]:
    """Per layer, a ``[len(by_layers), d_mlp]`` keep-mask: row ``i`` zeroes ``by_layers[i]``."""
    masks: dict[int, Tensor] = {}
    for row, by_layer in enumerate(by_layers):
        for layer, ns in by_layer.items():
            masks.setdefault(layer, torch.ones(len(by_layers), d_mlp))[row, ns] = 0.0
    return masks


def resid_at(
    view: ModelView, batch: Batch, pos: int, dim: int, hooks: list[tuple[str, Any]]
) -> Float[Tensor, "batch layer"]:
    """``resid_post[:, pos, dim]`` at every layer under ``hooks`` (stops before the unembedding)."""
    values = torch.zeros(batch.tokens.shape[0], view.n_layers)

    def grab(layer: int):
        def hook(resid: Tensor, hook: Any) -> None:
            values[:, layer] = resid[:, pos, dim].detach().float().cpu()

        return hook

    names = [view.hook_name(layer, "resid_post") for layer in range(view.n_layers)]
    view.forward(batch, list(hooks) + [(n, grab(layer)) for layer, n in enumerate(names)], stop_after=names[-1])
    return values


def ppl(model: Any, tokens: Tensor | None, hooks: list[tuple[str, Any]]) -> float:
    if tokens is None:
        return math.nan
    return perplexity(model, tokens, hooks=hooks, progress=False).perplexity


def verification_rows(
    view: ModelView, batch: Batch, base: Float[Tensor, " layer"], births: list[dict[str, Any]],
    neurons: pd.DataFrame, peak_layer: int, tokens: Tensor | None, base_ppl: float,
) -> list[dict[str, Any]]:
    """Zero the named neurons (then, separately, only their ``W_out[n, dim]`` weights) of each
    MLP birth and of all births together; measure what is left of the value, and perplexity.

    Neuron ablations of all scopes run as one batched pass (row ``i`` zeroes scope ``i``);
    weight ablations edit the weights, so each scope has its own pass (weights restored)."""
    scopes = [(f"MLP {b['layer']}", b["layer"], [b]) for b in births]
    if len(births) > 1:
        scopes.append(("all births", peak_layer, births))
    chosen = []
    for scope, layer, events in scopes:
        by_layer = {e["layer"]: named(neurons, e, experts=False) for e in events}  # dense MLPs only
        by_layer = {k: v for k, v in by_layer.items() if v}
        if by_layer:
            chosen.append((scope, layer, by_layer))
    if not chosen:
        return []
    pos, dim = births[0]["pos"], births[0]["dim"]
    d_mlp = w_out(view, births[0]["layer"]).shape[0]
    rep = Batch(batch.tokens.repeat(len(chosen), 1), batch.mask.repeat(len(chosen), 1), batch.has_bos)
    by_neurons = resid_at(view, rep, pos, dim, neuron_hooks(view, _masks([c[2] for c in chosen], d_mlp)))
    rows = []
    for i, (scope, layer, by_layer) in enumerate(chosen):
        hooks = neuron_hooks(view, _masks([by_layer], d_mlp))
        with zeroed_weights(view, [(k, n, dim) for k, ns in by_layer.items() for n in ns]):
            by_weights = resid_at(view, batch, pos, dim, [])[0]
            weights_ppl = ppl(view.model, tokens, [])
        for intervention, ablated, after_ppl in (("zero_neurons", by_neurons[i], ppl(view.model, tokens, hooks)),
                                                 ("zero_super_weights", by_weights, weights_ppl)):
            rows.append(_row(pos, dim, intervention, scope, layer, by_layer, base, ablated, base_ppl, after_ppl))
    return rows


def _row(pos: int, dim: int, intervention: str, scope: str, layer: int, by_layer: dict[int, list[int]],
         base: Tensor, ablated: Tensor, base_ppl: float, after_ppl: float) -> dict[str, Any]:
    last = len(base) - 1
    return dict(pos=pos, dim=dim, intervention=intervention, scope=scope, layer=layer,
                neurons=", ".join(f"{k}:{n}" for k, ns in by_layer.items() for n in ns),
                value=float(base[layer]), ablated=float(ablated[layer]), remaining=float(ablated[layer] / base[layer]),
                last_layer=last, value_last=float(base[last]), ablated_last=float(ablated[last]),
                remaining_last=float(ablated[last] / base[last]), ppl=base_ppl, ppl_ablated=after_ppl)


def verify_targets(view: ModelView, batch: Batch, cap: Capture, targets: list[dict[str, Any]],
                   births: list[dict[str, Any]], neurons: pd.DataFrame, corpus: Corpus,
                   estimate: Callable[[float, Tensor | None], None] | None = None) -> list[dict[str, Any]]:
    """Verification rows of every target (see :func:`verification_rows`). ``estimate`` is called
    once the untouched perplexity run is done, with its measured seconds and the corpus tokens, so
    that the time the other runs will take is told from a run of their own shape."""
    tokens = None if corpus is None else sequences(view, corpus, VERIFY_SEQ_LEN, VERIFY_SEQS)
    started = time.perf_counter()
    base_ppl = ppl(view.model, tokens, [])
    if estimate is not None:
        estimate(time.perf_counter() - started, tokens)
    rows = []
    # with a corpus each target costs perplexity runs (seconds to minutes): show progress
    for t in tqdm(targets, desc="verifying (perplexity on the corpus)", disable=tokens is None, leave=False):
        mine = [b for b in births if b["pos"] == t["pos"] and b["dim"] == t["dim"]]
        base = cap.layers["resid_post"][:, cap.index(t["pos"]), t["dim"]]
        rows += verification_rows(view, batch, base, mine, neurons, t["peak_layer"], tokens, base_ppl)
    return rows
