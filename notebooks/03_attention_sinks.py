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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/03_attention_sinks.ipynb)
#
# # Attention sinks as a fixed bias
#
# Tokens with massive activations draw most of the attention. Split each head's output into the sink term
# (attention to the sinks times their values) and the content term: the sink term is nearly the same vector
# everywhere, an implicit bias (Sun et al., 2024, section 4.2).

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
from massive_lens import decompose_attention, find_massive, sink_attention
from massive_lens.viz import attention_maps, attention_view

texts = [TEXT, 'Another text, on another topic.\nIt has two lines.']
sinks = sink_attention(model, texts)
print(sinks.summary())
sinks.plot();

# %%
found = find_massive(model, TEXT)
layer = min((found.layers or (0,))[0] + 1, model.cfg.n_layers - 1)
attention_maps(model, TEXT, layer, max_heads=4 if SMALL else 12);

# %% [markdown]
# The same layer in an interactive, offline circuitsvis view (click a head):

# %%
attention_view(model, TEXT, layer)

# %%
decomposition = decompose_attention(model, texts, layers=[layer] if SMALL else None)
print(decomposition.summary())
decomposition.plot();
