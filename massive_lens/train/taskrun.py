"""Train a :class:`MassiveLM` on a sink-forcing task (:mod:`massive_lens.train.tasks`) and record,
at every evaluation step, what the papers on sinks look at (the run's settings and their check:
:mod:`massive_lens.train.tasksettings`).

At step 0, every ``eval_every`` steps and at the last step, one pass over a fixed held-out batch
(the same for every run) records

* per head (``heads.parquet``: step, layer, head): ``sink_mass``, the attention weight on the first
  token (BOS) averaged over queries 1.. (what ``hook_pattern[..., 0]`` shows; for ``relu`` the weight
  ``relu(s_0) / n``); ``max_logit``, the largest attention logit (the quantity QK-Clip bounds);
  ``value_norm_first``, the first token's value-vector norm and ``value_ratio``, that over the
  median of the other positions' (the value-state drain, Guo et al.);
* per step (``evals.parquet``): ``loss`` and the task's ``accuracy`` (``accuracy_trigger``,
  ``accuracy_other``); ``sink_mass`` (the largest over heads, and its layer and head);
  ``value_ratio`` at that head; ``resid_ratio``, the first token's largest residual |activation|
  over the median |activation| of the layer over the batch (Sun et al.'s top-1 / median, read off the first
  token with :func:`massive_lens.core.stats.top1_median`) and
  ``resid_norm_ratio``, the first token's residual norm over the median position's, both the
  largest over layers (``hook_resid_post``).

At the end (``result.json``): the last record, ``sink_step`` (the first evaluation step whose
``sink_mass`` exceeds the package's sink threshold, :data:`massive_lens.core.criterion.SINK_THRESHOLD`,
Gu et al.'s 0.3; NaN if none), and the W8A8 / W4A4 gaps in task loss
and accuracy under :func:`massive_lens.quant.fake_quantized` (per-channel weights, dynamic
per-token activations, the unembedding kept in full precision). ``result.json`` is written last,
so its presence marks a finished run.

>>> run = train_task(TaskSettings.of("bigram_backcopy", steps=2, eval_every=1, eval_seqs=2, batch_size=2,
...                                  d_model=16, n_heads=2, task_options=dict(seq_len=8, n_vocab=8)))
>>> run.evals["step"].tolist(), sorted(run.result)[:3]
([0, 1, 2], ['accuracy', 'accuracy_other', 'accuracy_trigger'])
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from massive_lens.core.criterion import SINK_THRESHOLD, first_norm_ratio
from massive_lens.core.model_view import ModelView
from massive_lens.core.stats import MEDIAN_FLOOR, top1_median
from massive_lens.quant import fake_quantized
from massive_lens.train.loop import lr_at
from massive_lens.train.model import MassiveLM
from massive_lens.train.tasks import TaskBatch
from massive_lens.train.tasksettings import TaskSettings, check_settings, model_config
from massive_lens.train.trainer import make_optimizer

RESULT = "result.json"
# the version of the definitions of the derived fields (head_summary, sink_step with SINK_THRESHOLD,
# derived_fields): records carry the one they were written with, and readers recompute or refuse older ones.
# 0: records written before it existed (their sink_step may use a threshold other than 0.3)
DEFINITIONS_VERSION = 1
DERIVED_EVALS = ("sink_mass", "sink_layer", "sink_head", "value_ratio", "max_logit")  # read off heads.parquet
# fan-in of each matrix from its shape: [in, out], W_Q/K/V [head, d_model, d_head], W_O [head, d_head, d_model]
_FAN_IN = {"W_Q": lambda s: s[1], "W_K": lambda s: s[1], "W_V": lambda s: s[1], "W_O": lambda s: s[0] * s[1],
           "W_in": lambda s: s[0], "W_gate": lambda s: s[0], "W_out": lambda s: s[0], "W_U": lambda s: s[0]}
_HOOKS = ("hook_pattern", "hook_attn_scores", "hook_v", "hook_resid_post")


@dataclass(frozen=True)
class TaskRun:
    """A finished run: the model (eval mode), its records and its end-of-run result."""

    model: MassiveLM
    settings: TaskSettings
    evals: pd.DataFrame
    heads: pd.DataFrame
    result: dict[str, Any]


def build_model(settings: TaskSettings) -> MassiveLM:
    """The run's model, initialised from its seed (the global RNG left as it was); the settings are
    checked first (:func:`~massive_lens.train.tasksettings.check_settings`)."""
    task = check_settings(settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.train.seed)
        model = MassiveLM(model_config(settings, task), task.tokenizer())
        if settings.init == "torch":
            torch_init(model)
        return model



@torch.no_grad()
def torch_init(model: MassiveLM) -> None:
    """Redraw ``model``'s embeddings from N(0, 1) and its matrices uniformly within 1/sqrt(fan-in), as
    ``nn.Embedding`` and ``nn.Linear`` start (biases, norms and variant parameters are left as they are)."""
    for name, p in model.named_parameters():
        kind = name.split(".")[-1]
        if kind in ("W_E", "W_pos"):
            torch.nn.init.normal_(p)
        elif kind in _FAN_IN:
            bound = 1 / math.sqrt(_FAN_IN[kind](p.shape))
            torch.nn.init.uniform_(p, -bound, bound)


def train_task(settings: TaskSettings, out_dir: str | os.PathLike | None = None) -> TaskRun:
    """Train one run and record it (module docstring); with ``out_dir``, write its three files there.

    Args:
        settings: the run.
        out_dir: the run's folder (None: nothing is written).

    Returns:
        A :class:`TaskRun`.

    Raises:
        MassiveLensError: for an unknown task, variant or norm placement, or bad task options.
    """
    task = check_settings(settings)
    model = build_model(settings)
    schedule = settings.train
    optimizer = make_optimizer(model, schedule)
    held_out = task.sample(settings.eval_seqs, seed=-1, step=0)
    evals, heads, t0 = [], [], time.perf_counter()
    model.train()
    for step in range(schedule.steps + 1):
        if step % schedule.eval_every == 0 or step == schedule.steps:
            row, per_head = evaluate(model, task, held_out)
            evals.append(dict(step=step, **row))
            heads += [dict(step=step, **h) for h in per_head]
        if step == schedule.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(schedule, step)
        batch = task.sample(schedule.batch_size, schedule.seed, step)
        loss = task.loss(model(batch.tokens), batch)
        loss.backward()
        if schedule.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    seconds = time.perf_counter() - t0
    evals_frame, heads_frame = pd.DataFrame(evals), pd.DataFrame(heads)
    result = {**derived_fields(evals_frame), **lowbit_gaps(model, task, held_out), "seconds": seconds,
              "settings": settings.to_dict()}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        evals_frame.to_parquet(out / "evals.parquet", index=False)
        heads_frame.to_parquet(out / "heads.parquet", index=False)
        tmp = out / (RESULT + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        os.replace(tmp, out / RESULT)
    return TaskRun(model, settings, evals_frame, heads_frame, result)


def sink_step(evals: pd.DataFrame, threshold: float = SINK_THRESHOLD) -> float:
    """The first evaluation step whose ``sink_mass`` exceeds ``threshold`` (NaN if none)."""
    hit = evals.sort_values("step").loc[lambda f: f["sink_mass"] > threshold, "step"]
    return float(hit.iloc[0]) if len(hit) else math.nan


def head_summary(heads: pd.DataFrame) -> pd.DataFrame:
    """The evaluation record's columns read off its per-head rows, one row per ``step`` (the index):
    ``sink_mass`` (the largest head's; among equal heads the first in layer, head order), its ``sink_layer``,
    ``sink_head`` and ``value_ratio``, and ``max_logit`` (the largest over heads). A definition: changing it
    raises :data:`DEFINITIONS_VERSION`.

    >>> heads = pd.DataFrame(dict(step=0, layer=[0, 0, 1], head=[0, 1, 0], sink_mass=[0.2, 0.5, 0.5],
    ...                           max_logit=[3.0, 1.0, 2.0], value_ratio=[1.0, 0.5, 0.25]))
    >>> head_summary(heads).iloc[0].tolist()
    [0.5, 0.0, 1.0, 0.5, 3.0]
    """
    ordered = heads.sort_values(["step", "layer", "head"], kind="stable").reset_index(drop=True)
    top = ordered.loc[ordered.groupby("step")["sink_mass"].idxmax()].set_index("step")
    out = top[["sink_mass", "layer", "head", "value_ratio"]].set_axis(list(DERIVED_EVALS[:4]), axis=1)
    return out.assign(max_logit=ordered.groupby("step")["max_logit"].max())


def derive_evals(evals: pd.DataFrame, heads: pd.DataFrame) -> pd.DataFrame:
    """``evals`` with its :data:`DERIVED_EVALS` columns recomputed from ``heads`` (:func:`head_summary`)."""
    summary = head_summary(heads).reindex(evals["step"].to_numpy())
    return evals.assign(**{c: summary[c].to_numpy() for c in DERIVED_EVALS})


def derived_fields(evals: pd.DataFrame) -> dict[str, Any]:
    """The derived fields of ``result.json``: the last evaluation's values, ``sink_step`` (:func:`sink_step`)
    and ``definitions``, the :data:`DEFINITIONS_VERSION` they follow."""
    last = evals.sort_values("step").iloc[-1:]
    return {**{c: last[c].iloc[0].item() for c in evals}, "sink_step": sink_step(evals),
            "definitions": DEFINITIONS_VERSION}


@torch.no_grad()
def evaluate(model: MassiveLM, task: Any, batch: TaskBatch) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One held-out pass: the step's summary row and one row per (layer, head) (module docstring)."""
    was_training = model.training
    model.eval()
    try:
        logits, cache = model.run_with_cache(batch.tokens, names_filter=lambda n: n.endswith(_HOOKS))
    finally:
        model.train(was_training)
    per_head, resid_ratio, norm_ratio = [], 0.0, 0.0
    for layer in range(model.cfg.n_layers):
        pattern = cache[ModelView.block_hook(layer, "attn.hook_pattern")][:, :, 1:, 0].mean((0, 2))
        scores = cache[ModelView.block_hook(layer, "attn.hook_attn_scores")]
        top_logit = scores.masked_fill(~torch.isfinite(scores), -math.inf).amax((0, 2, 3))
        v_norm = cache[ModelView.block_hook(layer, "attn.hook_v")].norm(dim=-1)  # [batch, pos, kv_head]
        v_norm = v_norm.repeat_interleave(model.cfg.n_heads // v_norm.shape[-1], -1)
        v_first, v_rest = v_norm[:, 0].mean(0), v_norm[:, 1:].median(1).values.mean(0)
        for head in range(model.cfg.n_heads):
            per_head.append(dict(layer=layer, head=head, sink_mass=float(pattern[head]),
                                 max_logit=float(top_logit[head]), value_norm_first=float(v_first[head]),
                                 value_ratio=float(v_first[head] / v_rest[head].clamp(min=1e-12))))
        x = cache[ModelView.block_hook(layer, "resid_post")].float()
        first_top = top1_median(x[:, :1].abs())[0].mean()  # the first token's largest |activation|, batch mean
        median = top1_median(x.abs().flatten(0, 1)[None])[1]  # the median |activation| over the whole batch
        resid_ratio = max(resid_ratio, float(first_top / median.clamp(min=MEDIAN_FLOOR)))
        norm_ratio = max(norm_ratio, float(first_norm_ratio(x.norm(dim=-1)).mean()))
    top = head_summary(pd.DataFrame(per_head).assign(step=0))
    row = dict(loss=float(task.loss(logits, batch)), **task.accuracy(logits, batch),
               **{c: top[c].iloc[0].item() for c in DERIVED_EVALS}, resid_ratio=resid_ratio,
               resid_norm_ratio=norm_ratio)
    return row, per_head


@torch.no_grad()
def lowbit_gaps(model: MassiveLM, task: Any, batch: TaskBatch) -> dict[str, float]:
    """Task loss and accuracy under W8A8 and W4A4 (per-token activations), minus full precision's."""
    full = model(batch.tokens)
    base_loss, base_acc = float(task.loss(full, batch)), task.accuracy(full, batch)["accuracy"]
    out = {}
    for w, a in ((8, 8), (4, 4)):
        with fake_quantized(model, w_bits=w, a_bits=a, per_token=True):
            logits = model(batch.tokens)
        out[f"w{w}a{a}_gap"] = float(task.loss(logits, batch)) - base_loss
        out[f"w{w}a{a}_acc_gap"] = task.accuracy(logits, batch)["accuracy"] - base_acc
    return out
