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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/06_retrofit.ipynb)
#
# # Retrofit: remove a pretrained model's massive activations, give it an off-switch, let it re-learn
#
# Training from scratch on a CPU never grows massive activations, so it cannot say whether softmax1 would
# have prevented them. A pretrained model has them. Here we zero the super weights that `trace_origin`
# names (the down-projection weights of the neurons that give birth to the massive activations), swap the
# attention through transformers' attention interface (plain softmax, softmax1, or a learned key/value
# slot initialised as bias surgery does), fine-tune every weight on the same batches, and watch whether
# the loss recovers and whether the massive activations grow back. See `docs/retrofit.md` for the full run.

# %%
import os
import subprocess
import sys

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # install massive_lens; the model then comes from the Hugging Face hub
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "massive-lens @ git+https://github.com/massive-lens/massive_lens"], check=True)
SMALL = os.environ.get("MASSIVE_LENS_SMALL") == "1"  # tiny settings for CI

print('small:', SMALL)

# %% [markdown]
# Training text and held-out text: the two ends of the offline default text (CPython's reference manual),
# so the notebook needs no download. `docs/retrofit.md` trains on WikiText-2 valid and evaluates on
# WikiText-2 test.

# %%
from massive_lens import default_text, load_model
from massive_lens.train import retrofit

model = load_model()
text = default_text()
half = 100_000 if SMALL else len(text) // 2
train_text, held_out = text[:half], text[-half:]
settings = ['softmax-removed', 'softmax1-removed'] + ([] if SMALL else ['softmax-kept', 'kv_bias-removed'])
result = retrofit(model, settings, steps=2 if SMALL else 12, batch_size=2 if SMALL else 4,
                  seq_len=32 if SMALL else 128, eval_every=1 if SMALL else 4, eval_seqs=2 if SMALL else 4,
                  data=train_text, eval_data=held_out, measure=not SMALL, lr=2e-4, warmup_steps=2)
print(result.summary())
result.to_frame()

# %% [markdown]
# Held-out loss over steps (one line per setting), and the formerly massive dims' largest |value|
# (solid: anywhere; dashed: at the first token):

# %%
result.plot();

# %%
result.plot_activations();

# %% [markdown]
# Per layer, at the last evaluation: where do the traced dims regrow, and how much attention goes to the
# first token and to the slot?

# %%
last = result.per_layer[result.per_layer.step == result.per_layer.step.max()]
last.pivot_table(index='layer', columns='setting', values=['dims_max', 'first_mass', 'slot_mass']).round(3)

# %% [markdown]
# The zeroed super weights (`hf_param[hf_row, hf_col]` in the Hugging Face model):

# %%
result.super_weights[['layer', 'neuron', 'dim', 'value', 'hf_param', 'hf_row', 'hf_col']]
