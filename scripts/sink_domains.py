"""Issue 22's real runs on one offline model (docs/sinks.md): the census, the sink's keys and
values, dormant heads, whether the dormant heads change with the input's domain, and
(with --curve) the head curve.

    python scripts/sink_domains.py default
    python scripts/sink_domains.py qwen2.5-coder-1.5b --curve --draws 3 --n-seqs 4

Domains: three short prose texts, WikiText-2 test, a code file (this repository's
massive_lens/attention/census.py) and a repeated sentence, each cut into sequences of
--seq-len tokens (prose as given). Writes docs/sinks_runs/<model>/: summary.txt (every summary
printed), domains.csv (dormant heads per domain and their overlap with WikiText's), and the
saved census, kv, dormant and head-curve results (massive_lens.load reads them back).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from massive_lens import load_model, sink_census
from massive_lens.attention import dormant_heads, sink_kv
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import head_curve

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2"
PROSE = ["The history of the city begins in the Roman era, when a fort stood by the river.",
         "Photosynthesis converts light into chemical energy stored in sugar molecules.",
         "She opened the door, looked outside, and decided to stay home after all."]
REPEATED = "The cat sat on the mat. " * 200
NORM_RATIOS = (0.2, 0.5)  # the default, and the looser threshold the SmolLM2 section uses


def domains(model, seq_len: int, n_seqs: int) -> dict:
    view = ModelView(model)
    code = (ROOT / "massive_lens" / "attention" / "census.py").read_text()
    return {"prose": PROSE, "wikitext": sequences(view, WIKI / "test.txt", seq_len, n_seqs),
            "code": sequences(view, code, seq_len, n_seqs), "repeated": sequences(view, REPEATED, seq_len, n_seqs)}


def dormant_table(model, texts: dict, log) -> pd.DataFrame:
    rows, sets = [], {}
    for ratio in NORM_RATIOS:
        for name, text in texts.items():
            result = dormant_heads(model, text, norm_ratio=ratio)
            log(f"[{name}, norm_ratio={ratio}] {result.summary()}")
            f = result.to_frame()
            share = f.groupby(["layer", "head"])["dormant"].mean()
            sets[name, ratio] = set(share[share >= 0.5].index)  # dormant on at least half the sequences
            rows.append(dict(domain=name, norm_ratio=ratio, seqs=int(f["seq"].nunique()), heads=len(share),
                             dormant_every=int((share == 1).sum()), dormant_any=int((share > 0).sum()),
                             dormant_half=len(sets[name, ratio]), sink_mass_median=float(f["sink_mass"].median())))
    frame = pd.DataFrame(rows)
    frame["jaccard_vs_wikitext"] = [  # NaN where neither domain has a dormant head
        len(a & b) / len(a | b) if a | b else float("nan")
        for r in frame.itertuples() for a, b in [(sets[r.domain, r.norm_ratio], sets["wikitext", r.norm_ratio])]]
    return frame


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--census-seqs", type=int, default=16)
    parser.add_argument("--curve", action="store_true")
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--curve-seqs", type=int, default=8)
    args = parser.parse_args()
    out = ROOT / "docs" / "sinks_runs" / args.model
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)
        (out / "summary.txt").write_text("\n".join(lines) + "\n")

    start = time.time()
    model = load_model(args.model)
    census = sink_census(model, PROSE)
    log(census.summary())
    corpus = sink_census(model, WIKI / "test.txt", seq_len=args.seq_len, n_seqs=args.census_seqs)
    log(corpus.summary())
    log(corpus.by_kind.round(2).to_string(index=False))
    corpus.save(out / "census", overwrite=True)
    kv = sink_kv(model, PROSE)
    log(kv.summary())
    kv.save(out / "kv", overwrite=True)
    texts = domains(model, args.seq_len, args.n_seqs)
    table = dormant_table(model, texts, log)
    table.to_csv(out / "domains.csv", index=False)
    log(table.round(3).to_string(index=False))
    dormant_heads(model, PROSE, norm_ratio=0.5).save(out / "dormant", overwrite=True)
    log(f"census, kv, dormant and domains: {time.time() - start:.0f} s")
    if args.curve:
        start = time.time()
        curve = head_curve(model, WIKI / "test.txt", calibration=WIKI / "valid.txt", draws=args.draws,
                           n_seqs=args.curve_seqs, seq_len=args.seq_len)
        log(curve.summary())
        curve.save(out / "head_curve", overwrite=True)
        log(f"head curve: {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
