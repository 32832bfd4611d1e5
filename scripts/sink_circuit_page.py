"""The real output of docs/circuit.md: sink_circuit (split and causal check) and norm_roles on one
model, on WikiText-2, saved under docs/circuit/<model>/ (result folders, the figure, the summaries).

``python scripts/sink_circuit_page.py default 16`` (the model, then the causal check's sequences;
``qwen2.5-coder-1.5b 6``; a third argument is the WikiText-2 test file, default
../shared/data/wikitext-2/test.txt beside the checkout). ``--render docs/circuit/smollm2`` rewrites
a run's output.txt from its saved results, in the current code's wording. One torch thread: on a shared CPU, spinning
threads cost more than they give.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

from massive_lens import load, load_model
from massive_lens.attention import sink_circuit
from massive_lens.attention.circuit_split import visible_token
from massive_lens.attention.norm_roles import norm_roles
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import save_figure

ROOT = Path(__file__).resolve().parents[1]
CONTROL_VIEW = ["layer", "head", "mass_before", "mass_after", "mass_after_low", "mass_after_high", "margin",
                "removed_logit", "runner_up_after", "runner_up_gap_low", "runner_up_gap_high", "random_after",
                "random_after_min", "random_logit", "random_gap_low", "random_gap_high", "specific"]


def main(name: str, n_seqs: int, corpus: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = load_model(None if name == "default" else name)
    view = ModelView(model)
    out = ROOT / "docs" / "circuit" / ("smollm2" if name == "default" else name)
    out.mkdir(parents=True, exist_ok=True)
    text = sequences(view, corpus, 128, 4)  # the split: the first 4 sequences of 128 tokens
    held = sequences(view, corpus, 128, 4 + n_seqs)[4:]  # the causal check: the next n_seqs
    start = time.time()
    circuit = sink_circuit(model, text, corpus=held)  # a tqdm bar counts the causal check's passes
    took = time.time() - start
    roles = norm_roles(model, text)
    circuit.save(out / "sink_circuit", overwrite=True)
    roles.save(out / "norm_roles", overwrite=True)
    save_figure(circuit.plot(), out / "chain", formats=("png",))
    write_output(out, circuit, roles, took)


def render(folder: str) -> None:
    """Rewrite ``output.txt`` from the results saved in ``folder`` (``--render docs/circuit/smollm2``):
    the wording of the current code, the numbers of the saved run, its wall time kept."""
    out = Path(folder)
    took = float((out / "output.txt").read_text().rsplit("wall time ", 1)[1].rstrip("s\n"))
    write_output(out, load(out / "sink_circuit"), load(out / "norm_roles"), took)


def write_output(out: Path, circuit, roles, took: float) -> None:
    """The page's text output of one run, printed and written to ``out/output.txt``."""
    verdicts = circuit.verdicts()
    headline = roles.headline().copy()
    headline["token"] = visible_token(str(headline["token"]))  # a whitespace token never prints blank
    causal = circuit.causal
    lines = [circuit.summary(), "", roles.summary(), "", "headline entry:",
             headline.to_string(), "", "per head (circuit.verdicts()):",
             verdicts[["layer", "head", "sink_mass", "margin", "verdict", "why"]].round(3).to_string(), "",
             verdicts[["layer", "head", "dominant", "dominant_share", "massive_share", "killed_by", "survives"]]
             .round(3).to_string(), "", "circuit.heads:", circuit.heads.round(3).to_string(), "",
             "the writer removal against its controls (circuit.causal):",
             causal[causal["removal"] == "dominant writer"][CONTROL_VIEW].round(3).to_string(), "",
             "circuit.causal:", causal.drop(columns=["est_seconds"]).round(3).to_string(), "",
             "norm_roles by scope:", roles.to_frame().groupby("scope")["role"].value_counts().to_string(), "",
             roles.layers.round(3).to_string(), "", f"sink_circuit wall time {took:.0f}s"]
    (out / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__" and sys.argv[1] == "--render":
    render(sys.argv[2])
elif __name__ == "__main__":
    default_corpus = str(ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else default_corpus)
