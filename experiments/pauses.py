"""Wall-clock gaps in which this process did not run, to leave out of benchmark timings.

On a shared machine another user's tool may stop every Python process (``SIGSTOP``) while its
own short measurement runs, then resume them; a suspended VM does the same. A wall-clock timer
then counts the stop as work. A daemon thread that wakes every ``tick_s`` sees such a stop as a
gap between two wake-ups far longer than the tick, and records it.
"""

from __future__ import annotations

import threading
import time


class PauseWatch:
    """Records gaps (``time.perf_counter()`` intervals) longer than ``gap_s`` in which this
    process did not run, while used as a context manager.

    Parameters
    ----------
    tick_s
        How often the watching thread wakes.
    gap_s
        A wake-up this much later than the previous one is a stop (CPU contention delays a
        wake-up by milliseconds, not by this).
    """

    def __init__(self, tick_s: float = 0.05, gap_s: float = 0.5) -> None:
        if not 0 < tick_s < gap_s:
            raise ValueError(f"tick_s={tick_s!r} must be > 0 and below gap_s={gap_s!r}")
        self.tick_s, self.gap_s = tick_s, gap_s
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pause-watch", daemon=True)

    def __enter__(self) -> PauseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.tick_s):
            now = time.perf_counter()
            if now - last > self.gap_s:
                self.gaps.append((last, now))
            last = now

    def paused(self, start_s: float, end_s: float) -> float:
        """Seconds of [start_s, end_s] this process was stopped."""
        return sum(max(0.0, min(end_s, b) - max(start_s, a)) for a, b in self.gaps)

    def active(self, start_s: float, end_s: float) -> float:
        """Seconds of [start_s, end_s] this process ran (the interval less its stops)."""
        return (end_s - start_s) - self.paused(start_s, end_s)
