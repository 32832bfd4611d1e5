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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/12_handover.ipynb)
#
# # Handing the detector to other tools: SAE training, abliteration, half precision
#
# SAELens, dictionary_learning, heretic and half-precision users each write a massive-activation or
# sink detector by hand. `massive_lens.handover` gives them the library's own definitions in the
# shapes they take: a position mask and a token-id list (SAELens), a norm multiple per layer
# (dictionary_learning), the dims to keep out of a direction (abliteration), and a float16 /
# bfloat16 verdict confirmed by running the model. `docs/handover.md` has the full runs.

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
# ## 1. Which positions to leave out of SAE training
#
# A position is left out when it carries a token-specific massive activation or is an attention
# sink of the chosen levels. An outlier dimension (a dim large at most tokens) marks no position: it
# is a property of the dim, handled in section 3. `token_ids()` lists only the ids left out at every
# one of their occurrences, since SAELens's `exclude_special_tokens` drops an id everywhere.

# %%
from massive_lens import exclusion_mask, load_model

model = load_model()
texts = ["The quick brown fox jumps over the lazy dog. It was a sunny day.", "Hello, world.\nBye."]
ex = exclusion_mask(model, texts, levels=("primary", "secondary"))
print(ex.summary())
print(ex.to_frame()[["seq", "pos", "token", "reason", "dim", "value"]].to_string())
print("for exclude_special_tokens:", ex.token_ids(), "| kept positions:", int(ex.keep.sum()))

# %% [markdown]
# An activation store keeps the rows of the positions to keep (`ex.keep` is `valid & ~mask`):

# %%
seen = {}


def grab(x, hook):
    seen["x"] = x.detach()


layer = model.cfg.n_layers // 2
model.run_with_hooks(ex.tokens, attention_mask=ex.valid.long(),
                     fwd_hooks=[(f"blocks.{layer}.hook_resid_post", grab)])
rows = seen["x"][ex.keep]        # [kept positions, d_model]: what the SAE trains on
print(tuple(rows.shape))

# %% [markdown]
# ## 2. A norm threshold per layer (dictionary_learning)
#
# dictionary_learning drops activations above a multiple of the median norm. `norm_thresholds`
# calibrates that multiple per layer against the positions that are massive at that layer, and says
# where one threshold separates them from the rest.

# %%
import massive_lens.handover as handover

n_seqs = 2 if SMALL else 8
th = handover.norm_thresholds(model, n_seqs=n_seqs)    # the offline default text
print(th.summary())
print(th.to_frame().query("n_massive > 0").head(6).round(2).to_string(index=False))
print("max_activation_norm_multiple at layer", layer, ":", round(th.multiple(layer), 2))

# %% [markdown]
# ## 3. Dims to keep out of a direction (abliteration)
#
# heretic's rule: a dim massive in at least 25% of the layers is zeroed in a refusal or steering
# direction first. `massive_dims` applies it and writes a small JSON file any tool can read.

# %%
import json
import tempfile
from pathlib import Path

dims = handover.massive_dims(model, n_seqs=n_seqs, persistence=0.25)
print(dims.summary())
path = dims.to_json(Path(tempfile.mkdtemp()) / "massive_dims.json")
print(json.load(open(path))["dims"])                  # the standard library alone reads it
direction = model.W_U[:, 0].detach()                  # any [d_model] direction; here an unembedding column
print(direction[list(dims.dims)], dims.keep_out(direction)[list(dims.dims)])   # those dims zeroed, in a copy

# %% [markdown]
# ## 4. float16 or bfloat16?
#
# `precision_check` measures every residual, attention and MLP value and what each norm computes
# from its input, compares them with each dtype's range and spacing, then runs the model in each
# dtype to confirm. The weights are cast in place and put back bit for bit afterwards.

# %%
check = handover.precision_check(model, n_seqs=1 if SMALL else 4, seq_len=32 if SMALL else 64)
print(check.summary())
print(check.verdicts[["dtype", "verdict", "ppl_ratio", "top1_agree", "overflow", "square_overflow",
                      "rounds_away"]].round(4).to_string())

# %% [markdown]
# On SmolLM2-135M-Instruct `docs/handover.md` finds both dtypes safe: no value overflows float16
# (the largest, about 25,000, fits under 65,504), and although the norms' squares would overflow,
# the run stays finite because the model's RMSNorm squares in float32.
