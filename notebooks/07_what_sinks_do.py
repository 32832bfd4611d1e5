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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/07_what_sinks_do.ipynb)
#
# # What sinks do: the compression valley, the streaming window, over-mixing, the repeated-token circuit
#
# Finding sinks and massive activations says they exist; four published experiments ask what they do.
# Each is one call in `massive_lens.effects` and returns a result with `summary()`, `to_frame()`,
# `plot()` and `save()`. See `docs/effects.md` for the full runs on SmolLM2-135M and Qwen2.5-Coder-1.5B.

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
# The text: the offline default text (CPython's reference manual), so nothing is downloaded. Its first
# half is calibration (where the massive activations are found), its second half the evaluation text.

# %%
from massive_lens import default_text, load_model
from massive_lens.effects import compression_valley, over_mixing, repeated_token_probe, streaming_window

model = load_model()
text = default_text()
calibration, evaluation = text[: len(text) // 2], text[len(text) // 2:]

# %% [markdown]
# ## 1. The compression valley (Queipo-de-Llano et al., 2025)
#
# Per layer: the matrix entropy of the token representations (1: spread over many directions, 0: rank
# one), the first token's residual norm and the sink rate. Then the same with the massive activations
# zeroed at every layer where they are massive. Where the first token's norm explodes the entropy
# collapses; without the massive activations the valley should largely go away.

# %%
valley = compression_valley(model, evaluation, seq_len=64 if SMALL else 256, n_seqs=2 if SMALL else 8,
                            calibration=calibration)
print(valley.summary())
valley.plot();

# %% [markdown]
# ## 2. The streaming window (StreamingLLM, Xiao et al., 2023)
#
# Perplexity with a rolling window of recent tokens plus the first `k` tokens kept, positions within
# the cache, against full attention. Without the first tokens (`k=0`) perplexity should jump once the
# window starts to evict; keeping one or a few restores it. The sink census says which `k` to expect.

# %%
stream = streaming_window(model, evaluation, window=32 if SMALL else 256, seq_len=128 if SMALL else 1024,
                          n_seqs=1 if SMALL else 4)
print(stream.summary())
stream.plot();

# %% [markdown]
# ## 3. Over-mixing (Barbero et al., 2025)
#
# Nudge token 1's embedding by 1% of its norm and measure how far the change reaches the later tokens,
# layer by layer, with the sinks intact and with the attention to the sinks removed. The claim: the sinks
# limit the spread.

# %%
mix = over_mixing(model, evaluation, seq_len=64 if SMALL else 128, n_seqs=2 if SMALL else 8,
                  calibration=calibration)
print(mix.summary())
mix.plot();

# %% [markdown]
# ## 4. The repeated-token circuit (Yona et al., 2025)
#
# Repeat one token many times after the first token. After enough repeats they start to look like a first
# token (huge norm, they draw attention). The probe finds the layer-0 head and the MLP neuron behind it and
# zeroes that neuron at the repeats; the patch should stop it without hurting ordinary text. SmolLM2 needs
# about 1,500 repeats of " the" before it happens (a few minutes on a CPU); the small setting shows none.

# %%
probe = repeated_token_probe(model, " the", 64 if SMALL else 3000, text=evaluation, seq_len=64 if SMALL else 128,
                             n_seqs=2 if SMALL else 8)
print(probe.summary())
probe.plot();

# %% [markdown]
# ## 5. Training stability: do massive activations come with loss spikes?
#
# `train_model` and `compare_variants` record every step: the loss, the gradient norm, the largest
# |activation| of the residual stream and its ratio to the median, and the attention on the first token.
# `stability()` finds the loss and gradient-norm spikes (a jump above the rolling median) and the growth
# of the largest activation around each. Here three attention variants, three seeds each, trained from
# scratch for a few steps (the `smoke` preset; `docs/training.md` has 300 steps of the `cpu` preset, where
# no run showed a spike).

# %%
from massive_lens.train import compare_variants

runs = compare_variants(["softmax", "softmax1", "kv_bias"], preset="smoke", seeds=[0, 1, 2],
                        steps=30 if SMALL else 300, progress=False)
stability = runs.stability(window=10)
print(stability.summary())
stability.plot();
