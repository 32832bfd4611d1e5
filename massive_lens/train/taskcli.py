"""``massive-lens tasks`` (also ``python -m massive_lens.train.taskcli``): run the sink-task grid (resuming)
and write its answer page.

    massive-lens tasks run --seeds 0,1,2,3,4                     # the grid into runs/sinktasks (the default --root)
    # the documentation's grid and page, named on purpose (no command writes into docs/ by default)
    python -m massive_lens.train.taskcli run  --root docs/sinktasks/runs --seeds 0,1,2,3,4
    python -m massive_lens.train.taskcli page --root docs/sinktasks/runs --page docs/sinktasks.md
    python -m massive_lens.train.taskcli page --root docs/sinktasks/runs --page docs/sinktasks.md --check  # 1: differs
    # a longer bigram_backcopy budget, a few settings, in its own folder and page
    python -m massive_lens.train.taskcli run --root docs/sinktasks/long --tasks bigram_backcopy \
        --settings softmax-pre,relu-pre --steps 2000 --eval-every 100 --seeds 0,1
    python -m massive_lens.train.taskcli page --root docs/sinktasks/long --page docs/sinktasks_long.md
    python -m massive_lens.train.taskcli refresh --root docs/sinktasks/runs   # stale records rewritten

``run`` trains every unfinished run of :func:`massive_lens.train.taskgrid.grid_settings` on one thread
(skipping runs whose ``result.json`` exists, so the same command resumes an interrupted grid); ``page``
regenerates the page from whatever runs have finished (:mod:`massive_lens.train.taskpage`), every
derived value recomputed from the runs' raw records; ``refresh`` rewrites the stored derived fields of
every finished run from its raw records with the current definitions
(:func:`massive_lens.train.taskrecord.refresh_runs`). Bad input, an unusable folder or a damaged run
prints one line and exits 2; Ctrl-C prints one line and exits 130.

>>> main(["page", "--root", "no/such/folder", "--page", "no/such/page.md"])
2
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from massive_lens.errors import MassiveLensError
from massive_lens.train.taskgrid import DEFAULT_ROOT, SETTINGS, TASK_SETTINGS, grid_settings, run_grid
from massive_lens.train.taskpage import write_page
from massive_lens.train.taskrecord import refresh_runs

log = logging.getLogger(__name__)
ACTIONS = ("run", "page", "refresh")
HELP = "train the sink-forcing tasks under every attention variant and norm placement, and write the answer page"


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise MassiveLensError(f"--seeds takes comma-separated whole numbers, e.g. 0,1,2; got {text!r}") from exc
    if not seeds or min(seeds) < 0:
        raise MassiveLensError(f"--seeds needs at least one seed, none negative; got {text!r}")
    return seeds


def _settings(text: str | None) -> list[tuple[str, str]]:
    if text is None:
        return list(SETTINGS)
    pairs = [tuple(s.strip().rsplit("-", 1)) for s in text.split(",") if s.strip()]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise MassiveLensError(f"--settings takes comma-separated <variant>-<norm>, e.g. softmax-pre,relu-post; "
                               f"got {text!r}")
    return pairs


def _grid(args: argparse.Namespace) -> list:
    tasks = list(TASK_SETTINGS) if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    overrides = {k: v for k, v in (("steps", args.steps), ("eval_every", args.eval_every)) if v is not None}
    return grid_settings(_seeds(args.seeds), tasks=tasks, settings=_settings(args.settings), **overrides)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sink-task options to ``parser`` (``massive-lens tasks`` and this module's own command)."""
    parser.add_argument("action", choices=ACTIONS, help="run the grid (resuming), write its page, or refresh the "
                        "stored derived fields of its records")
    parser.add_argument("--root", default=DEFAULT_ROOT, help=f"the run folders (default {DEFAULT_ROOT})")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="run: comma-separated seeds (default 0-4)")
    parser.add_argument("--threads", type=int, default=1, help="run: torch threads (default 1)")
    parser.add_argument("--tasks", default=None, help="run: comma-separated tasks (default all of the grid's)")
    parser.add_argument("--settings", default=None,
                        help="run: comma-separated <variant>-<norm> (default the grid's nine)")
    parser.add_argument("--steps", type=int, default=None, help="run: training steps (default each task's)")
    parser.add_argument("--eval-every", type=int, default=None, help="run: steps between evaluations")
    parser.add_argument("--page", default=None, help="page: the answer page to rewrite (e.g. docs/sinktasks.md)")
    parser.add_argument("--check", action="store_true", help="page: write nothing, exit 1 if the page differs")


def cmd_tasks(args: argparse.Namespace) -> int:
    """Do ``args.action``; the exit code (``page --check``: 1 if the page differs).

    Raises:
        MassiveLensError: for bad options, an unusable folder or a damaged run.
    """
    if args.action == "run":
        run_grid(args.root, _grid(args), threads=args.threads)
        return 0
    if args.action == "refresh":
        log.info("%d run(s) rewritten", refresh_runs(args.root))
        return 0
    if args.page is None:
        raise MassiveLensError("page needs --page, the Markdown page whose <!-- gen:answer --> and <!-- gen:ends --> "
                               "blocks it rewrites (e.g. --page docs/sinktasks.md)")
    return write_page(args.root, args.page, check=args.check)


def main(argv: Sequence[str] | None = None) -> int:
    """``run`` the grid, write (``--check``: compare) the page or ``refresh`` the records; 2 on bad input,
    with the reason; 130 on Ctrl-C, in one line."""
    parser = argparse.ArgumentParser(prog="python -m massive_lens.train.taskcli", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        return cmd_tasks(args)
    except MassiveLensError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's code for SIGINT, as massive-lens prints
        print(f"taskcli {args.action}: interrupted (finished runs are kept; the same command resumes)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
