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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/09_nnsight_and_long_context.ipynb)
#
# # nnsight models and long contexts: sinks without the attention pattern
#
# Two ways the analyses leave TransformerLens's eager attention behind:
#
# 1. **nnsight.** `load_model(..., backend="nnsight")` gives an nnsight model over the same weights;
#    the residual-stream analyses and the sink analyses run on it with the same calls
#    (`docs/nnsight.md`).
# 2. **The fused kernel.** An attention pattern is `[head, query, key]` per layer, quadratic in the
#    length. The sink analyses need attention on a few key columns only, which they compute from
#    `q`, `k` and the kernel's log-sum-exp (`attention="auto"`, the default): memory linear in the
#    length (`docs/long_context.md`).

# %%
import os
import subprocess
import sys
import time

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # install massive_lens with nnsight; the model then comes from the Hugging Face hub
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "massive-lens @ git+https://github.com/massive-lens/massive_lens"], check=True)
SMALL = os.environ.get("MASSIVE_LENS_SMALL") == "1"  # tiny settings for CI

print('small:', SMALL)

# %% [markdown]
# ## 1. The same numbers on nnsight
#
# The default model twice: as a TransformerLens bridge and as an nnsight model. `find_massive` and
# `sink_census` take either.

# %%
from massive_lens import default_text, find_massive, load_model, sink_attention, sink_census

text = "The history of the city begins in the Roman era, when a fort stood by the river."
bridge = load_model()                    # TransformerLens: a TransformerBridge
lm = load_model(backend="nnsight")       # nnsight: a TransformersModel over the same weights
columns = ["pos", "dim", "token", "peak_layer", "value"]
print(find_massive(bridge, text).by_dim().head(3)[columns])
print(find_massive(lm, text).by_dim().head(3)[columns])

# %% [markdown]
# The census on nnsight runs on the fused kernel (nnsight serves no pattern). Compare its rows with
# the bridge's, and with the table in `docs/nnsight.md`.

# %%
census_columns = ["pos", "token", "level", "first_layer", "last_layer", "peak_mass"]
on_bridge = sink_census(bridge, text).to_frame()[census_columns]
on_nnsight = sink_census(lm, text).to_frame()[census_columns]
print(on_nnsight.head(4))
print("largest peak-mass difference:", float((on_bridge.peak_mass - on_nnsight.peak_mass).abs().max()))

# %% [markdown]
# What does not run on nnsight is refused by name, with what to do instead:

# %%
from massive_lens import MassiveLensError, trace_origin

try:
    trace_origin(lm, text)
except MassiveLensError as exc:
    print(str(exc)[:400], "...")

# %% [markdown]
# ## 2. A long text on the fused kernel
#
# A few thousand tokens of the offline default text (CPython's reference manual). `sink_attention` on
# the default path never builds the pattern; `attention="eager"` does, and gives the same table.

# %%
length = 512 if SMALL else 4096
ids = bridge.to_tokens(default_text()[: 8 * length])[:, :length]
print("tokens:", ids.shape[1])

start = time.perf_counter()
fast = sink_attention(bridge, ids)                       # the model on SDPA, no pattern
fast_s = time.perf_counter() - start
start = time.perf_counter()
slow = sink_attention(bridge, ids, attention="eager")    # the [head, query, key] pattern per layer
slow_s = time.perf_counter() - start
gap = float((fast.to_frame().sink_mass - slow.to_frame().sink_mass).abs().max())
print(f"{fast.attention}: {fast_s:.1f} s; {slow.attention}: {slow_s:.1f} s; largest difference {gap:.1e}")

# %% [markdown]
# The census at that length: which tokens are sinks, at what level, and for how many layers.

# %%
census = sink_census(bridge, ids)
print(census.summary())
frame = census.to_frame()
print(frame.groupby("level").agg(sinks=("pos", "size"), first_pos=("pos", "min"), last_pos=("pos", "max"),
                                 peak_mass=("peak_mass", "median")))

# %% [markdown]
# On SmolLM2-135M and one 8,192-token WikiText-2 document, `docs/long_context.md` finds the first
# token the only persistent sink (layers 3-29) and no sink of any level after position 512; run
# `python scripts/long_context.py page` from a checkout to reproduce it.
