"""Rows in flight and tokens over a run's time, from a scheduler's steps or from token times."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from alisa.runtime.requests import StepRecord


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
        times = np.asarray(self.times) - self.started_s
        bins = np.floor(times / width_s).astype(int)
        count = int(bins.max()) + 1 if len(bins) else 0
        tokens = np.bincount(bins, weights=self.tokens, minlength=count) / width_s
        rows = np.zeros(count)
        np.maximum.at(rows, bins, self.rows)
        return (np.arange(count) + 1) * width_s, rows, tokens


def plot_timelines(timelines: dict[str, Timeline], path: str, width_s: float = 2.0) -> None:
    """Rows in flight (top) and generated tokens/s (bottom, ``width_s`` bins) over each run's
    time, one line per run, into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, timeline in timelines.items():
        if not timeline.times:
            continue
        ends, rows, rate = timeline.series(width_s)
        top.step(ends, rows, where="pre", label=name)
        bottom.plot(ends - width_s / 2, rate, label=name)
    top.set_ylabel("rows in flight (most per bin)")
    bottom.set_ylabel(f"generated tokens/s ({width_s:g} s bins)")
    bottom.set_xlabel("seconds since the requests were submitted")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
