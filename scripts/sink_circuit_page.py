"""The real output of docs/circuit.md: sink_circuit (split and causal check) and norm_roles on one
model, on WikiText-2, saved under docs/circuit/<model>/ (result folders, the figure, the summaries).

``python scripts/sink_circuit_page.py default 16`` (the model, then the causal check's sequences;
``qwen2.5-coder-1.5b 6``; a third argument is the WikiText-2 test file, default
../shared/data/wikitext-2/test.txt beside the checkout). One torch thread: on a shared CPU, spinning
threads cost more than they give.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

from massive_lens import load_model
from massive_lens.attention import sink_circuit
from massive_lens.attention.rescale import norm_roles
from massive_lens.core.corpora import sequences
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import save_figure

ROOT = Path(__file__).resolve().parents[1]


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
    circuit = sink_circuit(model, text, corpus=held)
    took = time.time() - start
    roles = norm_roles(model, text)
    circuit.save(out / "sink_circuit", overwrite=True)
    roles.save(out / "norm_roles", overwrite=True)
    save_figure(circuit.plot(), out / "chain", formats=("png",))
    lines = [circuit.summary(), "", roles.summary(), "", "headline entry:", roles.headline().to_string(), "",
             circuit.heads.round(3).to_string(), "", circuit.causal.drop(columns=["est_seconds"]).round(3).to_string(),
             "", roles.layers.round(3).to_string(), "", f"sink_circuit wall time {took:.0f}s"]
    (out / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    default_corpus = str(ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else default_corpus)
