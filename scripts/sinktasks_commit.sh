#!/usr/bin/env bash
# Commit the finished sink-task runs (folders holding result.json) and the pages regenerated from them:
# docs/sinktasks/runs -> docs/sinktasks.md, docs/sinktasks/long -> docs/sinktasks_long.md.
#   scripts/sinktasks_commit.sh            (from the repository root)
# Only these paths are staged; a run still training (no result.json yet) is left for the next commit.
# A page is generated from the raw records (evals.parquet, heads.parquet), never from result.json's
# stored summaries; refresh keeps those in step with the current definitions.
set -euo pipefail
paths=()
for pair in "docs/sinktasks/runs:docs/sinktasks.md" "docs/sinktasks/long:docs/sinktasks_long.md"; do
    root=${pair%%:*}; page=${pair#*:}
    compgen -G "$root/*/*/seed*/result.json" > /dev/null || continue
    for r in "$root"/*/*/seed*/result.json; do
        d=$(dirname "$r"); paths+=("$d/result.json" "$d/evals.parquet" "$d/heads.parquet")
    done
    # records written with older definitions: derived fields rewritten from their raw records first
    .venv/bin/python -m massive_lens.train.taskcli refresh --root "$root"
    .venv/bin/python -m massive_lens.train.taskcli page --root "$root" --page "$page"
    paths+=("$page" "${page%.md}/curves.png")
done
git add -- "${paths[@]}"
git commit -q -m "docs/sinktasks: the finished runs so far ($(( ${#paths[@]} / 3 )) run files x3) and the pages regenerated from them" \
    -- "${paths[@]}" || echo "nothing to commit"
