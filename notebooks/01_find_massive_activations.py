# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/01_find_massive_activations.ipynb)
#
# # Find massive activations
#
# A few residual-stream values are thousands of times the median (Sun et al., 2024). Find them in one text,
# see the activation landscape, and count how often they occur over a corpus.

# %%
import os
import subprocess
import sys

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # install massive_lens; the model then comes from the Hugging Face hub
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "massive-lens @ git+https://github.com/massive-lens/massive_lens"], check=True)
SMALL = os.environ.get("MASSIVE_LENS_SMALL") == "1"  # tiny settings for CI

from massive_lens import load_model

model = load_model("HuggingFaceTB/SmolLM2-135M-Instruct") if IN_COLAB else load_model()
TEXT = "Summer is warm. Winter is cold.\nThe cat sat on the mat, and the dog slept."
print(model.cfg.model_name, model.cfg.n_layers, "layers, d_model", model.cfg.d_model, "| small:", SMALL)

# %%
from massive_lens import find_massive, layer_profile, scan_corpus, tiny_model
from massive_lens.viz import activation_landscape, magnitude_view, overlay_profiles

found = find_massive(model, TEXT)
print(found.summary())
found.by_dim()

# %% [markdown]
# The layer-wise view (the paper's Figure 2): the top-1 magnitude jumps in one early layer and stays, while
# the median does not move.

# %%
found.plot();

# %% [markdown]
# The landscape of one layer (the paper's Figure 1): one ridge per token, spikes on a few dimensions at a
# few tokens.

# %%
activation_landscape(model, TEXT);

# %% [markdown]
# Tokens coloured by their largest |activation| (log10), an offline circuitsvis view:

# %%
magnitude_view(model, TEXT, layer=found.layers[0] if found.layers else 0)

# %% [markdown]
# How often, over the offline default text (CPython's reference manual):

# %%
scan = scan_corpus(model, seq_len=64 if SMALL else 256, max_tokens=256 if SMALL else 8192)
print(scan.summary())
scan.to_frame()

# %% [markdown]
# A random-weight model of the same family has none: the overlay shows the gap.

# %%
random = layer_profile(tiny_model('llama'), [TEXT])
overlay_profiles({'SmolLM2 (trained)': scan, 'tiny llama (random)': random}, relative_depth=True);
