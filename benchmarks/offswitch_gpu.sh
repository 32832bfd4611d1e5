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
PY=${PYTHON:-python3}
GPTOSS=${GPTOSS:-openai/gpt-oss-20b}
GATED=${GATED:-Qwen/Qwen3-Next-80B-A3B-Instruct}
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE" || exit 1
mkdir -p "$OUT"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"

step() {  # step NAME LIMIT_S COMMAND...: run it, log it, record its exit code and time
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/steps.tsv"
    echo "$name: exit $rc after $(( $(date +%s) - start )) s (log: $OUT/$name.log)"
}

{
    date -u +%FT%TZ
    [ "$DRY" = 1 ] && echo "dry run (CPU, tiny random models): the numbers measure nothing"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} > "$OUT/env.txt" 2>&1

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
echo "results: $OUT"
! grep -qv -P '\t0\t|^step\t' "$OUT/steps.tsv"  # exit 1 when any step failed
