"""The report's memory watch names the live tensors from the main thread only: a walk of
``gc.get_objects()`` from its own thread held a tuple the main thread was building, and CPython failed
that tuple's resize (``SystemError: bad argument to internal function``: a fresh-clone run's default
report died of it inside ``register_forward_hook``)."""

from __future__ import annotations

import threading
import time

import torch

from massive_lens.report import memory
from massive_lens.report.memory import SectionPeaks, _Watch


def _build_tuples(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        tuple(x for x in range(200))  # a tuple of unknown length, resized when done
        n += 1
    return n


def test_walking_the_live_tensors_never_breaks_a_tuple_being_built():
    """Every poll asks for a walk (``step=-1``): the thread walk failed here within 0.25 s (3 of 3
    runs); the main thread's walk runs between bytecodes, so two seconds of it pass."""
    keep = torch.zeros(50_000)
    watch = _Watch(set(), step=-1, interval=0.0005)
    watch.start()
    try:
        built = _build_tuples(2.0)
    finally:
        watch.stop.set()
        watch.join()
    assert built > 0
    assert any(size >= keep.nbytes for size, _ in watch.top), watch.top  # the walks ran and saw it


def test_a_watch_started_off_the_main_thread_names_no_tensors():
    """Off the main thread nothing would run the walk in time: the watch keeps only the sizes."""
    seen = {}

    def block() -> None:
        watch = _Watch(set(), step=-1, interval=0.0005)
        watch.start()
        _ = torch.zeros(50_000)
        time.sleep(0.05)
        watch.stop.set()
        watch.join()
        seen.update(names=watch.names, top=watch.top, most=watch.most)

    worker = threading.Thread(target=block)
    worker.start()
    worker.join()
    assert seen == {"names": False, "top": [], "most": seen["most"]} and seen["most"] > 0


def test_a_section_tracked_off_the_main_thread_says_its_tensors_were_not_looked_for():
    """The row says so rather than "none seen"."""
    peaks = SectionPeaks(base=0)

    def block() -> None:
        with peaks.track("off"):
            _ = torch.zeros(50_000)

    worker = threading.Thread(target=block)
    worker.start()
    worker.join()
    assert "not looked for" in peaks.line()


def test_a_watch_that_grows_during_its_walk_is_walked_once(monkeypatch):
    """The watching thread queues a watch only while it is not queued; a watch taken off the queue
    before its walk was queued again during it (its resident size grew), and the walks ran back to
    back (13-20 s of the main thread late in a test process). Here the thread's re-queue is played
    inside the walk: one walk, and the queue left empty."""
    watch, walks = _Watch(set(), step=0), []

    def walk(exclude: set[int], n: int = 3) -> list[tuple[int, str]]:
        walks.append(1)
        if watch not in memory._WAITING and len(walks) < 5:  # what _Watch.run does on growth
            memory._WAITING.add(watch)
        return []

    monkeypatch.setattr(memory, "largest_tensors", walk)
    memory._WAITING.add(watch)
    memory._walk_waiting(None)
    assert len(walks) == 1 and not memory._WAITING
