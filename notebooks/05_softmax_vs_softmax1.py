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

# %% [markdown]
# ## Where the baseline *must* form a sink (issue 39)
#
# On text at this scale softmax grows no sink, so the variants above look alike. The two tasks of
# `massive_lens.train.tasks` force one: in `trigger_conditional` (Ran-Milo 2026) the model outputs the
# average of the preceding values at a trigger token and zero everywhere else, so a softmax head that
# averages must park its weight somewhere harmless the rest of the time; in `bigram_backcopy` (Guo et
# al. 2024) a head copies the token before a trigger and is dormant elsewhere. Each run records, at
# every evaluation step, the first-token sink mass per head, the first token's residual peak, its
# value norm, the largest attention logit and the task accuracy.

# %%
from massive_lens.train import TaskSettings, train_task

small = dict(steps=20, eval_every=5, eval_seqs=8, batch_size=8, d_model=32, task_options=dict(seq_len=16))
full = dict(steps=300, eval_every=20)  # the grid's trigger_conditional budget: about 40 s a run on one thread
runs = {variant: train_task(TaskSettings.of('trigger_conditional', variant=variant, **(small if SMALL else full)))
        for variant in ['softmax', 'softmax1', 'relu']}
for variant, run in runs.items():
    r = run.result
    print(f"{variant:9s} accuracy {r['accuracy']:.2f}  sink mass {r['sink_mass']:.2f}  "
          f"residual top-1/median {r['resid_ratio']:.1f}  W4A4 gap {r['w4a4_gap']:+.4f}")

# %% [markdown]
# ## The answer, from the grid
#
# The grid trains both tasks under softmax, softmax1, the learned sink, kv_bias, gated, ReLU and
# V-scale (pre-norm) and softmax / softmax1 with post-norm, five seeds each (`python -m
# massive_lens.train.taskcli run`); `task_answer` states only the paired differences whose 95% interval
# over seeds excludes zero. Here it reads the committed runs of `docs/sinktasks/runs` when the notebook
# runs inside the repository, and otherwise (and in CI) a two-seed miniature grid trained now.

# %%
import tempfile
from pathlib import Path

from massive_lens.train import grid_settings, run_grid, task_answer

committed = next((p / 'docs/sinktasks/runs' for p in [Path.cwd(), *Path.cwd().parents]
                  if (p / 'docs/sinktasks/runs').is_dir()), None)
if committed is None or SMALL:
    committed = Path(tempfile.mkdtemp()) / 'runs'
    mini = grid_settings(seeds=[0, 1], tasks=['trigger_conditional', 'bigram_backcopy'],
                         settings=[('softmax', 'pre'), ('relu', 'pre')], **(small if SMALL else {}))
    run_grid(committed, mini, threads=None)
print(task_answer(committed))
