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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/04_interventions.ipynb)
#
# # Interventions: the paper's table
#
# Zeroing the few massive activations destroys a model; setting them to their mean changes nothing (Sun et
# al., 2024, Table 3). Each intervention below edits one part of the fixed-bias story, judged by perplexity
# on the same sequences, with a paired 95% bootstrap interval.

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
from massive_lens import calibrate, default_text, run_interventions
from massive_lens.interventions import SETTINGS

seq_len, n_eval, n_calib = (32, 2, 2) if SMALL else (128, 16, 8)
text = default_text()  # the offline default text; the evaluation (corpus None) reads its start
calib = calibrate(model, text[len(text) // 2:], seq_len=seq_len, n_seqs=n_calib)  # means from other text
settings = ['original', 'zero', 'mean', 'control'] if SMALL else list(SETTINGS)
table = run_interventions(model, None, calibration=calib, settings=settings, seq_len=seq_len, n_seqs=n_eval)
print(table.summary())

# %%
table.plot();

# %% [markdown]
# Each intervention is also a context manager, for your own experiments:

# %%
from massive_lens.interventions import ablate_massive

tokens = model.to_tokens(TEXT)
with ablate_massive(model, 'zero', calibration=calib):
    logits = model(tokens)
logits.shape
