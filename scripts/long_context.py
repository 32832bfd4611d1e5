"""Issue 41's long-context runs (docs/benchmarks.md), each saving its results under docs/long_context/:

    python scripts/long_context.py page      # SmolLM2: the census and streaming windows on one 8,192-token document
    python scripts/long_context.py qwen16k   # Qwen2.5-Coder-1.5B in bfloat16: the census at 16,384 tokens, its memory

The document is WikiText-2's test split from its first article on, joined across articles to the
length (the tokenized release, as it lies in ../shared/data). Both run on the LSE path (the model on
SDPA, no pattern); the streaming windows edit attention scores, so they run on the eager pattern.
Memory is the process's resident high-water mark (``resource``), above what it was after loading.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import pandas as pd
import torch

from massive_lens import load_model
from massive_lens.attention import sink_census
from massive_lens.core.corpora import token_batches
from massive_lens.core.model_view import ModelView
from massive_lens.effects import streaming_window

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
OUT = ROOT / "docs" / "long_context"
BUCKETS = (0, 512, 2048, 4096, 8192, 16384)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def document(model, length: int) -> torch.Tensor:
    """``[1, length]`` token ids: the test split from its first article on."""
    text = TEXT.read_text(encoding="utf-8")
    return next(token_batches(ModelView(model), text[: length * 8], seq_len=length, batch_size=1))


def lifetimes(frame: pd.DataFrame) -> pd.DataFrame:
    """Per level and position range: how many sinks, and their lives in layers (median, max)."""
    frame = frame.assign(range=pd.cut(frame["pos"], BUCKETS, right=False).astype(str),
                         life=frame["last_layer"] - frame["first_layer"] + 1)
    return (frame.groupby(["level", "range"], observed=True)
            .agg(sinks=("pos", "size"), median_life=("life", "median"), max_life=("life", "max"),
                 median_peak_mass=("peak_mass", "median"))
            .reset_index())


def census_run(model, ids: torch.Tensor, name: str) -> dict:
    base, start = peak_mb(), time.perf_counter()
    census = sink_census(model, ids, seq_len=ids.shape[1], n_seqs=1, batch_size=1)
    seconds, held = time.perf_counter() - start, peak_mb() - base
    census.save(OUT / f"{name}_census", overwrite=True)
    table = lifetimes(census.to_frame())
    table.to_csv(OUT / f"{name}_lifetimes.csv", index=False)
    print(census.summary())
    print(table.to_string(index=False))
    primary = census.level("primary")
    return {"model": ModelView(model).name, "tokens": int(ids.shape[1]), "dtype": str(next(model.parameters()).dtype),
            "attention": census.attention, "seconds": round(seconds, 1), "peak_mb_above_loaded": round(held),
            "primary": primary[["pos", "token", "first_layer", "last_layer"]].to_dict("records"),
            "summary": census.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=("page", "qwen16k"))
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.run == "page":
        model = load_model()
        ids = document(model, 8192)
        record = census_run(model, ids, "default_8k")
        record["streaming"] = []
        for window in (512, 1024):
            start = time.perf_counter()
            run = streaming_window(model, ids, window=window, sinks=(0, 1, 4), seq_len=ids.shape[1], n_seqs=1)
            run.save(OUT / f"default_8k_streaming_w{window}", overwrite=True)
            print(run.summary(), f"({time.perf_counter() - start:.0f} s)")
            record["streaming"].append({"window": window, "summary": run.summary(),
                                        "frame": run.to_frame().round(4).to_dict("records")})
        (OUT / "default_8k.json").write_text(json.dumps(record, indent=1, default=str))
    else:
        model = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        record = census_run(model, document(model, 16384), "qwen_16k_bf16")
        record["weights_mb"] = round(weights)
        print(json.dumps({k: v for k, v in record.items() if k != "primary"}, indent=1))
        (OUT / "qwen_16k_bf16.json").write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
