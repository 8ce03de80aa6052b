"""Memory measurement: tensor bytes and peak memory (sizes as text: :mod:`alisa.sizes`)."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import torch


def tensor_bytes(tensors) -> int:
    """Total ``nbytes`` of the tensors in an iterable (None entries skipped)."""
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


class PeakMemory:
    """Peak resident memory of this process (and peak CUDA allocation) over a ``with`` block.

    On Linux the kernel's high-water mark is reset on entry (``/proc/self/clear_refs``) and read
    on exit, so the figure is exact; elsewhere a sampling thread polls psutil every 5 ms.
    """

    _clear_refs = Path("/proc/self/clear_refs")
    _status = Path("/proc/self/status")

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_rss_bytes = 0
        self.peak_device_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if not self._reset_high_water_mark():
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak_rss_bytes = self._high_water_mark()

    @property
    def peak_bytes(self) -> int:
        """Peak on the model's device: CUDA allocation on GPU, resident memory on CPU."""
        return self.peak_device_bytes if self.device.type == "cuda" else self.peak_rss_bytes

    def _reset_high_water_mark(self) -> bool:
        try:
            self._clear_refs.write_text("5")
            return self._high_water_mark() > 0
        except OSError:
            return False

    def _high_water_mark(self) -> int:
        for line in self._status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def _poll(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak_rss_bytes = max(self.peak_rss_bytes, process.memory_info().rss)
            self._stop.wait(0.005)
        self.peak_rss_bytes = max(self.peak_rss_bytes, process.memory_info().rss)
