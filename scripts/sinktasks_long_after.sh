#!/usr/bin/env bash
# Wait for the main sink-task grid (its process id as $1) to end, then run the longer bigram_backcopy
# phase into docs/sinktasks/long (one thread; rerunning this script resumes it: finished runs are skipped).
#   nohup scripts/sinktasks_long_after.sh <pid> > runs/sinktasks-long.log 2>&1 &
while kill -0 "$1" 2> /dev/null; do sleep 20; done
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec nice -n 10 .venv/bin/python -m massive_lens.train.taskcli run --root docs/sinktasks/long \
    --tasks bigram_backcopy --steps 2000 --eval-every 100 --seeds 0,1 \
    --settings softmax-pre,softmax1-pre,vscale-pre,softmax-post
