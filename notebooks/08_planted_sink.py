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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/massive-lens/massive_lens/blob/main/notebooks/08_planted_sink.ipynb)
#
# # A planted sink: from the plant to the census to the circuit
#
# Under the causal mask the first token is the one position that attends only to itself, in every
# layer. Is that what makes it the sink? `force_self_attention(model, pos, layers)` makes a later
# position `pos` attend only to itself in the chosen layers, and we ask every sink analysis whether it
# sees a new sink there: the census (does it name `pos`, at which level?), `find_massive` and
# `trace_origin` (does a massive activation form at `pos`, and where is it born?), and the split of the
# sink logit at `pos` (which writer draws the attention?). A planted sink is a known answer for all of
# them. `docs/planted_sink.md` has the full run on WikiText-2 for SmolLM2-135M and Qwen2.5-Coder-1.5B.

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
# The model and the text: the default model (SmolLM2-135M-Instruct) and a few pieces of the offline
# default text, each long enough to have 100 tokens after the planted position.

# %%
from massive_lens import default_text, find_massive, load_model, sink_census, trace_origin
from massive_lens.interventions import force_self_attention, planted_writers, shift_rotary_position, sink_strength

model = load_model()
text = default_text()
n_texts = 2 if SMALL else 4
texts = [text[i * 700: (i + 1) * 700] for i in range(n_texts)]
POS = 32

# %% [markdown]
# ## 1. Where the model's own sink is born
#
# `find_massive` on the untouched model: the first token's massive activation and the first layer it is
# massive at. Planting in the layers up to there ("early") is what should matter.

# %%
found = find_massive(model, texts)
print(found.summary())
frame = found.to_frame()
birth = int(frame[frame["pos"] == 0]["layer"].min())
early = list(range(birth + 1))
print(f"first token massive from layer {birth}: early layers 0-{birth}")

# %% [markdown]
# ## 2. The plant, and the census
#
# The census of the untouched model and of the model with position 32 attending only to itself in the
# early layers. The plant edits the attention scores, so the census reads the eager pattern
# (`attention="eager"`). Untouched, position 32 is an ordinary token; planted, the census should name it.

# %%
before = sink_census(model, texts, attention="eager").to_frame()
with force_self_attention(model, POS, early):
    after = sink_census(model, texts, attention="eager").to_frame()
columns = ["seq", "pos", "token", "level", "first_layer", "last_layer", "peak_mass", "mlp_layer", "in_rule"]
print("untouched, rows at pos 32:", len(before[before["pos"] == POS]))
print(after[after["pos"].isin([0, POS])][columns].to_string(index=False))

# %% [markdown]
# How strong is the planted sink? `sink_strength` applies Gu et al.'s sink metric to a position: per
# sequence, the share of all heads (every layer) whose mean attention to it, over the up to 64 queries
# after it, exceeds 0.3. For the first token and for position 32, untouched, and planted in the early
# layers, in the late layers, and in every layer.

# %%
untouched = sink_strength(model, texts, pos=[0, POS]).groupby("pos")["strength"].mean()
print(f"untouched: first token {untouched[0]:.3f}, pos 32 {untouched[POS]:.3f}")
late = list(range(birth + 1, model.cfg.n_layers))
for label, layers in (("the early layers", early), ("the late layers", late), ("every layer", None)):
    with force_self_attention(model, POS, layers):
        planted = sink_strength(model, texts, pos=POS)["strength"].mean()
    print(f"planted in {label}: pos 32 {planted:.3f} ({planted / untouched[0]:.0%} of the first token's)")

# %% [markdown]
# ## 3. The massive activation at the planted position, and its birth
#
# `find_massive` under the plant: massive dims at position 32. `trace_origin` then gives the ledger of
# the largest one at position 32 of the first text: which component writes it, and where it is born.

# %%
with force_self_attention(model, POS, early):
    planted_found = find_massive(model, texts).to_frame()
    at_pos = planted_found[(planted_found["pos"] == POS) & (planted_found["seq"] == 0)]
    print(at_pos.groupby("dim")["layer"].agg(["min", "max"]))
    dim = int(at_pos.sort_values("value", key=abs, ascending=False)["dim"].iloc[0])
    trace = trace_origin(model, texts[0], pos=POS, dim=dim)
print(trace.summary())

# %% [markdown]
# ## 4. The circuit: which writer draws the attention to the planted sink?
#
# `planted_writers` splits each sink head's attention logit on position 32 into its writers (the exact
# split of `sink_circuit`, read at position 32): the embedding, each attention output, each MLP output.
# If the plant works as the first token does, the dominant writer is the MLP where the tracer saw the
# massive activation born. Shares are of the mean logit, so a head whose mean logit on position 32 is
# near zero shows large shares of both signs: read them with the `logit` column.

# %%
with force_self_attention(model, POS, early):
    writers = planted_writers(model, texts, pos=POS)
print(writers[["layer", "head", "sink_mass", "logit", "dominant", "dominant_share", "runner_up", "runner_up_share"]]
      .to_string(index=False))

# %% [markdown]
# ## 5. The other explanation: the first token's rotary position
#
# Give the first token the rotary position 8 instead of 0 (nothing else changes; the same as passing
# `position_ids` to the model) and measure its sink strength again. If position carried the sink, it
# would move.

# %%
with shift_rotary_position(model, 0, 8):
    moved = sink_strength(model, texts, pos=0)["strength"].mean()
print(f"first token's sink strength: {untouched[0]:.3f} at rotary position 0, {moved:.3f} at rotary position 8 "
      f"({moved / untouched[0] - 1:+.1%})")
