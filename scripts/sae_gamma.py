"""Does outlier severity γ predict SAE latent death on this model? (issue 42; arXiv 2605.31518)

Trains small SAEs through sae-lens's own trainer (``SAETrainer``, TopK by default) on the
residual stream (``hook_resid_post``) of several layers, three ways per layer:

- ``plain``: every position;
- ``masked``: the positions :func:`massive_lens.exclusion_mask` keeps (massive positions and
  primary sinks left out);
- ``centred``: every position, minus the training activations' mean.

For each SAE it records the share of latents that never fire on held-out tokens of its own
input distribution (``dead``), and for each layer γ = ‖μ‖/‖σ‖ of the training activations,
over every position and over the kept ones. Then Spearman's ρ between γ and the dead share
across the layers, with a Fisher-z interval and a permutation p-value
(:func:`massive_lens.handover.spearman_interval`), and a logistic fit
(:func:`massive_lens.handover.fit_dead_share`).

Runs in the TransformerLens 3.x environment (sae-lens pins transformer-lens<4):

    OMP_NUM_THREADS=1 nice -n 15 .venv-tl3/bin/python scripts/sae_gamma.py \
        --corpus ../shared/data/wikitext-2/test.txt --eval-corpus ../shared/data/wikitext-2/valid.txt \
        --out /tmp/sae_gamma

Writes ``saes.csv`` (one row per SAE), ``layers.csv`` (γ per layer) and ``summary.json`` to
``--out``, each rewritten after every SAE, so a run stopped early keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

from massive_lens import exclusion_mask, load_model
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.handover import fit_dead_share, gamma_of, spearman_interval

VARIANTS = ("plain", "masked", "centred")


def activations(model, tokens, layers, chunk):
    """Per layer: the residual stream ``[n_tokens, d]`` (float32) and the kept-position mask ``[n_tokens]``."""
    view = ModelView(model)
    names = [view.hook_name(layer, "resid_post") for layer in layers]
    out = {layer: [] for layer in layers}
    keep = []
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        keep.append(exclusion_mask(model, part).keep.flatten())
        seen = {}
        hooks = [(name, lambda x, hook, layer=layer, seen=seen:
                  seen.__setitem__(layer, x.detach().float().flatten(0, 1)))
                 for layer, name in zip(layers, names, strict=True)]
        view.forward(view.full_batch(part), hooks, stop_after=names[-1])
        for layer in layers:
            out[layer].append(seen[layer])
    return {layer: torch.cat(x) for layer, x in out.items()}, torch.cat(keep)


def batches(x, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            if len(idx) == batch:
                yield x[idx]


def train_sae(x, args, seed):
    """A sae-lens SAE trained by sae-lens's SAETrainer on the rows of ``x``."""
    import sae_lens
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(seed)
    d = x.shape[1]
    if args.arch == "topk":
        sae = sae_lens.TopKTrainingSAE(sae_lens.TopKTrainingSAEConfig(d_in=d, d_sae=args.expansion * d, k=args.k))
    else:
        sae = sae_lens.StandardTrainingSAE(sae_lens.StandardTrainingSAEConfig(d_in=d, d_sae=args.expansion * d,
                                                                             l1_coefficient=args.l1))
    steps = args.train_tokens // args.batch
    cfg = SAETrainerConfig(total_training_samples=steps * args.batch, train_batch_size_samples=args.batch,
                                    lr=args.lr, lr_end=args.lr, dead_feature_window=max(steps // 4, 1),
                                    feature_sampling_window=max(steps // 2, 1),
                                    logger=LoggingConfig(log_to_wandb=False))
    trainer = SAETrainer(cfg, sae, batches(x, args.batch, seed))
    return trainer.fit()


def evaluate(sae, x):
    """Dead share (never fires on ``x``), FVU and mean L0."""
    fired = torch.zeros(sae.cfg.d_sae, dtype=torch.bool)
    err = l0 = 0.0
    with torch.no_grad():
        for part in x.split(4096):
            acts = sae.encode(part)
            fired |= (acts > 0).any(0)
            l0 += float((acts > 0).sum())
            err += float((sae.decode(acts) - part).pow(2).sum())
    var = float((x - x.mean(0)).pow(2).sum())
    return float((~fired).float().mean()), err / var, l0 / len(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--eval-corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--layers", default=None, help="comma-separated (default: every --every-th layer)")
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-train-seqs", type=int, default=512)
    p.add_argument("--n-eval-seqs", type=int, default=128)
    p.add_argument("--train-tokens", type=int, default=400_000, help="samples seen in training (epochs over the set)")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--expansion", type=int, default=4)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--l1", type=float, default=5.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--arch", choices=("topk", "standard"), default="topk")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--cache", default=None, help="a .pt file for the activations: read if it exists, else written")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = load_model(args.model) if args.model else load_model()
    view = ModelView(model)
    layers = ([int(v) for v in args.layers.split(",")] if args.layers else
              list(range(1, view.n_layers, args.every)))
    t0 = time.time()
    train_tok = sequences(view, args.corpus, args.seq_len, args.n_train_seqs)
    eval_tok = sequences(view, args.eval_corpus, args.seq_len, args.n_eval_seqs)
    if args.cache and Path(args.cache).exists():
        train, train_keep, held, held_keep = torch.load(args.cache, weights_only=True)
    else:
        train, train_keep = activations(model, train_tok, layers, args.chunk)
        held, held_keep = activations(model, eval_tok, layers, args.chunk)
        if args.cache:
            torch.save((train, train_keep, held, held_keep), args.cache)
    print(f"activations: {len(train_keep)} train, {len(held_keep)} eval tokens, {len(layers)} layers, "
          f"{time.time() - t0:.0f} s; kept {float(train_keep.float().mean()):.4f}", flush=True)
    layer_rows = []
    for layer in layers:
        x = train[layer]
        layer_rows.append(dict(layer=layer, gamma=gamma_of(x), gamma_kept=gamma_of(x[train_keep]),
                               max_norm=float(x.norm(dim=-1).max()), median_norm=float(x.norm(dim=-1).median())))
    pd.DataFrame(layer_rows).to_csv(out / "layers.csv", index=False)
    rows = []
    for variant in args.variants.split(","):
        for layer in layers:
            x, h = train[layer], held[layer]
            if variant == "masked":
                x, h = x[train_keep], h[held_keep]
            elif variant == "centred":
                mean = x.mean(0)
                x, h = x - mean, h - mean
            t = time.time()
            sae = train_sae(x, args, seed=layer)
            dead, fvu, l0 = evaluate(sae, h)
            rows.append(dict(layer=layer, variant=variant, arch=args.arch, gamma_input=gamma_of(x), dead=dead,
                             fvu=fvu, l0=l0, d_sae=sae.cfg.d_sae, n_train=len(x), n_eval=len(h),
                             seconds=time.time() - t))
            print(rows[-1], flush=True)
            frame = pd.DataFrame(rows)
            frame.to_csv(out / "saes.csv", index=False)
            _summarise(frame, pd.DataFrame(layer_rows), args, out)


def _summarise(frame, layer_frame, args, out) -> None:
    summary = dict(args=vars(args))
    g = layer_frame.set_index("layer")
    for variant, f in frame.groupby("variant"):
        f = f.set_index("layer")
        column = "gamma_kept" if variant == "masked" else "gamma"
        if len(f) >= 4:
            summary[f"{variant}: γ vs dead"] = spearman_interval(g.loc[f.index, column], f["dead"])
            summary[f"{variant}: γ of the input vs dead"] = spearman_interval(f["gamma_input"], f["dead"])
    plain = frame[frame["variant"] == "plain"]
    if len(plain) >= 2 and plain["gamma_input"].nunique() > 1:
        fit = fit_dead_share(plain["gamma_input"], plain["dead"], source=f"{args.arch} SAEs, plain")
        summary["fit"] = dict(slope=fit.slope, intercept=fit.intercept, n_points=fit.n_points)
    pooled = frame[frame["gamma_input"] > 0]
    if len(pooled) >= 4:
        summary["pooled: γ of the input vs dead"] = spearman_interval(pooled["gamma_input"], pooled["dead"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))


if __name__ == "__main__":
    main()
