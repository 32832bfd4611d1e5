"""How much memory the report took, stated in the report itself.

The number that matters to a user is the process's peak resident memory while the report
ran (model included), next to the size of the model's weights: a report that peaks at 1.2x
its model's weights fits wherever the model fits. On Linux the kernel's high-water mark is
reset at the start (``/proc/self/clear_refs``) and read at the end, so the peak is the
report's own, not the model loading's before it; elsewhere the process's lifetime peak
(``resource.getrusage``) is given, and said to be that. On a GPU the peak of allocated
CUDA memory is added.
"""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path
from typing import Any

import torch

from massive_lens.core.budget import trim_allocator

try:
    import resource  # Unix only
except ImportError:  # Windows: no lifetime peak to report
    resource = None

_STATUS = Path("/proc/self/status")


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
        self.own_peak = False
        try:  # reset the kernel's high-water mark of this process to its current size
            Path("/proc/self/clear_refs").write_text("5")
            self.own_peak = _status_kib("VmHWM") is not None
        except OSError:
            pass
        self.start_bytes = (_status_kib("VmRSS") or 0) * 1024
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.own_peak:
            self.peak_bytes = (_status_kib("VmHWM") or 0) * 1024
        else:
            scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale if resource else 0
        self.cuda_peak_bytes = torch.cuda.max_memory_allocated() if self.cuda else 0

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
