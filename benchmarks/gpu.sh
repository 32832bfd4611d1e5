#!/usr/bin/env bash
# One GPU run, prepared (issue 28): under 8 minutes on one large GPU, no network.
#
#   benchmarks/gpu.sh [OUT]              # on the GPU machine; results in OUT (default runs/gpu)
#   benchmarks/gpu.sh --dry-run [OUT]    # on a CPU: the same steps at tiny sizes, in seconds
#
# Steps, each under its own time limit (a step that fails or runs out of time is written down
# in OUT/steps.tsv and the next one still runs):
#   1. bench   the benchmark ratios (detect, origin, attention) on both offline models in
#              bfloat16 on the GPU: python -m benchmarks --dtype bfloat16 --device cuda
#   2. big     the Llama-2-7B-shaped bfloat16 model, each analysis's peak GPU memory against
#              its weights: python -m benchmarks.big --device cuda --together (built once)
#   3. scratch softmax vs softmax1 trained from scratch: scripts/gpu_scratch.py train, on the
#              token file shared/pytokens.bin (made from offline text first if missing)
# OUT gets env.txt (GPU, torch), steps.tsv (step, exit code, seconds), one log per step and
# each step's results: bench.md, big.md + big.json, scratch/ (scratch.json, curves.csv, ...).
# PYTHON (default: python3) is the interpreter with massive_lens's dependencies.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-runs/gpu}
DRY_NOTE="dry run (CPU, tiny sizes)"
. "$(dirname "$0")/gpu_steps.sh"  # cd to the repository root, PY, env.txt, steps.tsv, step, finish

if [ "$DRY" = 1 ]; then
    step bench 60 $PY -m benchmarks --models tiny-llama --areas origin --repeats 1 --no-memory \
        --dtype bfloat16 --write "$OUT/bench.md"
    step big 60 sh -c "$PY -m benchmarks.big --shape tiny --device cpu --case find_massive > '$OUT/big.json'"
    step scratch 60 sh -c "$PY -c 'import numpy as np, json, sys; d = sys.argv[1]
(np.arange(20000) % 50).astype(np.uint16).tofile(d + \"/tokens.bin\")
json.dump({\"vocab_size\": 50, \"dtype\": \"uint16\", \"n_tokens\": 20000}, open(d + \"/tokens.json\", \"w\"))' '$OUT' \
        && $PY scripts/gpu_scratch.py train '$OUT/tokens.bin' --out '$OUT/scratch' --budget-s 2 \
           --n-layers 1 --d-model 32 --n-heads 2 --n-ctx 16 --batch 4"
else
    step bench 200 $PY -m benchmarks --models default,qwen2.5-coder-1.5b --areas detect,origin,attention \
        --repeats 3 --no-memory --dtype bfloat16 --device cuda --write "$OUT/bench.md"
    step big 150 sh -c "$PY -m benchmarks.big --device cuda --together --out '$OUT/big.json' > '$OUT/big.md'"
    TOKENS=shared/pytokens.bin
    if [ ! -f "$TOKENS" ]; then  # made from offline text: the installed Python sources and docs
        TOKENS=$OUT/pytokens.bin
        step corpus 60 sh -c "$PY scripts/gpu_scratch.py corpus '$OUT/pycorpus.txt' --max-chars 20000000 \
            && $PY -m massive_lens.cli tokenize '$OUT/pycorpus.txt' '$TOKENS' --tokenizer default"
    fi
    step scratch 150 $PY scripts/gpu_scratch.py train "$TOKENS" --out "$OUT/scratch" --budget-s 100
fi
finish  # exit 1 when any step failed
