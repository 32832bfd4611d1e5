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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/11_sink_tasks.ipynb)
#
# # The off-switch question on a task that forces a sink
#
# On ordinary text at laptop scale a small softmax model grows no first-token sink, so attention
# variants look alike. On a task where a head *must* do nothing most of the time, it does: Ran-Milo's
# trigger-conditional task asks the model to copy a value only after a trigger token. A softmax head
# has no way to attend to nothing, so it parks its attention on the first token: a sink. Does an
# off-switch (softmax1, a learned sink logit, ReLU attention, ...) avoid it, at equal accuracy?
#
# `docs/sinktasks.md` answers it with 5 seeds per setting and paired intervals; here we train one
# seed of three settings and look at what each run records.

# %%
import os
import subprocess
import sys

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # install massive_lens
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "massive-lens @ git+https://github.com/massive-lens/massive_lens"], check=True)
SMALL = os.environ.get("MASSIVE_LENS_SMALL") == "1"  # tiny settings for CI

print('small:', SMALL)

# %% [markdown]
# ## 1. The task
#
# A sequence starts with BOS; a trigger token is followed by the value the model must copy at the
# next trigger; every other position is noise. `sample` draws a batch from a seed and a step, so two
# runs with the same seed see the same batches.

# %%
from massive_lens.train import TaskSettings, make_task, train_task

task = make_task("trigger_conditional")
batch = task.sample(2, seed=0, step=0)
print("vocabulary:", task.n_tokens, "| sequence length:", task.seq_len)
print(batch.tokens[:, :24])

# %% [markdown]
# ## 2. Three runs: softmax, softmax1 and ReLU attention
#
# Each run evaluates a fixed held-out batch every `eval_every` steps and records per head the
# attention on the first token (`sink_mass`), and per step the largest head's, the task accuracy and
# the first token's residual top-1/median. `sink_step` is the first evaluation where the sink mass
# passes the package's sink threshold (0.3). About 40 s per run of 600 steps on one CPU thread.

# %%
steps = 120 if SMALL else 600
runs = {}
for variant in ("softmax", "softmax1", "relu"):
    settings = TaskSettings.of("trigger_conditional", variant=variant, seed=0, steps=steps, eval_every=20)
    runs[variant] = train_task(settings)
    r = runs[variant].result
    print(f"{variant:9s} accuracy {r['accuracy']:.3f}  sink mass {r['sink_mass']:.3f}  "
          f"sink step {r['sink_step']}  resid top-1/median {r['resid_ratio']:.2f}")

# %% [markdown]
# The sink mass of the largest head against the training steps:

# %%
curves = None
for variant, run in runs.items():  # one column per run, indexed by step
    column = run.evals.set_index("step")[["sink_mass"]].rename(columns={"sink_mass": variant})
    curves = column if curves is None else curves.join(column)
print(curves.round(3).tail(6))
ax = curves.plot(title="largest head's attention on the first token")
ax.axhline(0.3, color="grey", linestyle=":")
ax.set_xlabel("step");

# %% [markdown]
# ## 3. The trained models are ordinary massive_lens models
#
# A `MassiveLM` exposes TransformerLens's hook names, so every analysis runs on it unchanged. Here
# `sink_attention` on the held-out batch of the softmax run: which heads put their attention on the
# first token.

# %%
from massive_lens import sink_attention

held_out = task.sample(8, seed=-1, step=0).tokens
sinks = sink_attention(runs["softmax"].model, held_out)
print(sinks.summary())

# %% [markdown]
# One seed is an anecdote. On 5 seeds per setting (`docs/sinktasks.md`), softmax forms the sink on
# this task in 5 of 5 seeds, softmax1 and the learned sink logit do not avoid it, and only ReLU
# attention does (sink mass lower by about 0.77, paired interval excluding zero). Reproduce the grid
# with `massive_lens.train.run_grid` (see the page for the command).
