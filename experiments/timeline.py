"""A run's time axis: rows in flight and tokens over time, and the stops to leave out of it.

On a shared machine another user's tool may stop every Python process (``SIGSTOP``) while its
own measurement runs, and a VM may be suspended: a wall-clock timer then counts the stop as work.
:class:`PauseWatch` sees such stops; every time a benchmark reports is taken without them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from alisa.runtime.requests import StepRecord


class PauseWatch:
    """Records gaps (``time.perf_counter()`` intervals) longer than ``gap_s`` in which this
    process did not run, while used as a context manager: a daemon thread wakes every ``tick_s``
    and a wake-up ``gap_s`` late is a stop (CPU contention delays one by milliseconds)."""

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


@dataclass
class Timeline:
    """Steps of one run started at ``started_s`` (``time.perf_counter()``): when each step
    ended, the rows that took part and the tokens it produced. ``add`` takes a scheduler's
    :class:`StepRecord`."""

    started_s: float
    times: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, record: StepRecord) -> None:
        self.times.append(record.time_s)
        self.rows.append(record.rows)
        self.tokens.append(record.tokens)

    @classmethod
    def from_tokens(cls, started_s: float, token_times: list[list[float]]) -> Timeline:
        """A run known by its requests' token times: one step per token, whose rows are the
        requests between their first and last token then."""
        first = np.sort([times[0] for times in token_times if times])
        last = np.sort([times[-1] for times in token_times if times])
        every = np.sort(np.concatenate([np.asarray(t, dtype=float) for t in token_times if t]))
        active = np.searchsorted(first, every, side="right") - np.searchsorted(last, every)
        return cls(started_s, times=every.tolist(), rows=active.tolist(), tokens=[1] * len(every))

    def excluding(self, paused: Callable[[float, float], float]) -> Timeline:
        """This timeline with the seconds ``paused(start, end)`` says the process was stopped
        taken out (each step moves earlier by the stops before it)."""
        times = [time_s - paused(self.started_s, time_s) for time_s in self.times]
        return Timeline(self.started_s, times=times, rows=self.rows, tokens=self.tokens)

    def max_rows(self) -> int:
        return max(self.rows, default=0)

    def mean_rows(self) -> float:
        """Rows in flight averaged over the run's time (each step's rows count for the time
        since the step before; the first step's since the start: prefill included)."""
        if not self.times:
            return 0.0
        times = np.asarray([self.started_s, *self.times])
        return float((np.asarray(self.rows) * np.diff(times)).sum() / (times[-1] - times[0]))

    def series(self, width_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bin ends in seconds from the start, most rows in each bin, tokens/s in each)."""
        bins = np.floor((np.asarray(self.times) - self.started_s) / width_s).astype(int)
        count = int(bins.max()) + 1 if len(bins) else 0
        tokens = np.bincount(bins, weights=self.tokens, minlength=count) / width_s
        rows = np.zeros(count)
        np.maximum.at(rows, bins, self.rows)
        return (np.arange(count) + 1) * width_s, rows, tokens


def plot_timelines(timelines: dict[str, Timeline], path: str, width_s: float = 2.0) -> None:
    """Rows in flight (top) and generated tokens/s (bottom, ``width_s`` bins) over each run's
    time, one line per run, into the PNG ``path``."""
    from experiments.extras import pyplot, save_figure

    figure, (top, bottom) = pyplot().subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, timeline in timelines.items():
        if timeline.times:
            ends, rows, rate = timeline.series(width_s)
            top.step(ends, rows, where="pre", label=name)
            bottom.plot(ends - width_s / 2, rate, label=name)
    top.set_ylabel("rows in flight (most per bin)")
    bottom.set_ylabel(f"generated tokens/s ({width_s:g} s bins)")
    bottom.set_xlabel("seconds since the requests were submitted")
    top.legend(fontsize=8)
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
    save_figure(figure, path, dpi=120)
