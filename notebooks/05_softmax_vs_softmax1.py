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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/05_softmax_vs_softmax1.ipynb)
#
# # softmax vs softmax1 and friends
#
# Train small models that differ only in their attention (softmax, softmax1 = one extra zero key, a learned
# sink logit, ...) under the same budget, then measure massive activations, sinks, kurtosis and the W8A8
# quantization gap. The comparison means something only if the softmax baseline develops massive
# activations; the summary says whether it did.

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
from massive_lens import compare_variants
from massive_lens.viz import overlay_profiles

variants = ['softmax', 'softmax1'] + ([] if SMALL else ['learned_sink', 'gated'])
result = compare_variants(variants, preset='smoke', seeds=[0], steps=10 if SMALL else 300)
print(result.summary())
result.to_frame()

# %%
result.plot();

# %%
overlay_profiles(result.profiles, title='block-output magnitude per variant');

# %% [markdown]
# The CI-sized `smoke` preset is far too small for massive activations to emerge. Larger budgets:
#
# - `cpu` preset (about 20 minutes on 2 cores): `compare_variants(variants, preset='cpu', out_dir='runs/cpu')`;
# - the GPT-2-scale GPU preset on FineWeb-Edu (needs network and the `datasets` extra), resumable and
#   data-parallel:
#
# ```python
# from massive_lens.train import compare_main
# print(compare_main(preset='gpu-gpt2', variants='softmax,softmax1', out_dir='runs/gpt2'))
# ```
#
# Saved as a script, the same call runs data-parallel with `torchrun --nproc_per_node=8 script.py`; an
# interrupted run resumes from `out_dir`.
