# The shared part of the prepared GPU runs (benchmarks/gpu.sh, benchmarks/offswitch_gpu.sh), sourced
# by each after it sets OUT (its results folder, relative to the repository root) and DRY (1: a CPU
# dry run; DRY_NOTE says what its numbers mean). It moves to the repository root, makes OUT, sets PY
# (PYTHON, default python3), PYTHONPATH and offline Hugging Face, writes OUT/env.txt (date, GPU, torch)
# and the header of OUT/steps.tsv, and defines
#   step NAME LIMIT_S COMMAND...  run COMMAND under a time limit into OUT/NAME.log and record its exit
#                                 code and seconds in OUT/steps.tsv (a failed step does not stop the run)
#   finish                        say where the results are; the script's last command: exit 1 when any
#                                 step failed
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
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

finish() {  # the results' folder; exit status 1 when any step failed
    echo "results: $OUT"
    ! grep -qv -P '\t0\t|^step\t' "$OUT/steps.tsv"
}

{
    date -u +%FT%TZ
    [ "$DRY" = 1 ] && echo "${DRY_NOTE:-dry run (CPU)}: the numbers measure nothing"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} > "$OUT/env.txt" 2>&1
