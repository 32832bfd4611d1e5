"""From scratch on one GPU: softmax vs softmax1, same data, same steps, ten minutes, no network.

A self-contained script (torch and numpy only, so it runs on a bare GPU image without
massive_lens's dependencies). It trains two Llama-style models in lockstep on the same
batches (one with plain softmax attention, one with softmax1: a zero key and value slot,
``exp(x_i) / (1 + sum_j exp(x_j))``), for as many steps as the time budget allows, then
measures each on held-out windows: loss, per-layer top-1 and median ``|residual|`` and
their ratio, the largest ``|value|`` at the first token, the mean attention on the first
token, and the kurtosis of the residual stream. Results go to ``OUT/scratch.json``,
``OUT/curves.csv``, ``OUT/layers.csv`` and ``OUT/scratch.png``.

Data: a token file written beforehand on any machine, from offline text (the installed
Python sources and docs), e.g.::

    python3 scripts/gpu_scratch.py corpus runs/pycorpus.txt --max-chars 80000000
    massive-lens tokenize runs/pycorpus.txt shared/pytokens.bin --tokenizer default

(~25M SmolLM2 tokens, uint16, about 50 MB with its ``.json``). On the GPU machine::

    python3 scripts/gpu_scratch.py train shared/pytokens.bin --out $OUT --budget-s 540

The massive-activation criterion is Sun et al.'s: ``|value| > 100`` and ``> 1000`` times the
median of the layer's ``|residual|``.

>>> import numpy as np, tempfile, json, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> (np.arange(5000) % 50).astype(np.uint16).tofile(d / "t.bin")
>>> _ = (d / "t.json").write_text(json.dumps({"vocab_size": 50, "dtype": "uint16", "n_tokens": 5000}))
>>> res = train(d / "t.bin", d, budget_s=60, steps=3, n_layers=1, d_model=32, n_heads=2, n_ctx=16,
...             batch=4, device="cpu", eval_batches=1)
>>> sorted(res["runs"]), res["runs"]["softmax"]["steps"]
(['softmax', 'softmax1'], 3)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Sun et al.'s criterion for a massive activation: massive_lens's Criterion defaults, repeated because
# this script runs where massive_lens is not installed (tests/test_layout.py keeps the two equal)
ABS, RATIO = 100.0, 1000.0


class Block(nn.Module):
    """Pre-norm block: RMSNorm, causal attention with RoPE (softmax or softmax1), SwiGLU MLP."""

    def __init__(self, d: int, h: int, softmax1: bool):
        super().__init__()
        self.h, self.softmax1 = h, softmax1
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        f = 64 * math.ceil(8 * d / 3 / 64)
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def attend(self, x: Tensor, rope: tuple[Tensor, Tensor], pattern: bool = False) -> tuple[Tensor, Tensor | None]:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        if pattern:  # explicit path, for measurement: weights over real keys (+ the zero slot)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            if self.softmax1:
                s = torch.cat([s, s.new_zeros(*s.shape[:-1], 1)], -1)
            p = s.float().softmax(-1).to(v.dtype)[..., :t]
            return (p @ v).transpose(1, 2).reshape(b, t, d), p
        if self.softmax1:  # a zero key/value slot first; a dummy query keeps the causal mask aligned
            z = q.new_zeros(b, self.h, 1, q.shape[-1])
            out = F.scaled_dot_product_attention(torch.cat([z, q], 2), torch.cat([z, k], 2), torch.cat([z, v], 2),
                                                 is_causal=True)[:, :, 1:]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, d), None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], pattern: bool = False) -> tuple[Tensor, Tensor | None]:
        a, p = self.attend(self.n1(x), rope, pattern)
        x = x + self.o(a)
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y)), p


class LM(nn.Module):
    """A small Llama-style decoder (untied embeddings)."""

    def __init__(self, vocab: int, d: int, h: int, n_layers: int, n_ctx: int, softmax1: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h, softmax1) for _ in range(n_layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
        half = d // h // 2
        ang = torch.arange(n_ctx)[:, None] * 10000.0 ** (-torch.arange(half) / half)[None]
        self.register_buffer("cos", ang.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", ang.sin().repeat(1, 2), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: Tensor, record: bool = False) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        t = idx.shape[1]
        rope = (self.cos[:t].to(self.emb.weight.dtype), self.sin[:t].to(self.emb.weight.dtype))
        x, resid, patterns = self.emb(idx), [], []
        for block in self.blocks:
            x, p = block(x, rope, record)
            if record:
                resid.append(x.float())
                patterns.append(p)
        return self.head(self.norm(x)), resid, patterns


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


def _batch(tokens: np.ndarray, n: int, t: int, gen: np.random.Generator, device: str) -> Tensor:
    starts = gen.integers(0, len(tokens) - t - 1, n)
    rows = np.stack([tokens[s:s + t + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows).to(device, non_blocking=True)


def _loss(model: LM, batch: Tensor) -> Tensor:
    logits, _, _ = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def measure(model: LM, batches: list[Tensor]) -> tuple[float, list[dict[str, Any]]]:
    """Held-out loss and per-layer statistics (see the module docstring), over ``batches``."""
    model.eval()
    rows: dict[int, dict[str, list[float]]] = {}
    losses = []
    with torch.no_grad():
        for batch in batches:
            logits, resid, patterns = model(batch[:, :-1], record=True)
            losses.append(float(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())))
            for layer, (x, p) in enumerate(zip(resid, patterns, strict=True)):
                mag = x.abs()
                z = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True).clamp(min=1e-6)
                r = rows.setdefault(layer, {k: [] for k in ("top1", "median", "first_max", "first_mass", "kurtosis")})
                r["top1"].append(float(mag.max()))
                r["median"].append(float(mag.flatten()[:: max(1, mag.numel() // 2_000_000)].median()))
                r["first_max"].append(float(mag[:, 0].max()))
                r["first_mass"].append(float(p[:, :, 1:, 0].float().mean()))
                r["kurtosis"].append(float((z ** 4).mean()))
    model.train()
    out = []
    for layer, r in sorted(rows.items()):
        top1, median = max(r["top1"]), float(np.mean(r["median"]))
        out.append(dict(layer=layer, top1=top1, median=median, ratio=top1 / max(median, 1e-12),
                        first_max=max(r["first_max"]), first_mass=float(np.mean(r["first_mass"])),
                        kurtosis=float(np.mean(r["kurtosis"])),
                        massive=bool(top1 > ABS and top1 / max(median, 1e-12) > RATIO)))
    return float(np.mean(losses)), out


def read_tokens(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """A token file and its vocabulary size (from the ``.json`` written beside it)."""
    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    if meta.get("dtype") not in ("uint16", "uint32"):  # never a dtype the file's description picks freely
        raise SystemExit(f"{path}: a token file holds uint16 or uint32 ids, its description says {meta.get('dtype')!r}")
    return np.memmap(path, dtype=meta["dtype"], mode="r"), int(meta["vocab_size"])


def train(tokens_path: str | os.PathLike, out: str | os.PathLike, *, budget_s: float | int = 540, steps: int = 100_000,
          n_layers: int = 12, d_model: int = 768, n_heads: int = 12, n_ctx: int = 512, batch: int = 64,
          lr: float | int = 1e-3, warmup: int = 200, device: str | None = None, eval_batches: int = 8,
          seed: int = 0) -> dict[str, Any]:
    """Train softmax and softmax1 models in lockstep until ``steps`` or the time budget, then measure.

    Training stops when the elapsed time plus the measured time of one evaluation passes
    ``budget_s``; both models always take the same number of steps on the same batches.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    tokens, vocab = read_tokens(tokens_path)
    n_val = max(eval_batches * batch * (n_ctx + 1), len(tokens) // 100)
    train_tok, val_tok = tokens[:-n_val], tokens[-n_val:]
    torch.manual_seed(seed)
    models = {name: LM(vocab, d_model, n_heads, n_layers, n_ctx, name == "softmax1").to(device)
              for name in ("softmax", "softmax1")}
    models["softmax1"].load_state_dict(models["softmax"].state_dict())  # same initial weights
    opts = {name: torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                    fused=device == "cuda") for name, m in models.items()}
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    val_gen = np.random.default_rng(seed + 1)
    val = [_batch(val_tok, batch, n_ctx, val_gen, device) for _ in range(eval_batches)]
    gen = np.random.default_rng(seed)
    curves, step, reserve = [], 0, 0.0
    horizon = steps
    while step < steps:
        if time.perf_counter() - t0 + reserve > budget_s:
            break
        data = _batch(train_tok, batch, n_ctx, gen, device)
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon)))
        rate = lr * min(1.0, (step + 1) / warmup) * decay
        row = dict(step=step + 1, lr=rate, tokens=(step + 1) * batch * n_ctx)
        for name, model in models.items():
            for g in opts[name].param_groups:
                g["lr"] = rate
            with amp:
                loss = _loss(model, data)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
            row[name] = float(loss.detach()) if step % 25 == 0 else float("nan")
        curves.append(row)
        step += 1
        if step == 20:  # estimate the time left for the final measurement, and the cosine horizon
            per_step = (time.perf_counter() - t0) / step
            reserve = 30.0 + 3 * eval_batches * per_step
            horizon = min(steps, int((budget_s - reserve) / per_step))
    results: dict[str, Any] = dict(steps=step, tokens_per_model=step * batch * n_ctx, device=device,
                                   config=dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_ctx=n_ctx,
                                               batch=batch, lr=lr, vocab=vocab, seed=seed), runs={})
    layer_rows = []
    for name, model in models.items():
        with amp:
            val_loss, layers = measure(model, val)
        results["runs"][name] = dict(steps=step, val_loss=val_loss, max_ratio=max(r["ratio"] for r in layers),
                                     max_top1=max(r["top1"] for r in layers),
                                     max_first=max(r["first_max"] for r in layers),
                                     massive_layers=[r["layer"] for r in layers if r["massive"]])
        layer_rows += [dict(variant=name, **r) for r in layers]
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    _write(Path(out), results, curves, layer_rows)
    return results


def _write(out: Path, results: dict, curves: list[dict], layers: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scratch.json").write_text(json.dumps(results, indent=1))
    for name, rows in (("curves.csv", curves), ("layers.csv", layers)):
        if rows:
            keys = list(rows[0])
            lines = [",".join(keys)] + [",".join(str(r[k]) for k in keys) for r in rows]
            (out / name).write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for name in ("softmax", "softmax1"):
        pts = [(r["step"], r[name]) for r in curves if not math.isnan(r[name])]
        if pts:
            a.plot(*zip(*pts, strict=True), label=name)
        mine = [r for r in layers if r["variant"] == name]
        b.semilogy([r["layer"] for r in mine], [r["top1"] for r in mine], label=f"{name} top-1")
        b.semilogy([r["layer"] for r in mine], [r["median"] for r in mine], ls="--", label=f"{name} median")
    a.set(xlabel="step", ylabel="train loss", title="training loss")
    b.set(xlabel="layer", ylabel="|residual|", title="held-out top-1 and median |residual|")
    a.legend(frameon=False)
    b.legend(frameon=False, fontsize=8)
    fig.savefig(out / "scratch.png", dpi=110)
    plt.close(fig)


def write_corpus(path: str | os.PathLike, max_chars: int = 80_000_000) -> int:
    """Write the installed Python sources and docs (``.py``, ``.rst``, ``.md``, ``.txt`` under
    ``sys.prefix``/``sys.base_prefix``, sorted) into one text file; returns the characters written."""
    roots = sorted({Path(sys.base_prefix) / "lib", Path(sys.prefix) / "lib"})
    files = sorted(p for r in roots if r.is_dir() for p in r.rglob("*")
                   if p.suffix in (".py", ".rst", ".md", ".txt") and p.is_file() and "test" not in p.parts)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            text = text[: max_chars - n] + "\n\n"
            f.write(text)
            n += len(text)
            if n >= max_chars:
                break
    return n


def main(argv: list[str] | None = None) -> int:
    """``corpus OUT.txt`` or ``train TOKENS.bin --out DIR`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="write the offline Python text corpus")
    c.add_argument("path")
    c.add_argument("--max-chars", type=int, default=80_000_000)
    t = sub.add_parser("train", help="train softmax and softmax1 in lockstep and measure")
    t.add_argument("tokens")
    t.add_argument("--out", default=os.environ.get("OUT", "runs/scratch"))
    t.add_argument("--budget-s", type=float, default=540)
    for name, default in (("n-layers", 12), ("d-model", 768), ("n-heads", 12), ("n-ctx", 512), ("batch", 64)):
        t.add_argument(f"--{name}", type=int, default=default)
    t.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.cmd == "corpus":
        print(f"wrote {write_corpus(args.path, args.max_chars):,} characters to {args.path}")
        return 0
    res = train(args.tokens, args.out, budget_s=args.budget_s, n_layers=args.n_layers, d_model=args.d_model,
                n_heads=args.n_heads, n_ctx=args.n_ctx, batch=args.batch, lr=args.lr)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
