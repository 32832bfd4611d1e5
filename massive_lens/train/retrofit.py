"""Retrofit: take a pretrained model's massive activations away, give it an off-switch, let it re-learn.

From-scratch training on a CPU budget never grows massive activations in its softmax
baseline, so it cannot say whether an off-switch (softmax1, a learned slot) would have
prevented them. A pretrained model has them. Retrofit asks the causal question on it:
*once the model has lost its massive activations, does an off-switch let it recover its
loss without rebuilding them, while under plain softmax it rebuilds them?*

Each setting (see :func:`~massive_lens.train.retrofit_parts.parse_setting`) starts from the
same pretrained weights, swaps the attention through transformers' attention interface
(:mod:`massive_lens.train.hf_attention`), optionally zeroes the super weights that
:func:`~massive_lens.trace_origin` names, and fine-tunes every weight on the same batches
in the same order. Every ``eval_every`` steps it measures held-out loss, the formerly
massive dims' largest ``|value|`` and top-1/median ratio per layer, and the attention mass on
the first token and on the slot; at the end, the W8A8 loss gap and kurtosis
(:func:`~massive_lens.quant.measure_outliers`, on a bridge with the variant's hooks).

>>> from massive_lens import tiny_model
>>> text = "The cat sat on the mat. " * 200
>>> result = retrofit(tiny_model("llama"), ["softmax-kept", "softmax1-kept"], steps=1, batch_size=2,
...                   seq_len=16, data=text, eval_data=text, eval_seqs=2, measure=False, progress=False)
>>> sorted(result.to_frame().setting)
['softmax-kept', 'softmax1-kept']
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from massive_lens.core.charts import curve_axes
from massive_lens.core.corpora import data_file
from massive_lens.core.render import close_figure, save_figure
from massive_lens.core.results import Result
from massive_lens.errors import MassiveLensError
from massive_lens.quant import measure_outliers
from massive_lens.train.data import sample_batch, start_token, token_stream
from massive_lens.train.hf_attention import init_slots, plain_copy, swap_attention
from massive_lens.train.loop import lr_at
from massive_lens.train.model import lm_loss
from massive_lens.train.presets import TrainConfig
from massive_lens.train.retrofit_parts import (
    analysis_bridge,
    find_super_weights,
    hold_dims,
    parse_setting,
    save_retrofitted,
    seed_slots,
    sink_keys_values,
    tracked_eval,
    zero_super_weights,
)
from massive_lens.train.trainer import make_optimizer

log = logging.getLogger(__name__)
RETROFIT_SETTINGS = ("softmax-kept", "softmax-removed", "softmax1-removed", "kv_bias-removed", "learned_sink-removed",
            "softmax-removed-held", "softmax1-removed-held")
FINALS = ["fp_loss", "w8a8_loss", "gap", "mean_kurtosis", "max_inf_norm", "max_ratio"]


@dataclass(frozen=True, kw_only=True)
class Retrofit(Result):
    """Results of :func:`retrofit`.

    ``curves``: setting, seed, step, tokens, loss (train), val_loss (held-out), seconds.
    ``per_layer``: setting, seed, step, layer, dims_max, first_max, top1, median, ratio, first_mass,
    slot_mass (see :func:`~massive_lens.train.retrofit_parts.tracked_eval`). ``finals``:
    setting, seed, steps and the :data:`FINALS` columns of the fine-tuned model.
    ``super_weights``: the zeroed entries; ``dims``: the formerly massive dims.
    """

    model_name: str
    curves: pd.DataFrame
    per_layer: pd.DataFrame
    finals: pd.DataFrame
    super_weights: pd.DataFrame
    dims: list[int] = field(default_factory=list)
    budget: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _from_stored(cls, fields: dict[str, Any]) -> Retrofit:
        """Results saved before ``per_layer`` was named so stored it as ``layers``."""
        if "per_layer" not in fields and "layers" in fields:
            fields = {("per_layer" if k == "layers" else k): v for k, v in fields.items()}
        return super()._from_stored(fields)

    def to_frame(self) -> pd.DataFrame:
        """One row per (setting, seed): first and last held-out loss, the traced dims'
        largest ``|value|`` (any layer; anywhere, and ``first_max`` at the first token) at the
        start and end, first-token and slot mass at the end, and the final W8A8 columns."""
        rows = []
        for (setting, seed), group in self.per_layer.groupby(["setting", "seed"], sort=False):
            steps = sorted(group.step.unique())
            first, last = group[group.step == steps[0]], group[group.step == steps[-1]]
            mine = (self.curves.setting == setting) & (self.curves.seed == seed)
            curve = self.curves[mine].dropna(subset=["val_loss"])
            rows.append(dict(setting=setting, seed=seed, steps=int(steps[-1]),
                             val_loss_start=float(curve.val_loss.iloc[0]), val_loss=float(curve.val_loss.iloc[-1]),
                             dims_max_start=float(first.dims_max.max()), dims_max=float(last.dims_max.max()),
                             first_max_start=float(first.first_max.max()), first_max=float(last.first_max.max()),
                             ratio=float(last.ratio.max()), first_mass=float(last.first_mass.mean()),
                             slot_mass=float(last.slot_mass.mean())))
        frame = pd.DataFrame(rows)
        if len(self.finals) and len(frame):
            frame = frame.merge(self.finals.drop(columns=["steps"]), on=["setting", "seed"], how="left")
        return frame

    def summary(self) -> str:
        frame = self.to_frame()
        lines = [f"{self.model_name}: retrofit over {len(frame)} run(s); formerly massive dims {self.dims}; "
                 f"{len(self.super_weights)} super weight(s) zeroed in the 'removed' settings"]
        for row in frame.itertuples():
            line = (f"  {row.setting:22s} seed {row.seed}: held-out loss {row.val_loss_start:.3f} -> "
                    f"{row.val_loss:.3f} "
                    f"after {row.steps} steps; traced dims max |value| {row.dims_max_start:.1f} -> {row.dims_max:.1f} "
                    f"(first token {row.first_max_start:.1f} -> {row.first_max:.1f}); "
                    f"first-token mass {row.first_mass:.0%}, slot mass {row.slot_mass:.0%}")
            if "gap" in frame and pd.notna(row.gap):
                line += f"; W8A8 gap {row.gap:+.3f}, kurtosis {row.mean_kurtosis:.1f}"
            lines.append(line)
        if self.budget:
            lines.append("  budget: " + ", ".join(f"{k} {v}" for k, v in self.budget.items()))
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Held-out loss over steps, one line per setting (mean over seeds)."""
        return curve_axes(self.curves, y=("val_loss",), by="setting", ax=ax, title=f"{self.model_name}: retrofit")

    @classmethod
    def merge(cls, *results: Retrofit) -> Retrofit:
        """One result from runs made separately (e.g. settings run in parallel processes)
        on the same model with the same removal; the budgets' ``wall_s`` are summed.

        Args:
            *results: :class:`Retrofit` results of the same model.

        Returns:
            A :class:`Retrofit` holding every run.

        Raises:
            MassiveLensError: if no result is given, or they differ in model or traced dims.
        """
        if not results or len({(r.model_name, tuple(r.dims)) for r in results}) != 1:
            raise MassiveLensError("merge needs one or more retrofit results of the same model and removal")
        first = results[0]
        frames = {name: pd.concat([getattr(r, name) for r in results if len(getattr(r, name))]
                                  or [getattr(first, name)], ignore_index=True)
                  for name in ("curves", "per_layer", "finals")}
        runs = len(frames["curves"][["setting", "seed"]].drop_duplicates())
        budget = dict(first.budget, runs=runs, wall_s=sum(r.budget.get("wall_s", 0) for r in results))
        return cls(model_name=first.model_name, **frames, super_weights=first.super_weights, dims=list(first.dims),
                   budget=budget)

    def plot_activations(self, ax: Any = None) -> Any:
        """The formerly massive dims' largest ``|value|`` (any layer) over steps, per setting:
        anywhere (solid) and at the first token (dashed)."""
        peak = self.per_layer.groupby(["setting", "seed", "step"], sort=False)[["dims_max", "first_max"]].max()
        ax = curve_axes(peak.reset_index(), y=("dims_max", "first_max"), by="setting", ax=ax,
                        title=f"{self.model_name}: formerly massive dims (solid: anywhere, dashed: first token)")
        ax.set_yscale("log")
        ax.set_ylabel("max |activation| of the traced dims")
        return ax


def retrofit(
    model: Any,
    settings: Sequence[str] = RETROFIT_SETTINGS,
    *,
    steps: int = 40,
    batch_size: int = 8,
    seq_len: int = 128,
    lr: float = 1e-4,
    warmup_steps: int = 4,
    seeds: Sequence[int] = (0,),
    data: str | None = None,
    eval_data: str | None = None,
    eval_every: int = 5,
    eval_seqs: int = 8,
    measure: bool = True,
    out_dir: str | os.PathLike | None = None,
    progress: bool = True,
    models: dict[str, Any] | None = None,
    save_models: str | os.PathLike | None = None,
) -> Retrofit:
    """Fine-tune copies of ``model`` in each setting on the same batches and track what regrows.

    Args:
        model: a bridge from :func:`~massive_lens.load_model` (or ``wrap_hf_model``) over a
            Llama/Qwen/Mistral-style model; it is copied, never changed.
        settings: setting names (default :data:`RETROFIT_SETTINGS`).
        steps: optimizer steps per run (default 40).
        batch_size: sequences per step (default 8).
        seq_len: tokens per sequence, BOS included (default 128).
        lr: AdamW peak learning rate (default 1e-4), linear warmup then cosine decay.
        warmup_steps: warmup steps (default 4).
        seeds: one run per setting and seed; the seed fixes the batch order and the slot
            initialisation noise (:func:`~massive_lens.train.retrofit_parts.seed_slots`), nothing
            else (default ``(0,)``). Runs go seed-major: every setting of the first seed first.
        data: training text (a file; None: WikiText-2 valid).
        eval_data: held-out text (None: WikiText-2 test).
        eval_every: steps between tracked evaluations (step 0 always, and the last).
        eval_seqs: held-out sequences per evaluation (default 8).
        measure: measure W8A8 loss gap and kurtosis at the end (default True).
        out_dir: save the result and two figures here after every evaluation (None: no files).
        progress: log progress at INFO level.
        models: a dict that receives each fine-tuned Hugging Face model by ``"<setting>/seed<s>"``.
        save_models: save each fine-tuned model (safetensors) to ``<save_models>/<setting>_seed<s>/``
            (:func:`~massive_lens.train.retrofit_parts.save_retrofitted`; None: not saved).

    Returns:
        A :class:`Retrofit`.

    Raises:
        MassiveLensError: for a bad setting, ``steps``/``batch_size``/``eval_every`` below 1,
            ``seq_len`` below 2 or beyond the model's context, data shorter than one sequence,
            a model without a Hugging Face model inside, or nothing to remove.
    """
    parsed = [parse_setting(s) for s in settings]
    _check_sizes(model, parsed, seeds, steps, batch_size, seq_len, eval_every, eval_seqs)
    tokenizer = model.tokenizer
    bos = start_token(tokenizer)
    train, held = _streams(tokenizer, seq_len, data, eval_data)
    eval_tokens = sample_batch(held, eval_seqs, seq_len, bos, seed=12345, step=0)
    probe = sample_batch(train, 1, min(seq_len, 64), bos, seed=999, step=0)
    supers, dims = _removal(model, probe, any(p.remove for p in parsed))
    sink_kv = sink_keys_values(model, probe)
    cfg = TrainConfig(steps=steps, lr=lr, warmup_steps=warmup_steps, min_lr_ratio=0.1, weight_decay=0.0)
    runs = _Runs(getattr(model.cfg, "model_name", "model"), supers, dims, out_dir,
                 dict(tokens_per_step=batch_size * seq_len, steps=steps, runs=len(parsed) * len(seeds)))
    for seed in seeds:
        for setting in parsed:
            hf, handles = _starting_copy(model, setting, seed, sink_kv, supers, dims)
            try:
                _fine_tune(hf, setting, seed, cfg, runs, partial(sample_batch, train, batch_size, seq_len, bos, seed),
                           eval_tokens, eval_every, progress)
            finally:
                for h in handles:
                    h.remove()
            if measure:
                runs.finals.append(dict(setting=setting.name, seed=seed, steps=steps,
                                        **_final(hf, tokenizer, eval_tokens, dims, setting.hold, supers)))
            if models is not None:
                models[f"{setting.name}/seed{seed}"] = hf
            if save_models is not None:
                save_retrofitted(hf, Path(save_models) / f"{setting.name}_seed{seed}",
                                 dict(setting=setting.name, seed=seed, steps=steps, dims=dims,
                                      hold_start=int(supers.layer.min()) if setting.hold else None), tokenizer)
            del hf
            runs.snapshot()
    return runs.snapshot()


@dataclass
class _Runs:
    """What the runs have measured so far; :meth:`snapshot` builds the result (and writes it)."""

    model_name: str
    supers: pd.DataFrame
    dims: list[int]
    out_dir: str | os.PathLike | None
    budget: dict[str, Any]
    curves: list[dict] = field(default_factory=list)
    per_layer: list[dict] = field(default_factory=list)
    finals: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def snapshot(self) -> Retrofit:
        done = dict(self.budget, wall_s=round(time.perf_counter() - self.started))
        result = Retrofit(model_name=self.model_name, curves=pd.DataFrame(self.curves),
                          per_layer=pd.DataFrame(self.per_layer),
                          finals=pd.DataFrame(self.finals, columns=["setting", "seed", "steps", *FINALS]),
                          super_weights=self.supers, dims=self.dims, budget=done)
        if self.out_dir is not None and self.curves and self.per_layer:
            _write(result, Path(self.out_dir))
        return result


def _check_sizes(model: Any, parsed: list, seeds: Sequence[int], steps: int, batch_size: int, seq_len: int,
                 eval_every: int, eval_seqs: int) -> None:
    if min(steps, batch_size, eval_every, eval_seqs) < 1 or not parsed or not list(seeds):
        raise MassiveLensError("steps, batch_size, eval_every and eval_seqs must be >= 1 and settings and seeds "
                               "non-empty")
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    if seq_len < 2 or (n_ctx is not None and seq_len > n_ctx):
        raise MassiveLensError(f"seq_len {seq_len} must be at least 2 (BOS and one token to predict) and at most "
                               f"the model's context ({n_ctx})")


def _streams(tokenizer: Any, seq_len: int, data: str | None, eval_data: str | None) -> tuple[Any, Any]:
    """The training and held-out token streams, each at least one sequence long."""
    train = token_stream(data or data_file("wikitext-2/valid.txt"), tokenizer)
    held = token_stream(eval_data or data_file("wikitext-2/test.txt"), tokenizer)
    for what, stream in (("training data", train), ("held-out data", held)):
        if len(stream) < seq_len:
            raise MassiveLensError(f"the {what} holds {len(stream)} tokens, fewer than one sequence of {seq_len}: "
                                   "give a longer text or a smaller seq_len")
    return train, held


def _starting_copy(model: Any, setting: Any, seed: int, sink_kv: tuple, supers: pd.DataFrame,
                   dims: list[int]) -> tuple[Any, list]:
    """A fresh Hugging Face copy in the setting's variant: slots initialised and seeded, super
    weights zeroed where the setting removes them, and the hooks that hold the dims."""
    hf = swap_attention(plain_copy(model), setting.variant)
    if setting.variant in ("kv_bias", "k_bias"):
        init_slots(hf, *sink_kv)
    seed_slots(hf, seed)
    handles = []
    if setting.remove:
        zero_super_weights(hf, supers)
        if setting.hold:
            handles = hold_dims(hf, dims, int(supers.layer.min()))
    return hf, handles


def _fine_tune(hf: Any, setting: Any, seed: int, cfg: TrainConfig, runs: _Runs, batch_at: Any,
               eval_tokens: torch.Tensor, eval_every: int, progress: bool) -> None:
    """``cfg.steps`` optimizer steps on ``batch_at(step)``, evaluated every ``eval_every`` steps
    (step 0 and the last always) into ``runs``."""
    optimizer = make_optimizer(hf, cfg)
    t0, step_loss = time.perf_counter(), float("nan")
    for step in range(cfg.steps + 1):
        if step % eval_every == 0 or step == cfg.steps:
            val, rows = tracked_eval(hf, eval_tokens, runs.dims, lm_loss)
            tokens = step * runs.budget["tokens_per_step"]
            runs.curves.append(dict(setting=setting.name, seed=seed, step=step, tokens=tokens, loss=step_loss,
                                    val_loss=val, seconds=time.perf_counter() - t0))
            runs.per_layer += [dict(setting=setting.name, seed=seed, step=step, **r) for r in rows]
            if progress:
                log.info("%s seed %d step %d: train %.3f held-out %.3f, traced max %.1f (%.0fs)", setting.name,
                         seed, step, step_loss, val, max(r["dims_max"] for r in rows), time.perf_counter() - t0)
            runs.snapshot()
        if step == cfg.steps:
            break
        step_loss = _train_step(hf, optimizer, cfg, step, batch_at(step))


def _removal(model: Any, probe: torch.Tensor, needed: bool) -> tuple[pd.DataFrame, list[int]]:
    try:
        return find_super_weights(model, probe)
    except MassiveLensError:
        if needed:
            raise
        return pd.DataFrame(columns=["layer", "neuron", "dim", "hf_param", "hf_row", "hf_col"]), []


def _train_step(hf: Any, optimizer: Any, cfg: TrainConfig, step: int, tokens: torch.Tensor) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr_at(cfg, step)
    hf.train()
    loss = lm_loss(hf(tokens, use_cache=False).logits, tokens)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.grad_clip)
    optimizer.step()
    return float(loss.detach())


def _final(hf: Any, tokenizer: Any, tokens: torch.Tensor, dims: list[int], hold: bool,
           supers: pd.DataFrame) -> dict[str, float]:
    """W8A8 loss gap and kurtosis of the fine-tuned model, on a bridge that computes its variant."""
    bridge = analysis_bridge(hf, tokenizer, hold=(dims, int(supers.layer.min())) if hold else None)
    totals = measure_outliers(bridge, tokens).totals
    return {k: float(totals[k]) for k in FINALS}


def _write(result: Retrofit, out: Path) -> None:
    """Save the result and the two figures (partial runs included)."""
    out.mkdir(parents=True, exist_ok=True)
    result.save(out / "result", overwrite=True)
    result.curves.to_csv(out / "curves.csv", index=False)
    result.per_layer.to_csv(out / "per_layer.csv", index=False)
    result.to_frame().to_csv(out / "summary.csv", index=False)
    (out / "summary.txt").write_text(result.summary() + "\n")
    for name, draw in (("loss", result.plot), ("activations", result.plot_activations)):
        save_figure(draw(), out / name, formats=("png",), dpi=110)
        close_figure()
