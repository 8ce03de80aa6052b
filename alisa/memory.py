"""Memory measurement and byte-size parsing."""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import psutil
import torch

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float, *, field: str = "size") -> int:
    """Parse ``"16GiB"``, ``"512MB"``, ``"1.5g"`` or a plain number into bytes.

    Raises
    ------
    ValueError
        For negative, infinite, non-numeric or unknown-unit values, naming ``field`` and the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a byte size")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{field}={value!r} must be a finite number of bytes >= 0")
        return int(value)
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{field}={value!r} is not a byte size; use a number with an optional unit "
            "such as 512MB, 2GiB or 1.5G"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(count: int | float) -> str:
    """Human-readable binary size, e.g. ``1.5 GiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


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
