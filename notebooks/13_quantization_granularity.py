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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/13_quantization_granularity.ipynb)
#
# # Quantization damage by granularity, not by sink mass
#
# How much of a low-bit model's damage do the attention sinks cause, and does it depend on how the
# quantizer is scaled? `massive_lens.quant` answers on any model, with the same round-to-nearest
# engine as `quantize_grid`:
#
# 1. the **granularity table**: W8A8 and W4A4 with one scale per tensor, per channel, per token or per
#    group, and `D_sink`, the loss gap minus the gap with the sinks kept in full precision (paired
#    over sequences, with a 95% interval); a setting above 10x the reference perplexity is flagged
#    destroyed and left out of the ratios;
# 2. the **fragile tensors**: per quantized tensor, its row and column dispersion and the share of its
#    values that round to zero;
# 3. the **fewest modules to keep in full precision** to come within 5% of the reference perplexity;
# 4. **is sink mass a predictor?** Per layer, the rank correlation of sink mass and of dispersion with
#    the damage of quantizing that layer alone.
#
# `docs/quantization.md` has the full runs on SmolLM2-135M-Instruct and Qwen2.5-Coder-1.5B-Instruct.

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

# %%
from massive_lens import load_model, quant

model = load_model()  # SmolLM2-135M-Instruct
text = ("The history of the city goes back to a small fishing village on the river. Over the centuries "
        "it grew into a trading town, then an industrial centre with mills, docks and a railway. ") * 40
options = dict(seq_len=32 if SMALL else 128, n_seqs=2 if SMALL else 4)

# %% [markdown]
# ## 1. The granularity table and `D_sink`
#
# Each setting runs twice: everything quantized, and the sink tokens kept in full precision (KVSink).
# `D_sink` is the per-sequence difference of the two losses, averaged with a bootstrap interval.

# %%
if SMALL:
    table = quant.granularity_table(model, text, bases=["W8A8"], granularities=["tensor", "token"], extra=[],
                                    **options)
else:
    table = quant.granularity_table(model, text, **options)
print(table.summary())
table.plot();

# %%
table.to_frame()[["setting", "weight_granularity", "activation_granularity", "gap", "ppl_ratio", "destroyed",
                  "d_sink", "d_sink_low", "d_sink_high"]]

# %% [markdown]
# ## 2. Which tensors are fragile
#
# `measure_outliers` now reports, per quantized tensor (a weight, or a linear layer's input), the row
# and column dispersion (largest over median of the rows' or columns' absolute maxima) and the
# underflow (share of nonzero values that round to zero at the W8A8 scale).

# %%
outliers = quant.measure_outliers(model, text, per_channel=False, **options)
print(outliers.summary())
outliers.worst_tensors(5)

# %% [markdown]
# ## 3. The fewest modules to keep in full precision
#
# Modules are ranked by their own relative output error with everything quantized; the search keeps
# a growing prefix of that ranking in full precision until the perplexity is within 5% of the
# reference, and narrows the last step by bisection.

# %%
search = quant.fewest_float16(model, text, setting="W8A8@tensor", target=1.05, **options)
print(search.summary())
search.plot();

# %% [markdown]
# ## 4. Is sink mass a predictor of damage?
#
# Per layer: sink mass, dispersion, underflow, and the loss gap when only that layer is quantized
# (static per-tensor W8A8); Spearman's rank correlation with a 95% interval.

# %%
if not SMALL:
    predictor = quant.sink_predictor(model, text, **options)
    print(predictor.summary())
    predictor.plot();
