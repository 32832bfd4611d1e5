#!/usr/bin/env bash
# The retrofit runs behind docs/retrofit.md: one job per (setting, seed), taken from one shared queue
# by every process that runs this script (a job is claimed with an atomic mkdir under runs/claims/).
#   nohup nice -n 15 scripts/retrofit_runs.sh &     (twice, for two processes)
# Queue order, so that a partial result still has 3 seeds where it matters most: the core pair
# (softmax-removed, softmax1-removed) for seeds 0, 1, 2; then the other off-switches and the
# untouched control; then the -held settings; seed-major inside each group.
# Each job writes docs/retrofit/seeds/<setting>_seed<s>/ (result, CSVs, figures, run.log), saves its
# fine-tuned model to runs/retrofit_models/<setting>_seed<s>/ (safetensors; git-ignored), then
# scripts/retrofit_lowbit.py measures the saved model (W8A8 gap, kurtosis, low-bit grid). At the end
# every saved but unmeasured model is measured. Restartable: remove runs/claims/<job> to redo a job.
set -u
steps=${STEPS:-24}
py=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p runs/claims
groups=("softmax-removed softmax1-removed" "kv_bias-removed learned_sink-removed softmax-kept"
        "softmax-removed-held softmax1-removed-held")
for group in "${groups[@]}"; do
  for seed in ${SEEDS:-0 1 2}; do
    for s in $group; do
      job="${s}_seed${seed}"
      mkdir runs/claims/$job 2>/dev/null || continue
      mkdir -p docs/retrofit/seeds/$job
      $py -m massive_lens.train.retrofit_cli --settings "$s" --seeds "$seed" --steps "$steps" \
        --batch-size 4 --seq-len 128 --lr 2e-4 --warmup-steps 2 --eval-every 6 --eval-seqs 4 --no-measure \
        --out-dir docs/retrofit/seeds/$job --save-models runs/retrofit_models \
        > docs/retrofit/seeds/$job/run.log 2>&1
      if [[ -f runs/retrofit_models/$job/retrofit.json ]] && mkdir runs/claims/lowbit_$job 2>/dev/null; then
        $py scripts/retrofit_lowbit.py "$job" > docs/retrofit/seeds/$job/lowbit.log 2>&1
      fi
    done
  done
done
for model in runs/retrofit_models/*/retrofit.json; do
  [[ -f $model ]] || continue
  job=$(basename "$(dirname "$model")")
  if mkdir runs/claims/lowbit_$job 2>/dev/null; then
    $py scripts/retrofit_lowbit.py "$job" > docs/retrofit/seeds/$job/lowbit.log 2>&1
  fi
done
