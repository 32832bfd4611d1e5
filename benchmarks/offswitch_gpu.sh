#!/usr/bin/env bash
# The off-switch protocol on shipped off-switches (issue 51), prepared for one large GPU, no network.
#
#   benchmarks/offswitch_gpu.sh [OUT]              # on the GPU machine; results in OUT (default runs/offswitch_gpu)
#   benchmarks/offswitch_gpu.sh --dry-run [OUT]    # on a CPU: the same steps on tiny models, in seconds
#
# Steps, each under its own time limit (a failed or timed-out step is written down in OUT/steps.tsv
# and the next one still runs):
#   1. gptoss  massive-lens offswitch on gpt-oss-20b (GPTOSS, default openai/gpt-oss-20b) in bfloat16
#              over the GPU(s) (device_map=auto): null mass on the learned sink logits per layer and
#              head (the LSE path), first-token mass, the residual peak (token-specific or broad
#              growth) and the float16 verdict predicted from the peaks (the model is not float32)
#   2. gated   the same on a gated Qwen (GATED, default Qwen/Qwen3-Next-80B-A3B-Instruct, about
#              160 GB in bfloat16: set GATED to a local Qwen3.5 / Qwen3-Next checkpoint that fits):
#              the share of output gates below 0.05 per layer and head, and the pre-attention spike
#   3. page    OUT/offswitch_gpu.md: both results, one after the other
# The weights must already be in the local Hugging Face cache (HF_HUB_OFFLINE=1). OUT gets env.txt,
# steps.tsv (step, exit code, seconds), one log per step, gptoss.md, gated.md and offswitch_gpu.md.
# PYTHON (default: python3) is the interpreter with massive_lens's dependencies.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-runs/offswitch_gpu}
GPTOSS=${GPTOSS:-openai/gpt-oss-20b}
GATED=${GATED:-Qwen/Qwen3-Next-80B-A3B-Instruct}
DRY_NOTE="dry run (CPU, tiny random models)"
. "$(dirname "$0")/gpu_steps.sh"  # cd to the repository root, PY, env.txt, steps.tsv, step, finish

if [ "$DRY" = 1 ]; then
    step gptoss 120 $PY -m massive_lens.cli offswitch --model tiny:gpt_oss --no-precision --out "$OUT/gptoss.md"
    step gated 120 $PY -m massive_lens.cli offswitch --model tiny:qwen3_next --no-precision --out "$OUT/gated.md"
else
    step gptoss 300 $PY -m massive_lens.cli offswitch --model "$GPTOSS" --dtype bfloat16 --device-map auto \
        --out "$OUT/gptoss.md"
    step gated 240 $PY -m massive_lens.cli offswitch --model "$GATED" --dtype bfloat16 --device-map auto \
        --out "$OUT/gated.md"
fi
step page 10 sh -c "{ echo '# The off-switch protocol on a GPU'; echo; cat '$OUT/env.txt'; echo; \
    cat '$OUT/gptoss.md' '$OUT/gated.md'; } > '$OUT/offswitch_gpu.md'"
finish  # exit 1 when any step failed
