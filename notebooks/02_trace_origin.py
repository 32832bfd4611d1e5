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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/02_trace_origin.ipynb)
#
# # Trace where a massive activation is born
#
# The residual stream is a sum, so a ledger of every component's write says who made the massive value, who
# erased it and who wrote it again; one level down, the MLP neurons and their W_out entries (super weights,
# Yu et al., 2024).

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
from massive_lens import find_massive, trace_origin

top = find_massive(model, TEXT).by_dim().iloc[0]
trace = trace_origin(model, TEXT, dim=int(top.dim), pos=int(top.pos), verify=not SMALL)
print(trace.summary())

# %% [markdown]
# The waterfall: each attention and MLP bar moves the value from the residual before it to the residual
# after it.

# %%
trace.plot();

# %%
trace.events

# %% [markdown]
# The neurons behind each MLP event, the candidate super weights, and why the neuron fires on this token
# (its pre-activation split over upstream components):

# %%
trace.neurons.head(10)

# %%
trace.super_weights

# %%
trace.why.head(10)

# %% [markdown]
# The causal check (`verify=True`, skipped with small settings): zero the named neurons, or only their
# weights, and see how much of the massive value is left.

# %%
trace.verification
