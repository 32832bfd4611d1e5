#!/usr/bin/env bash
# Commit the finished sink-task runs (folders holding result.json) and the regenerated answer page.
#   scripts/sinktasks_commit.sh            (from the repository root)
# Only these paths are staged; a run still training (no result.json yet) is left for the next commit.
set -euo pipefail
root=docs/sinktasks/runs
mapfile -t files < <(for r in "$root"/*/*/seed*/result.json; do d=$(dirname "$r"); \
    echo "$d/result.json"; echo "$d/evals.parquet"; echo "$d/heads.parquet"; done)
.venv/bin/python -m massive_lens.train.taskcli page --root "$root"
paths=("${files[@]}" docs/sinktasks.md docs/sinktasks/curves.png)
git add -- "${paths[@]}"
git commit -q -m "docs/sinktasks: $(ls -d "$root"/*/*/seed*/ | wc -l) run folders so far (${#files[@]} files) and the page regenerated from them" -- "${paths[@]}" || echo "nothing to commit"
