"""``python -m massive_lens.train.taskcli``: run the sink-task grid (resuming) and write its answer page.

    python -m massive_lens.train.taskcli run  --root docs/sinktasks/runs --seeds 0,1,2,3,4
    python -m massive_lens.train.taskcli page --root docs/sinktasks/runs            # docs/sinktasks.md
    python -m massive_lens.train.taskcli page --root docs/sinktasks/runs --check    # exit 1 if it differs

``run`` trains every unfinished run of :func:`massive_lens.train.taskgrid.grid_settings` on one thread
(skipping runs whose ``result.json`` exists, so the same command resumes an interrupted grid); ``page``
regenerates the page from whatever runs have finished (:mod:`massive_lens.train.taskpage`).

>>> main(["page", "--root", "no/such/folder", "--page", "no/such/page.md"])
2
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from massive_lens.errors import MassiveLensError
from massive_lens.train.taskgrid import DEFAULT_ROOT, grid_settings, run_grid
from massive_lens.train.taskpage import write_page

HELP = "train the sink-forcing tasks under every attention variant and norm placement, and write the answer page"


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise MassiveLensError(f"--seeds takes comma-separated whole numbers, e.g. 0,1,2; got {text!r}") from exc
    if not seeds or min(seeds) < 0:
        raise MassiveLensError(f"--seeds needs at least one seed, none negative; got {text!r}")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    """``run`` the grid or write (``--check``: compare) the page; 2 on bad input, with the reason."""
    parser = argparse.ArgumentParser(prog="python -m massive_lens.train.taskcli", description=HELP)
    parser.add_argument("command", choices=["run", "page"])
    parser.add_argument("--root", default=DEFAULT_ROOT, help=f"the run folders (default {DEFAULT_ROOT})")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="run: comma-separated seeds (default 0-4)")
    parser.add_argument("--threads", type=int, default=1, help="run: torch threads (default 1)")
    parser.add_argument("--page", default="docs/sinktasks.md", help="the answer page (default docs/sinktasks.md)")
    parser.add_argument("--check", action="store_true", help="page: write nothing, exit 1 if the page differs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        if args.command == "run":
            run_grid(args.root, grid_settings(_seeds(args.seeds)), threads=args.threads)
            return 0
        return write_page(args.root, args.page, check=args.check)
    except MassiveLensError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
