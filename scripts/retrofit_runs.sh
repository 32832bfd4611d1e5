#!/usr/bin/env bash
# The retrofit runs behind docs/retrofit.md: 7 settings x 3 seeds, one job per (setting, seed),
# seed-major (every setting of seed 0 first), split over PARTS processes by job index.
#   scripts/retrofit_runs.sh PART PARTS   (e.g. 0 2 and 1 2 in two processes)
# Each job writes docs/retrofit/seeds/<setting>_seed<s>/ (result, CSVs, figures, run.log) and saves
# its fine-tuned model to runs/retrofit_models/<setting>_seed<s>/ (safetensors; git-ignored).
# Then scripts/retrofit_lowbit.py measures the saved model (W8A8 gap, kurtosis, low-bit grid).
# A job whose model is already saved (or measured) is skipped, so the script can be restarted.
set -u
part=${1:-0}; parts=${2:-1}
steps=${STEPS:-24}
py=${PY:-.venv/bin/python}
settings="softmax-kept softmax-removed softmax1-removed kv_bias-removed learned_sink-removed softmax-removed-held softmax1-removed-held"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
i=0
for seed in ${SEEDS:-0 1 2}; do
  for s in $settings; do
    if (( i % parts == part )); then
      job="${s}_seed${seed}"
      if [[ ! -f runs/retrofit_models/$job/model.safetensors ]]; then
        mkdir -p docs/retrofit/seeds/$job
        $py -m massive_lens.train.retrofit_cli --settings "$s" --seeds "$seed" --steps "$steps" \
          --batch-size 4 --seq-len 128 --lr 2e-4 --warmup-steps 2 --eval-every 6 --eval-seqs 4 --no-measure \
          --out-dir docs/retrofit/seeds/$job --save-models runs/retrofit_models \
          > docs/retrofit/seeds/$job/run.log 2>&1
      fi
      # the end-of-run measurements on the saved model (W8A8 and kurtosis, the low-bit grid)
      if [[ -f runs/retrofit_models/$job/model.safetensors && ! -f docs/retrofit/seeds/$job/lowbit/manifest.json ]]; then
        $py scripts/retrofit_lowbit.py "$job" > docs/retrofit/seeds/$job/lowbit.log 2>&1
      fi
    fi
    i=$((i + 1))
  done
done
