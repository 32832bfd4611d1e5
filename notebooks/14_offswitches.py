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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/14_offswitches.ipynb)
#
# # Off-switches that ship: learned sink logits, output gates, hybrids
#
# An attention head with nothing to do must put its softmax weight somewhere; plain softmax heads
# park it on the first token. gpt-oss gives every head a **learned sink logit** (one extra logit
# with a zero value), Qwen3-Next and Qwen3.5 an **output gate**. This notebook reads both on tiny
# models, runs the off-switch protocol (null or gate mass, first-token mass, the residual peak, the
# float16 verdict side by side), and asks a trained `softmax1` / `learned_sink` model where its
# "do nothing" attention goes. `docs/offswitch.md` has the full runs.

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # install massive_lens; everything below runs offline on tiny models
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "massive-lens @ git+https://github.com/massive-lens/massive_lens"], check=True)
SMALL = os.environ.get("MASSIVE_LENS_SMALL") == "1"  # tiny settings for CI

print('small:', SMALL)

# %% [markdown]
# ## 1. Null mass on a tiny gpt-oss
#
# `null_mass` reports, per layer and head, the attention that goes to the sink logit
# (`exp(s - LSE')`, the sink's logit in the normaliser) beside the first-token mass over the same
# queries. It reads it two ways: from the fused kernel's log-sum-exp with the sink logit folded in
# (`attention="lse"`, no pattern built) and from the eager pattern, whose keys' weights miss exactly
# the null mass. The two agree.

# %%
from massive_lens import tiny_model
from massive_lens.attention import gate_census, null_mass

model = tiny_model("gpt_oss")
text = "The quick brown fox jumps over the lazy dog. It was a sunny day, and then it rained."
lse, eager = null_mass(model, text, attention="lse"), null_mass(model, text, attention="eager")
print(lse.summary())
print(lse.to_frame().head(8).to_string())
print("largest difference between the paths:",
      float((lse.to_frame().null_mass - eager.to_frame().null_mass).abs().max()))

# %% [markdown]
# The random sink logits sit near zero, so the slot gets little. Raise them and the heads switch
# off through the slot: the null mass rises, the first token loses what it had.

# %%
for module in model.original_model.modules():
    if hasattr(module, "sinks"):
        module.sinks.data.fill_(4.0)
high = null_mass(model, text)
print(high.summary())

# %% [markdown]
# ## 2. Output gates on a tiny Qwen3-Next
#
# Qwen3-Next's full-attention layers multiply each head's output, element by element, by
# `sigmoid(g)`, `g` computed by `q_proj` beside the query. `gate_census` counts the gates below 0.05
# (shut) per layer and head, and lists where each head's gate is widest open. Its linear-attention
# layers have no softmax and no gate.

# %%
hybrid = tiny_model("qwen3_next")
census = gate_census(hybrid, text)
print(census.summary())
print(census.to_frame().to_string())

# %% [markdown]
# ## 3. The protocol, side by side
#
# `offswitch` puts per layer: the off-switch's own mass (null mass or shut gates), the first-token
# mass, the residual peak (is it one dimension on a few tokens, a massive activation, or broad
# growth: its share of the token's norm and how many tokens and dims pass the rule), whether the
# layer is full attention (a hybrid's spike right before it), and the float16 verdict, which names
# the first site past float16's range.

# %%
from massive_lens.handover import offswitch

for m in (model, hybrid):
    result = offswitch(m, text, precision=not SMALL)
    print(result.summary())
    print(result.to_frame()[["layer", "full_attention", "null_mass", "gate_shut", "first_mass", "peak",
                             "top1_share", "massive_tokens"]].to_string(), "\n")

# %% [markdown]
# ## 4. Trained off-switches: sink slot or first token?
#
# On the trigger-conditional task a head must do nothing at most positions. Train a `softmax1` and a
# `learned_sink` model on it (the sink-task page's setting, 300 steps; a few steps with
# `MASSIVE_LENS_SMALL=1`), then ask the protocol where their idle attention goes. On the page's 25
# runs (5 seeds each) the answer was the first token in every seed (`docs/sinktasks.md`).

# %%
from massive_lens.train import TaskSettings, offswitch_task_runs, train_task, where_table

root = Path(tempfile.mkdtemp()) / "trigger_conditional"
steps = 10 if SMALL else 300
for variant in ("softmax1", "learned_sink"):
    settings = TaskSettings.of("trigger_conditional", variant=variant, steps=steps, eval_every=max(1, steps // 5),
                               task_options=dict(seq_len=32))
    train_task(settings, root / settings.name / "seed0")
runs = offswitch_task_runs(root, variants=["softmax1", "learned_sink"], cache=root.parent / "models")
print(where_table(runs))
