"""How much memory the report took, stated in the report itself.

The number that matters to a user is the process's peak resident memory while the report
ran (model included), next to the size of the model's weights: a report that peaks at 1.2x
its model's weights fits wherever the model fits. On Linux the kernel's high-water mark is
reset at the start (``/proc/self/clear_refs``) and read at the end, so the peak is the
report's own, not the model loading's before it; elsewhere the process's lifetime peak
(``resource.getrusage``) is given, and said to be that. On a GPU the peak of allocated
CUDA memory is added.

:class:`SectionPeaks` measures each section of the report: its own resident peak (the high-water mark
where the section raised it, else the largest size sampled) and, from a thread that looks when the
resident size has grown, the largest tensors alive besides the model's weights. A :class:`PeakMemory`
inside another first folds the mark into the outer one, so nesting them loses no peak.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from massive_lens.core.budget import trim_allocator

try:
    import resource  # Unix only
except ImportError:  # Windows: no lifetime peak to report
    resource = None

_STATUS = Path("/proc/self/status")
_ACTIVE: list[PeakMemory] = []  # the measurements in progress, outermost first


def release_free_memory() -> None:
    """Collect garbage and hand the allocator's freed pages back to the system (glibc's
    ``malloc_trim``), so that memory one section freed is not still counted, unused, while
    the next one runs; a no-op where there is no glibc.

    >>> release_free_memory()
    """
    gc.collect()
    trim_allocator()


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


class PeakMemory:
    """Measure the peak resident memory of a block: ``with PeakMemory() as peak: ...``, then
    ``peak.describe(weights)``.

    >>> with PeakMemory() as peak:
    ...     _ = torch.ones(1000)
    >>> peak.peak_bytes > 0
    True
    """

    def __enter__(self) -> PeakMemory:
        self._seen = self.cuda_peak_seen = 0
        self.own_peak = reset_high_water()
        self.start_bytes = (_status_kib("VmRSS") or 0) * 1024
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.own_peak:
            self.peak_bytes = max(self._seen, (_status_kib("VmHWM") or 0) * 1024)
        else:
            scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale if resource else 0
        self.cuda_peak_bytes = max(self.cuda_peak_seen, torch.cuda.max_memory_allocated()) if self.cuda else 0
        for outer in _ACTIVE:  # an inner block reset the CUDA peak: the enclosing ones keep theirs
            outer.cuda_peak_seen = max(outer.cuda_peak_seen, self.cuda_peak_bytes)

    def describe(self, weights: int, loaded_inside: bool | None = False) -> str:
        """The peak in words, against the weights' size; ``loaded_inside``: the model was
        loaded within the block, so the start is the interpreter and its libraries alone
        (False: it was loaded before; None: some models were, some not)."""
        when = "while the report ran" if self.own_peak else "since the process started (its lifetime peak)"
        added = max(self.peak_bytes - self.start_bytes, 0)
        start = {True: "the interpreter and its libraries; loading the model and the analyses added",
                 False: "the model loaded; the analyses added",
                 None: "some models loaded; loading the others and the analyses added"}[loaded_inside]
        text = (f"peak memory {_gb(self.peak_bytes)} resident {when}, model included "
                f"({_gb(self.start_bytes)} at the start: {start} {_gb(added)}, {added / max(weights, 1):.2f}x "
                f"the weights); the model's weights: {_gb(weights)}, so the peak is "
                f"{self.peak_bytes / max(weights, 1):.2f}x the weights")
        if self.cuda_peak_bytes:
            text += f"; peak CUDA memory allocated: {_gb(self.cuda_peak_bytes)}"
        return text


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def reset_high_water() -> bool:
    """Reset the kernel's high-water mark of this process (``/proc/self/clear_refs``) to its current
    resident size, after folding the mark into every :class:`PeakMemory` in progress (so nested
    measurements never lose the outer one's peak); False where the mark cannot be reset."""
    mark = (_status_kib("VmHWM") or 0) * 1024
    for outer in _ACTIVE:
        outer._seen = max(outer._seen, mark)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def largest_tensors(exclude: set[int], n: int = 3) -> list[tuple[int, str]]:
    """The ``n`` largest tensor storages alive (bytes, shape and dtype), those whose storage starts at
    an address in ``exclude`` (the weights) left out; each storage counted once, under its largest view.

    >>> big = torch.zeros(4096)
    >>> largest_tensors(set(), 1)[0][0] >= big.nbytes
    True
    """
    found: dict[int, tuple[int, str]] = {}
    objects = gc.get_objects()
    try:
        for obj in objects:
            if not issubclass(type(obj), torch.Tensor):  # type(): no lazy module's __class__ is read
                continue
            try:
                storage = obj.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):  # meta, sparse or subclass tensors
                continue
            if ptr and ptr not in exclude and size > found.get(ptr, (0, ""))[0]:
                found[ptr] = (size, f"{list(obj.shape)} {str(obj.dtype).replace('torch.', '')}")
    finally:
        del objects
    return sorted(found.values(), key=lambda item: -item[0])[:n]


_WAITING: set[_Watch] = set()  # watches whose walk of the live tensors is queued for the main thread


def _walk_waiting(_: Any) -> int:
    """The queued walks, run by the main thread between two of its bytecodes (``Py_AddPendingCall``).
    Never from the watching thread: ``gc.get_objects()`` there holds every object, a tuple being built
    by the main thread included, while the main thread runs on, and CPython then fails that tuple's
    resize (``SystemError: bad argument to internal function``, seen in a report's run). A watch leaves
    the queue after its walk, not before: one that grew during its own walk would queue the next at once
    (walks back to back, holding the main thread for seconds)."""
    for watch in list(_WAITING):
        try:
            if not watch.stop.is_set():
                watch.top = largest_tensors(watch.exclude)
        except Exception:  # naming tensors is a courtesy: it never raises into the user's code
            logging.getLogger(__name__).debug("could not list the live tensors", exc_info=True)
        finally:
            _WAITING.discard(watch)
    return 0


_PYTHON = getattr(ctypes, "pythonapi", None)  # CPython's own API (absent elsewhere: no tensors named)
_WALK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(_walk_waiting)  # module-level: outlives any queued call


class _Watch(threading.Thread):
    """Polls the resident size every ``interval`` seconds, keeping its largest value; each time it has
    grown by ``step`` bytes since the last look, has the main thread note the largest tensors alive
    (:func:`largest_tensors`, at its next bytecode), so the tensors near the peak are named (when the
    block runs on the main thread, as in a notebook; elsewhere none are named)."""

    def __init__(self, exclude: set[int], step: int, interval: float = 0.02):
        super().__init__(daemon=True, name="massive_lens-memory")
        self.exclude, self.step, self.interval = exclude, step, interval
        self.stop = threading.Event()
        self.top: list[tuple[int, str]] = []
        self.at = self.most = (_status_kib("VmRSS") or 0) * 1024  # only growth within the block is looked at
        self.names = _PYTHON is not None and threading.current_thread() is threading.main_thread()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            rss = (_status_kib("VmRSS") or 0) * 1024
            self.most = max(self.most, rss)
            if rss > self.at + self.step and self.names and self not in _WAITING:
                self.at = rss
                _WAITING.add(self)
                if _PYTHON.Py_AddPendingCall(_WALK, None) != 0:  # the queue is full: look next time
                    _WAITING.discard(self)


class SectionPeaks:
    """Each section's own peak resident memory, time and largest live tensors.

    The kernel's high-water mark is not reset per section: that would also erase the process's
    lifetime peak that ``/usr/bin/time`` and ``getrusage`` report (an 800 MB peak before a reset is
    gone from both). A section that raises the mark has it as its exact peak; any other section's
    peak is the largest resident size a thread saw, reading it every 20 ms (``exact`` False: a spike
    shorter than that can be missed, and it is below an earlier section's peak anyway).

    ``base`` is what the sizes are counted above (the libraries: the resident size before the model
    was loaded), ``weights`` the model (tensors at its weights' addresses are not listed). Use
    ``with peaks.track(name): ...`` around each section, then :meth:`to_frame` and :meth:`line`.

    >>> peaks = SectionPeaks(base=0, weights=torch.nn.Linear(4, 4))
    >>> with peaks.track("example"):
    ...     _ = torch.ones(1000)
    >>> list(peaks.to_frame().columns)[:3]
    ['section', 'seconds', 'peak_MiB']
    """

    def __init__(self, base: int, weights: Any = None):
        self.base, self.exclude, self.weight_bytes = base, set(), 0
        self.rows: list[dict[str, Any]] = []
        if weights is not None:
            self.weights_of(weights)

    def weights_of(self, model: Any) -> None:
        """Name the weights (for a model loaded inside the first block, once it is loaded)."""
        params = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"}
        self.exclude = set(params)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in params.values())

    @contextmanager
    def track(self, name: str) -> Iterator[None]:
        """Measure the block as one row named ``name``."""
        mark = _status_kib("VmHWM")
        watch = _Watch(self.exclude, step=max(16 * 2**20, self.weight_bytes // 50))
        start = time.perf_counter()
        watch.start()
        try:
            yield
        finally:
            watch.stop.set()
            watch.join()
            _WAITING.discard(watch)
        after = _status_kib("VmHWM")
        exact = mark is not None and after is not None and after > mark
        peak = after * 1024 if exact else max(watch.most, (_status_kib("VmRSS") or 0) * 1024)
        added = peak - self.base
        self.rows.append(dict(
            section=name, seconds=round(time.perf_counter() - start, 1), peak_MiB=round(peak / 2**20),
            added_MiB=round(added / 2**20), added=added, exact=exact,
            largest_tensors="; ".join(f"{what} {size / 2**20:.0f} MiB" for size, what in watch.top) if watch.names
            else "not looked for (the block ran off the main thread)"))

    def line(self) -> str:
        """The last row in words, for the run's log."""
        r = self.to_frame().iloc[-1]
        how = "the run's peak so far" if r["exact"] else "sampled"
        return (f"{r['section']}: {r['seconds']:.1f} s, peak {r['peak_MiB']} MiB resident ({how}), "
                f"{r['added_MiB']} MiB above the start ({r['x_weights']:.2f}x the weights); largest tensors "
                f"besides the weights: {r['largest_tensors'] or 'none seen'}")

    def to_frame(self) -> pd.DataFrame:
        """Columns: ``section``, ``seconds``, ``peak_MiB`` (resident), ``added_MiB`` (the peak above the
        start), ``x_weights`` (that over the weights), ``exact`` (True: the section raised the process's
        high-water mark, which is its peak; False: the largest size sampled every 20 ms),
        ``largest_tensors`` (the largest live tensors besides the weights, seen as the size grew)."""
        frame = pd.DataFrame(self.rows)
        x = frame.pop("added") / self.weight_bytes if self.weight_bytes else float("nan")
        frame.insert(4, "x_weights", x.round(2) if self.weight_bytes else x)
        return frame
