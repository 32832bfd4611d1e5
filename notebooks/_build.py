"""Write the numbered notebooks from the cell sources below (run: python notebooks/_build.py).

Each notebook opens with an "Open in Colab" badge and a set-up cell that installs
massive_lens on Colab (where the model comes from the Hugging Face hub) and otherwise uses
the offline default. ``MASSIVE_LENS_SMALL=1`` (set by the tests) shrinks every setting.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

REPO = "massive-lens/massive_lens"  # GitHub owner/name used by the Colab badge and install line
HERE = Path(__file__).parent

SETUP = f'''import os, subprocess, sys

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # install massive_lens; the model then comes from the Hugging Face hub
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "massive-lens @ git+https://github.com/{REPO}"], check=True)
SMALL = os.environ.get("MASSIVE_LENS_SMALL") == "1"  # tiny settings for CI

from massive_lens import load_model

model = load_model("HuggingFaceTB/SmolLM2-135M-Instruct") if IN_COLAB else load_model()
TEXT = "Summer is warm. Winter is cold.\\nThe cat sat on the mat, and the dog slept."
print(model.cfg.model_name, model.cfg.n_layers, "layers, d_model", model.cfg.d_model, "| small:", SMALL)'''

SETUP_TRAIN = SETUP.split("from massive_lens import load_model")[0] + "print('small:', SMALL)"

NOTEBOOKS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "01_find_massive_activations": (
        "Find massive activations",
        "A few residual-stream values are thousands of times the median (Sun et al., 2024). "
        "Find them in one text, see the activation landscape, and count how often they occur over a corpus.",
        [
            ("code", "from massive_lens import find_massive, layer_profile, scan_corpus, tiny_model\n"
                     "from massive_lens.plots import activation_landscape, overlay_profiles\n"
                     "from massive_lens.views import magnitude_view\n\n"
                     "found = find_massive(model, TEXT)\nprint(found.summary())\nfound.by_dim()"),
            ("md", "The layer-wise view (the paper's Figure 2): the top-1 magnitude jumps in one early "
                   "layer and stays, while the median does not move."),
            ("code", "found.plot();"),
            ("md", "The landscape of one layer (the paper's Figure 1): one ridge per token, spikes on a "
                   "few dimensions at a few tokens."),
            ("code", "activation_landscape(model, TEXT);"),
            ("md", "Tokens coloured by their largest |activation| (log10), an offline circuitsvis view:"),
            ("code", "magnitude_view(model, TEXT, layer=found.layers[0] if found.layers else 0)"),
            ("md", "How often, over the offline default text (CPython's reference manual):"),
            ("code", "scan = scan_corpus(model, seq_len=64 if SMALL else 256, max_tokens=256 if SMALL else 8192)\n"
                     "print(scan.summary())\nscan.to_frame()"),
            ("md", "A random-weight model of the same family has none: the overlay shows the gap."),
            ("code", "random = layer_profile(tiny_model('llama'), [TEXT])\n"
                     "overlay_profiles({'SmolLM2 (trained)': scan, 'tiny llama (random)': random}, "
                     "relative_depth=True);"),
        ],
    ),
    "02_trace_origin": (
        "Trace where a massive activation is born",
        "The residual stream is a sum, so a ledger of every component's write says who made the "
        "massive value, who erased it and who wrote it again; one level down, the MLP neurons and "
        "their W_out entries (super weights, Yu et al., 2024).",
        [
            ("code", "from massive_lens import find_massive\nfrom massive_lens.origin import trace_origin\n\n"
                     "top = find_massive(model, TEXT).by_dim().iloc[0]\n"
                     "trace = trace_origin(model, TEXT, dim=int(top.dim), pos=int(top.pos), verify=not SMALL)\n"
                     "print(trace.summary())"),
            ("md", "The waterfall: each attention and MLP bar moves the value from the residual before it "
                   "to the residual after it."),
            ("code", "trace.plot();"),
            ("code", "trace.events"),
            ("md", "The neurons behind each MLP event, the candidate super weights, and why the neuron "
                   "fires on this token (its pre-activation split over upstream components):"),
            ("code", "trace.neurons.head(10)"),
            ("code", "trace.super_weights"),
            ("code", "trace.why.head(10)"),
            ("md", "The causal check (`verify=True`, skipped with small settings): zero the named neurons, "
                   "or only their weights, and see how much of the massive value is left."),
            ("code", "trace.verification"),
        ],
    ),
    "03_attention_sinks": (
        "Attention sinks as a fixed bias",
        "Tokens with massive activations draw most of the attention. Split each head's output into the "
        "sink term (attention to the sinks times their values) and the content term: the sink term "
        "is nearly the same vector everywhere, an implicit bias (Sun et al., 2024, section 4.2).",
        [
            ("code", "from massive_lens import find_massive\n"
                     "from massive_lens.attention import decompose_attention, sink_attention\n"
                     "from massive_lens.plots import attention_maps\nfrom massive_lens.views import attention_view\n\n"
                     "texts = [TEXT, 'Another text, on another topic.\\nIt has two lines.']\n"
                     "sinks = sink_attention(model, texts)\nprint(sinks.summary())\nsinks.plot();"),
            ("code", "found = find_massive(model, TEXT)\n"
                     "layer = min((found.layers or [0])[0] + 1, model.cfg.n_layers - 1)\n"
                     "attention_maps(model, TEXT, layer, max_heads=4 if SMALL else 12);"),
            ("md", "The same layer in an interactive, offline circuitsvis view (click a head):"),
            ("code", "attention_view(model, TEXT, layer)"),
            ("code", "decomposition = decompose_attention(model, texts, layer=None if not SMALL else [layer])\n"
                     "print(decomposition.summary())\ndecomposition.plot();"),
        ],
    ),
    "04_interventions": (
        "Interventions: the paper's table",
        "Zeroing the few massive activations destroys a model; setting them to their mean changes "
        "nothing (Sun et al., 2024, Table 3). Each intervention below edits one part of the fixed-bias "
        "story, judged by perplexity on the same sequences, with a paired 95% bootstrap interval.",
        [
            ("code", "from massive_lens.evaluate import SETTINGS, run_interventions, sequences\n"
                     "from massive_lens.interventions import calibrate\n\n"
                     "seq_len, n_eval, n_calib = (32, 2, 2) if SMALL else (128, 16, 8)\n"
                     "tokens = sequences(model, None, seq_len, n_eval + n_calib)  # offline default text\n"
                     "calib = calibrate(model, tokens[n_eval:], seq_len=seq_len, n_seqs=n_calib)  # other text\n"
                     "settings = ['original', 'zero', 'mean', 'control'] if SMALL else list(SETTINGS)\n"
                     "table = run_interventions(model, tokens[:n_eval], calib, settings=settings)\n"
                     "print(table.summary())"),
            ("code", "table.plot();"),
            ("md", "Each intervention is also a context manager, for your own experiments:"),
            ("code", "from massive_lens.interventions import ablate_massive\n\n"
                     "with ablate_massive(model, 'zero', calibration=calib):\n"
                     "    logits = model(tokens[:1])\nlogits.shape"),
        ],
    ),
    "05_softmax_vs_softmax1": (
        "softmax vs softmax1 and friends",
        "Train small models that differ only in their attention (softmax, softmax1 = one extra zero "
        "key, a learned sink logit, ...) under the same budget, then measure massive activations, "
        "sinks, kurtosis and the W8A8 quantization gap. The comparison means something only if the "
        "softmax baseline develops massive activations; the summary says whether it did.",
        [
            ("code", "from massive_lens.plots import overlay_profiles\n"
                     "from massive_lens.train.compare import compare_variants\n\n"
                     "variants = ['softmax', 'softmax1'] + ([] if SMALL else ['learned_sink', 'gated'])\n"
                     "result = compare_variants(variants, 'smoke', seeds=[0], steps=10 if SMALL else 300)\n"
                     "print(result.summary())\nresult.to_frame()"),
            ("code", "result.plot();"),
            ("code", "overlay_profiles(result.profiles, title='block-output magnitude per variant');"),
            ("md", "The CI-sized `smoke` preset is far too small for massive activations to emerge. "
                   "Larger budgets:\n\n"
                   "- `cpu` preset (about 20 minutes on 2 cores): `compare_variants(variants, 'cpu', "
                   "out_dir='runs/cpu')`;\n"
                   "- the GPT-2-scale GPU preset on FineWeb-Edu (needs network and the `datasets` extra), "
                   "resumable and data-parallel:\n\n"
                   "```python\n"
                   "from massive_lens.train.compare import compare_main\n"
                   "print(compare_main(preset='gpu-gpt2', variants='softmax,softmax1', out_dir='runs/gpt2'))\n"
                   "```\n\n"
                   "Saved as a script, the same call runs data-parallel with `torchrun --nproc_per_node=8 "
                   "script.py`; an interrupted run resumes from `out_dir`."),
        ],
    ),
}


def build(name: str, title: str, intro: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    badge = (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
             f"(https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{name}.ipynb)")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    setup = SETUP_TRAIN if name.startswith("05") else SETUP
    nb.cells = [nbformat.v4.new_markdown_cell(f"{badge}\n\n# {title}\n\n{intro}"), nbformat.v4.new_code_cell(setup)]
    for kind, source in cells:
        nb.cells.append(nbformat.v4.new_markdown_cell(source) if kind == "md" else nbformat.v4.new_code_cell(source))
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name[:2]}-{i:02d}"
    return nb


if __name__ == "__main__":
    for name, (title, intro, cells) in NOTEBOOKS.items():
        nbformat.write(build(name, title, intro, cells), HERE / f"{name}.ipynb")
