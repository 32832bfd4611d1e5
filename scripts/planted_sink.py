"""A planted sink on a real model (issue 49): force one position to attend only to itself and ask
the census, the tracer and the sink-logit split whether a sink and a massive activation form there;
test two claims with 95% intervals over sequences: planted sink strength 0.47-0.84 with early
layers giving > 90% of the effect, and a change of the first token's rotary position moving sink
strength by at most 2%.

Sink strength of a position, per sequence (massive_lens.interventions.sink_strength): Gu et al.'s
sink metric applied to it, the share of all heads (every layer) whose mean attention to it, over
the (up to 64) later queries, exceeds 0.3. "Early" layers: 0 up to the layer where the untouched
model's first-token massive activation is born (find_massive); "late": the rest.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/planted_sink.py --model smollm2 --n-seqs 24
    flock /tmp/ml_qwen.lock .venv/bin/python scripts/planted_sink.py --model qwen2.5-coder-1.5b --n-seqs 12

writes docs/planted_sink/<model>/{summary.json, strength.csv, rotary.csv, census.csv, massive.csv,
writers.csv, trace_events.csv}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import pandas as pd
import torch

from massive_lens import find_massive, load_model, sink_census, trace_origin
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.interventions import force_self_attention, planted_writers, shift_rotary_position, sink_strength

WRITER_COLUMNS = ["layer", "head", "sink_mass", "logit", "dominant", "dominant_share", "runner_up", "runner_up_share",
                  "check"]  # what summary.json keeps of the planted writer split (the page reads logit and check)
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
CLAIM_RANGE = (0.47, 0.84)
EARLY_SHARE = 0.9
ROTARY_BOUND = 0.02


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(model, whole, positions, iv, batch_size) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per position: per sequence, the sink strength (share of heads > 0.3) and the mean attention to it."""
    with iv if iv is not None else contextlib.nullcontext():
        frame = sink_strength(model, whole, pos=positions, batch_size=batch_size)
    return {p: (torch.tensor(g["strength"].to_numpy()), torch.tensor(g["mass"].to_numpy()))
            for p, g in frame.groupby("pos")}


def interval(values: torch.Tensor, seed: int = 0, n: int = 2000):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(values), (n, len(values)), generator=gen)
    means = values.double()[idx].mean(1)
    return float(values.double().mean()), float(means.quantile(0.025)), float(means.quantile(0.975))


def ratio_interval(num: torch.Tensor, den: torch.Tensor, seed: int = 0, n: int = 2000):
    """Paired bootstrap over sequences of mean(num) / mean(den)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(num), (n, len(num)), generator=gen)
    r = num.double()[idx].mean(1) / den.double()[idx].mean(1)
    r = r[torch.isfinite(r)]  # resamples where the denominator is 0 (no sequence moved) have no ratio
    return float(num.double().mean() / den.double().mean()), float(r.quantile(0.025)), float(r.quantile(0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n-seqs", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--pos", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--detail-seqs", type=int, default=4, help="sequences for the census, tracer and writer split")
    ap.add_argument("--shifts", default="1,2,8,32,64", help="rotary positions given to the first token")
    ap.add_argument("--settings", default="none,all,early,late,first_half,second_half",
                    help="where to plant (none is the untouched model; always measured)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (faster on these CPUs)")
    ap.add_argument("--out", default="docs/planted_sink")
    ap.add_argument("--writers-only", action="store_true",
                    help="only the writer split under the saved run's early plant, in --dtype (on --detail-seqs "
                         "sequences); replaces the planted rows of writers.csv and summary.json's writers")
    args = ap.parse_args()
    if args.writers_only:
        writers_only(args)
        return
    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    model = load_model(dtype=dtype) if args.model == "smollm2" else load_model(args.model, dtype=dtype)
    view = ModelView(model)
    name = view.name
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    whole = view.full_batch(sequences(view, str(DATA), args.seq_len, args.n_seqs))
    pos = args.pos
    log(f"{name}: {view.n_layers} layers, {len(whole.tokens)} sequences of {whole.tokens.shape[1]} tokens, pos {pos}")

    # where the untouched model's first-token massive activation is born: "early" ends there
    detail = whole.tokens[: args.detail_seqs]
    base_massive = find_massive(model, detail).to_frame()
    first = base_massive[base_massive["pos"] == 0]
    birth = int(first["layer"].min()) if len(first) else view.n_layers // 3
    early, late = list(range(birth + 1)), list(range(birth + 1, view.n_layers))
    log(f"first-token massive activation born at layer {birth}: early = 0-{birth}, late = {birth + 1}-"
        f"{view.n_layers - 1}")

    # claim 1: planted sink strength, early vs late
    half = view.n_layers // 2
    every = {"none": None, "all": list(range(view.n_layers)), "early": early, "late": late,
             "first_half": list(range(half)), "second_half": list(range(half, view.n_layers))}
    wanted = {"none", "all", "early", *args.settings.split(",")}
    settings = {k: v for k, v in every.items() if k in wanted}
    rows, per = [], {}
    for setting, layers in settings.items():
        got = measure(model, whole, [0, pos], force_self_attention(model, pos, layers) if layers else None,
                      args.batch_size)
        per[setting] = got
        for p, (metric, mass) in got.items():
            m, lo, hi = interval(metric)
            mm, mlo, mhi = interval(mass)
            rows.append(dict(setting=setting, layers=f"{layers[0]}-{layers[-1]}" if layers else "",
                             position=p, strength=m, strength_low=lo, strength_high=hi, mass=mm, mass_low=mlo,
                             mass_high=mhi, n_seqs=len(metric)))
        log(f"plant {setting}: strength at pos {rows[-1]['strength']:.3f} "
            f"[{rows[-1]['strength_low']:.3f}, {rows[-1]['strength_high']:.3f}], "
            f"first token {rows[-2]['strength']:.3f}")
    strength = pd.DataFrame(rows)
    strength.to_csv(out / "strength.csv", index=False)
    none = per["none"][pos][0]
    shares = {k: ratio_interval(per[k][pos][0] - none, per["all"][pos][0] - none)
              for k in settings if k not in ("none", "all")}
    # the planted sink's strength relative to the untouched model's own first-token sink (paired per sequence)
    relative = {k: ratio_interval(per[k][pos][0], per["none"][0][0]) for k in settings}

    # claim 2: the first token's rotary position
    shifts = [int(s) for s in args.shifts.split(",") if int(s) < whole.tokens.shape[1]]
    base0, base_mass = per["none"][0]
    rot_rows = []
    for to in shifts:
        got, got_mass = measure(model, whole, [0], shift_rotary_position(model, 0, to), args.batch_size)[0]
        m, lo, hi = interval(got - base0)
        rel = ratio_interval(got - base0, base0)
        rot_rows.append(dict(to=to, strength=float(got.mean()), change=m, change_low=lo, change_high=hi,
                             relative=rel[0], relative_low=rel[1], relative_high=rel[2],
                             **dict(zip(("mass_relative", "mass_relative_low", "mass_relative_high"),
                                        ratio_interval(got_mass - base_mass, base_mass), strict=True))))
        log(f"first token at rotary position {to}: strength {got.mean():.3f}, relative change {rel[0]:+.3%} "
            f"[{rel[1]:+.3%}, {rel[2]:+.3%}]")
    rotary = pd.DataFrame(rot_rows)
    rotary.to_csv(out / "rotary.csv", index=False)

    # the known answer: census, find_massive, trace_origin, the writer split, under the early plant
    plant_layers = early
    census_rows, massive_rows, writer_rows, event_rows = [], [], [], []
    for label, layers in (("untouched", None), ("planted", plant_layers)):
        iv = force_self_attention(model, pos, layers) if layers else None
        with iv if iv else torch.no_grad():
            c = sink_census(model, detail, attention="eager").to_frame()
            c.insert(0, "model_state", label)
            census_rows.append(c)
            f = find_massive(model, detail).to_frame()
            f.insert(0, "model_state", label)
            massive_rows.append(f)
            traced = pos if label == "planted" else 0
            at_pos = f[(f["pos"] == traced) & (f["seq"] == 0)]
            if len(at_pos):  # the planted position's largest massive dim, or the untouched first token's
                dim = int(at_pos.sort_values("value", key=abs, ascending=False)["dim"].iloc[0])
                tr = trace_origin(model, detail[0], pos=traced, dim=dim)
                ev = tr.events.copy()
                ev.insert(0, "model_state", label)
                event_rows.append(ev)
                (out / f"trace_summary_{label}.txt").write_text(tr.summary())
            try:
                w = planted_writers(model, detail, pos=pos)
                w.insert(0, "model_state", label)
                writer_rows.append(w)
            except Exception as err:  # noqa: BLE001 - the untouched model usually has no sink at pos: say so
                writer_rows.append(pd.DataFrame([dict(model_state=label, pos=pos, dominant=f"none: {err}")]))
        log(f"{label}: census, massive, writers done")
    census = pd.concat(census_rows)
    census.to_csv(out / "census.csv", index=False)
    massive = pd.concat(massive_rows)
    massive.to_csv(out / "massive.csv", index=False)
    writers = pd.concat(writer_rows)
    writers.to_csv(out / "writers.csv", index=False)
    events = pd.concat(event_rows) if event_rows else pd.DataFrame()
    events.to_csv(out / "trace_events.csv", index=False)

    planted_c = census[(census["model_state"] == "planted") & (census["pos"] == pos)]
    before_c = census[(census["model_state"] == "untouched") & (census["pos"] == pos)]
    planted_m = massive[(massive["model_state"] == "planted") & (massive["pos"] == pos)]
    pw = writers[(writers["model_state"] == "planted")]
    s = strength.set_index(["setting", "position"])

    def records(frame: pd.DataFrame, columns: list[str], **where) -> list[dict]:
        for col, value in where.items():
            frame = frame[frame[col] == value] if len(frame) else frame
        return frame[[c for c in columns if c in frame.columns]].to_dict("records") if len(frame) else []

    def inside(low: float, high: float) -> bool:
        return bool(CLAIM_RANGE[0] <= low and high <= CLAIM_RANGE[1])

    born = ["layer", "component", "dim", "pos"]
    summary = dict(
        model=name, dtype=args.dtype, n_seqs=len(whole.tokens), seq_len=int(whole.tokens.shape[1]), pos=pos,
        birth_layer=birth,
        early_layers=[early[0], early[-1]], late_layers=[late[0], late[-1]] if late else [],
        strength={k: [s.loc[(k, pos), c] for c in ("strength", "strength_low", "strength_high")] for k in settings},
        first_token_strength={k: [s.loc[(k, 0), c] for c in ("strength", "strength_low", "strength_high")]
                              for k in settings},
        relative_strength={k: list(v) for k, v in relative.items()},
        share_of_effect={k: list(v) for k, v in shares.items()},
        claim_strength_in_range={k: inside(s.loc[(k, pos), "strength_low"], s.loc[(k, pos), "strength_high"])
                                 for k in ("all", "early")},
        claim_relative_strength_in_range={k: inside(relative[k][1], relative[k][2]) for k in ("all", "early")},
        claim_early_over_90=bool(shares["early"][1] > EARLY_SHARE),
        rotary=rot_rows,
        claim_rotary_within_2pct=all(max(abs(r["relative_low"]), abs(r["relative_high"])) <= ROTARY_BOUND
                                     for r in rot_rows),
        census_at_pos_planted=records(planted_c, ["seq", "level", "first_layer", "last_layer", "n_layers",
                                                  "peak_mass", "mlp_layer", "in_rule"]),
        census_at_pos_untouched=records(before_c, ["seq", "level", "first_layer", "last_layer"]),
        massive_at_pos_planted=(planted_m.groupby("dim").agg(first_layer=("layer", "min"), last_layer=("layer", "max"),
                                                             peak=("value", lambda v: float(v.abs().max())))
                                .reset_index().to_dict("records") if len(planted_m) else []),
        trace_births=records(events, born, kind="birth", model_state="planted"),
        trace_births_first_token_untouched=records(events, born, kind="birth", model_state="untouched"),
        writers_planted=records(pw, WRITER_COLUMNS),
        seconds=round(time.time() - t0, 1),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    log(f"done in {summary['seconds']} s -> {out}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("census_at_pos_planted", "writers_planted")},
                     indent=1, default=float))


def writers_only(args: argparse.Namespace) -> None:
    """The writer split alone, in ``args.dtype``, under the saved run's early plant (a bfloat16 run's
    split can be refused by its own residual check; float32 then gives it without the other passes)."""
    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    model = load_model(dtype=dtype) if args.model == "smollm2" else load_model(args.model, dtype=dtype)
    view = ModelView(model)
    out = Path(args.out) / view.name
    summary = json.loads((out / "summary.json").read_text())
    detail = view.full_batch(sequences(view, str(DATA), summary["seq_len"], args.detail_seqs)).tokens
    first = find_massive(model, detail).to_frame()
    first = first[first["pos"] == 0]
    birth = int(first["layer"].min()) if len(first) else None
    early = list(range(summary["early_layers"][0], summary["early_layers"][1] + 1))
    log(f"{view.name} ({args.dtype}): the first token's massive activation born at layer {birth} "
        f"(saved run: {summary['birth_layer']}); splitting under the plant in layers {early[0]}-{early[-1]}")
    with force_self_attention(model, summary["pos"], early):
        w = planted_writers(model, detail, pos=summary["pos"])
    w.insert(0, "model_state", "planted")
    saved = pd.read_csv(out / "writers.csv")
    pd.concat([saved[saved["model_state"] != "planted"], w]).to_csv(out / "writers.csv", index=False)
    summary["writers_planted"] = w[WRITER_COLUMNS].to_dict("records")
    summary["writers_run"] = dict(dtype=args.dtype, detail_seqs=len(detail), birth_layer=birth,
                                  seconds=round(time.time() - t0, 1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    log(f"done in {summary['writers_run']['seconds']} s -> {out}")
    print(w.to_string())


def pct(x: float) -> str:
    return f"{x:+.1%}"


def model_section(folder: Path) -> str:
    """The results of one model's saved run as Markdown (tables from summary.json and the CSVs)."""
    s = json.loads((folder / "summary.json").read_text())
    pos, lines = s["pos"], []
    lines += [f"### {s['model']}", "",
              f"{s['n_seqs']} WikiText-2 test sequences of {s['seq_len']} tokens, planted position {pos}; the "
              f"first token's massive activation is born at layer {s['birth_layer']}, so early = layers "
              f"{s['early_layers'][0]}-{s['early_layers'][1]}, late = the rest"
              + (f" ({s['dtype']})" if s.get("dtype") else "") + ".", "",
              "| planted in | layers | strength at pos | relative to the first token | first token's strength | "
              "share of the effect |", "|---|---|---|---|---|---|"]
    strength = pd.read_csv(folder / "strength.csv")
    for setting in s["strength"]:
        row = strength[(strength["setting"] == setting) & (strength["position"] == pos)].iloc[0]
        m, lo, hi = s["strength"][setting]
        r = s["relative_strength"][setting]
        f = s["first_token_strength"][setting]
        share = s["share_of_effect"].get(setting)
        lines.append(f"| {setting} | {row['layers'] if isinstance(row['layers'], str) else '-'} | {m:.3f} "
                     f"[{lo:.3f}, {hi:.3f}] | {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}] | "
                     f"{f[0]:.3f} [{f[1]:.3f}, {f[2]:.3f}] | "
                     + (f"{share[0]:.0%} [{share[1]:.0%}, {share[2]:.0%}]" if share else "-") + " |")
    lines += ["", "| the first token at rotary position | its strength | change (relative) | attention mass change |",
              "|---|---|---|---|"]
    for r in s["rotary"]:
        mass = (f"{pct(r['mass_relative'])} [{pct(r['mass_relative_low'])}, {pct(r['mass_relative_high'])}]"
                if "mass_relative" in r else "-")
        lines.append(f"| {r['to']} | {r['strength']:.3f} | {pct(r['relative'])} [{pct(r['relative_low'])}, "
                     f"{pct(r['relative_high'])}] | {mass} |")
    census = s["census_at_pos_planted"]
    levels = ", ".join(sorted({c["level"] for c in census})) or "none"
    life = (f", acting as a sink in layers {min(c['first_layer'] for c in census)}-"
            f"{max(c['last_layer'] for c in census)}, peak attention {max(c['peak_mass'] for c in census):.2f}, "
            f"made by MLP {census[0]['mlp_layer']}") if census else ""
    massive = "; ".join(f"dim {m['dim']} massive at position {pos} in layers {m['first_layer']}-{m['last_layer']} "
                        f"(peak {m['peak']:,.0f})" for m in s["massive_at_pos_planted"]) or "nothing massive at pos"
    born = "; ".join(f"dim {b['dim']} at position {b['pos']} born in {b['component']} {b['layer']}"
                     for b in s["trace_births"]) or "no birth"
    born0 = "; ".join(f"dim {b['dim']} born in {b['component']} {b['layer']}"
                      for b in s["trace_births_first_token_untouched"]) or "none"
    lines += ["", "Known answers, under the early plant, on the detail sequences:", "",
              f"- **census**: position {pos} is named in {len(census)} of the detail sequences, level {levels}{life} "
              f"(untouched: {len(s['census_at_pos_untouched'])} rows at position {pos});",
              f"- **find_massive**: {massive};",
              f"- **trace_origin**: {born} (the untouched first token's: {born0});"]
    w = pd.DataFrame(s["writers_planted"])
    if "dominant_share" not in w.columns:
        refused = pd.read_csv(folder / "writers.csv")
        why = refused.loc[refused["model_state"] == "planted", "dominant"].iloc[0]
        lines.append(f"- **the sink logit's writers** (`planted_writers`): refused, {why.removeprefix('none: ')}.")
    elif len(w):
        top = w["dominant"].value_counts()
        run = s.get("writers_run")
        where = (f" (this split alone in {run['dtype']}, on {run['detail_seqs']} sequences, "
                 f"{run['seconds']:.0f} s: `--writers-only`)" if run else "")
        said = (f"- **the sink logit's writers** (`planted_writers`, the {len(w)} heads that attend most to "
                f"position {pos}){where}: the dominant writer is " + ", ".join(f"{k} in {v}" for k, v in top.items())
                + " of them, the runner-up "
                + ", ".join(f"{k} in {v}" for k, v in w["runner_up"].value_counts().items()))
        if w["dominant_share"].between(0, 1.5).all():
            said += (f", with {w['dominant_share'].min():.0%}-{w['dominant_share'].max():.0%} of the logit; the "
                     f"runner-up at most {w['runner_up_share'].max():.1%}.")
        else:  # a mean logit near zero: the parts are large and of both signs, so report them against it
            ratio = (w["dominant_share"] / w["runner_up_share"]).abs()
            part = (w["dominant_share"] * w["logit"]).abs()
            said += (f"; the heads' mean logits on position {pos} ({w['logit'].abs().min():.2g} to "
                     f"{w['logit'].abs().max():.2g} in size) are nets of parts of both signs, the dominant one "
                     f"{part.min():.2g} to {part.max():.2g} in size, so its share of the logit "
                     f"({w['dominant_share'].min():,.0%} to {w['dominant_share'].max():,.0%}) means little: the "
                     f"dominant part is {ratio.min():.1f}-{ratio.max():.1f}x the runner-up's, of the same sign in "
                     f"{int((w['dominant_share'] * w['runner_up_share'] > 0).sum())} of {len(w)}; the parts add up "
                     f"to the scores within {w['check'].max():.0e} (relative).")
        lines.append(said)
    return "\n".join(lines) + "\n"


def write_page(root: Path, page: Path) -> None:
    """Fill the page's results between its markers from every saved model folder under ``root``."""
    text = page.read_text()
    start, end = "<!-- results: scripts/planted_sink.py --page -->", "<!-- end of results -->"
    body = "\n".join(model_section(f) for f in sorted(root.iterdir()) if (f / "summary.json").is_file())
    head, rest = text.split(start)
    page.write_text(head + start + "\n\n" + body + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--page"]:
        write_page(Path("docs/planted_sink"), Path("docs/planted_sink.md"))
    else:
        main()
