"""How a prompt is split over ranks: even (KVR-E), searched (KVR-S), interpolated table (KVR-P).

KV-Runahead (https://arxiv.org/abs/2405.05329): rank i prefills tokens [b_i, b_{i+1}) and attends
to everything before; later ranks have more to attend to, so balanced splits give them fewer
tokens. Boundaries are token indices with b_0 = 0 and b_p = length.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def even_split(length: int, world: int) -> list[int]:
    """Boundaries of equal chunks (the remainder goes to the first ranks)."""
    if world < 1 or length < world:
        raise ValueError(f"cannot split {length} tokens over {world} ranks")
    base, extra = divmod(length, world)
    bounds, start = [0], 0
    for rank in range(world):
        start += base + (1 if rank < extra else 0)
        bounds.append(start)
    return bounds


def from_ratios(length: int, ratios: list[float]) -> list[int]:
    """Boundaries from chunk shares (they are normalised); every chunk gets >= 1 token."""
    total = sum(ratios)
    bounds, acc = [0], 0.0
    for share in ratios[:-1]:
        acc += share / total
        bounds.append(round(acc * length))
    bounds.append(length)
    for index in range(1, len(bounds)):
        bounds[index] = max(bounds[index], bounds[index - 1] + 1)
    if bounds[-1] != length:
        raise ValueError(f"cannot give every one of {len(ratios)} ranks a token of {length}")
    return bounds


def ratios_of(bounds: list[int]) -> list[float]:
    length = bounds[-1]
    return [(b - a) / length for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def grid_search(
    measure: Callable[[list[int]], float],
    length: int,
    world: int,
    *,
    points: int = 5,
    rounds: int = 4,
    min_stride: int = 8,
) -> tuple[list[int], float]:
    """Hierarchical grid search of boundaries minimising ``measure`` (e.g. measured TTFT).

    Each round tries ``points`` positions for every boundary around the best so far (coordinate
    descent), then narrows the step, down to ``min_stride`` tokens.
    """
    best = even_split(length, world)
    best_cost = measure(best)
    step = max(min_stride, length // (2 * world))
    for _ in range(rounds):
        for index in range(1, world):
            low, high = best[index - 1] + 1, best[index + 1] - 1
            half = points // 2
            for offset in range(-half, half + 1):
                candidate = list(best)
                candidate[index] = min(high, max(low, best[index] + offset * step))
                if candidate == best:
                    continue
                cost = measure(candidate)
                if cost < best_cost:
                    best, best_cost = candidate, cost
        if step <= min_stride:
            break
        step = max(min_stride, step // 2)
    return best, best_cost


def attention_cost_model(
    layers: int = 32, per_token: float = 0.0, per_pair: float = 1.0
) -> Callable:
    """Analytic TTFT of a KV-Runahead chain: layer-pipelined ranks, causal-attention work.

    Rank i spends per layer ``per_token * c_i + per_pair * (c_i * b_i + c_i**2 / 2)`` and can start
    layer l only after rank i-1 finished it (its K/V are the prefix). For pure attention at p=2
    the optimum is b_1 = length / sqrt(2).
    """

    def cost(bounds: list[int]) -> float:
        finish = [0.0] * layers
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            chunk = b - a
            work = per_token * chunk + per_pair * (chunk * a + chunk * chunk / 2)
            previous = 0.0
            for layer in range(layers):
                start = max(previous, finish[layer])
                finish[layer] = start + work
                previous = finish[layer]
        return finish[-1]

    return cost


class PartitionTable:
    """Searched splits per prompt length for one (model, hardware, world), saved as JSON (KVR-P).

    New lengths interpolate the chunk shares of the two nearest stored lengths linearly.
    """

    def __init__(self, key: str, entries: dict[int, list[float]] | None = None) -> None:
        self.key = key
        self.entries = dict(sorted((entries or {}).items()))

    def add(self, bounds: list[int]) -> None:
        self.entries[bounds[-1]] = ratios_of(bounds)
        self.entries = dict(sorted(self.entries.items()))

    def lookup(self, length: int) -> list[int]:
        """Boundaries for ``length`` tokens, interpolated between stored lengths."""
        if not self.entries:
            raise ValueError(f"partition table {self.key!r} is empty")
        lengths = list(self.entries)
        if length <= lengths[0]:
            return from_ratios(length, self.entries[lengths[0]])
        if length >= lengths[-1]:
            return from_ratios(length, self.entries[lengths[-1]])
        upper = next(i for i, known in enumerate(lengths) if known >= length)
        a, b = lengths[upper - 1], lengths[upper]
        weight = (length - a) / (b - a)
        shares = [
            (1 - weight) * x + weight * y
            for x, y in zip(self.entries[a], self.entries[b], strict=True)
        ]
        return from_ratios(length, shares)

    def save(self, path: str | Path) -> None:
        file = Path(path)
        data = json.loads(file.read_text()) if file.is_file() else {}
        data[self.key] = {str(k): v for k, v in self.entries.items()}
        file.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, key: str) -> PartitionTable:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"partition table file {str(file)!r} does not exist")
        data = json.loads(file.read_text())
        if key not in data:
            raise ValueError(
                f"partition table {str(file)!r} has no entry {key!r}; it has {sorted(data)}"
            )
        return cls(key, {int(k): v for k, v in data[key].items()})


def with_last_chunk(bounds: list[int], rows: int) -> list[int]:
    """``bounds`` with the last chunk at least ``rows`` tokens, every other chunk kept >= 1.

    Earlier boundaries move left only as far as they must (the prompt's length and the number
    of chunks cap ``rows``).
    """
    chunks = len(bounds) - 1
    start = max(bounds[-1] - rows, bounds[0] + chunks - 1)
    if bounds[-2] <= start:
        return list(bounds)
    moved = [bounds[0]]
    for index, bound in enumerate(bounds[1:-1], start=1):
        # Leave room for one token in each chunk before the last.
        moved.append(max(min(bound, start - (chunks - 1 - index)), moved[-1] + 1))
    return [*moved, bounds[-1]]
