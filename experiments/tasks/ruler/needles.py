"""Needles in the haystack: RULER's retrieval (NIAH) and variable-tracking families.

Templates and rules follow NVIDIA RULER (https://arxiv.org/abs/2404.06654,
``scripts/data/synthetic/niah.py`` and ``variable_tracking.py``): needles "One of the special magic
numbers for {key} is: {value}." with 7-digit values at depths drawn from 40 evenly spaced
percentages; a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... after a solved example. Keys are
two haystack words joined by '-' (RULER: adjective-noun pairs from ``wonderwords``).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

import numpy as np

from experiments.tasks.ruler.haystack import Haystack
from experiments.tasks.ruler.prompts import fit
from experiments.tasks.ruler.sample import Draft, Request

DEPTHS = tuple(float(d) / 100 for d in np.round(np.linspace(0, 100, num=40)).astype(int))
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_TASK = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\nWhat are all the special magic "
    "{kind} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT_TASK = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} "
    "variables are assigned the value {query}, they are: "
)
# The solved example's haystack fills up to 1/10 of the length (RULER: about 500 tokens).
EXAMPLE_SHARE = 10


def insert_at_depths(
    haystack: Haystack, start: int, size: int, items: list[str], depths: list[float]
) -> tuple[str, tuple[float, ...]]:
    """``size`` haystack sentences from ``start`` with ``items[i]`` at the sentence boundary
    nearest to ``depths[i]`` of the sentences' tokens (items sharing a boundary keep their
    order); returns (context, the depth each item reached)."""
    sentences = haystack.window(start, size)
    bounds = np.concatenate([[0], np.cumsum(haystack.window_tokens(start, size))])
    total = max(1, int(bounds[-1]))
    slots = [int(np.abs(bounds - depth * total).argmin()) for depth in depths]
    pieces: list[str] = []
    for index in range(size + 1):
        pieces += [item for item, slot in zip(items, slots, strict=True) if slot == index]
        if index < size:
            pieces.append(sentences[index])
    return " ".join(pieces), tuple(float(bounds[slot]) / total for slot in slots)


@dataclass(frozen=True, kw_only=True)
class Needles:
    """Needle retrieval: ``keys`` keys with ``values`` values each, ``queries`` of them asked.

    ``grid``: one needle at depth index / (samples - 1) instead of a random depth (the length x
    depth heatmap).
    """

    keys: int = 1
    values: int = 1
    queries: int = 1
    grid: bool = False

    def __call__(self, request: Request, rng: random.Random, index: int) -> Draft:
        request.haystack.require_words(2, "needle keys")
        taken: set[str] = set()
        keys = [_key(rng, request.haystack.words, taken) for _ in range(self.keys)]
        values = [[str(rng.randint(10**6, 10**7 - 1)) for _ in range(self.values)] for _ in keys]
        pairs = zip(keys, values, strict=True)
        needles = [NEEDLE.format(key=k, value=v) for k, row in pairs for v in row]
        rng.shuffle(needles)
        if self.grid:
            depths = [index / (request.samples - 1) if request.samples > 1 else 0.5]
        else:
            depths = sorted(rng.sample(DEPTHS, len(needles)))
        start = rng.randrange(len(request.haystack.sentences))
        asked = rng.sample(range(self.keys), self.queries)
        query = _listing([keys[i] for i in asked])
        one = self.queries * self.values == 1
        kind = "number" if one else "numbers"
        task, prefix = _singular(NIAH_TASK, one), _singular(NIAH_PREFIX, one)

        def context(size: int) -> tuple[str, tuple[float, ...]]:
            return insert_at_depths(request.haystack, start, size, needles, depths)

        return Draft(
            task=lambda size: task.format(kind=kind, context=context(size)[0], query=query),
            prefix=prefix.format(kind=kind, query=query),
            references=tuple(v for i in asked for v in values[i]),
            depths=lambda size: context(size)[1],
        )


def _key(rng: random.Random, words: tuple[str, ...], taken: set[str]) -> str:
    while True:
        key = "-".join(rng.sample(words, 2))
        if key not in taken:
            taken.add(key)
            return key


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _singular(text: str, one: bool) -> str:
    """RULER's wording when one value is asked: 'A special magic number ... is'."""
    if not one:
        return text
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is")


@dataclass(frozen=True, kw_only=True)
class Chain:
    """Variable tracking: ``hops + 1`` variables chained from one 5-digit value, the links at
    random depths, after a solved example (RULER's in-context example)."""

    hops: int = 4

    def __call__(self, request: Request, rng: random.Random, index: int) -> Draft:
        example, chain = _chain(rng, self.hops), _chain(rng, self.hops)
        depths = sorted(rng.sample(DEPTHS, self.hops + 1))
        start = rng.randrange(len(request.haystack.sentences))
        example_start = rng.randrange(len(request.haystack.sentences))
        spread = [i / (self.hops + 1) for i in range(self.hops + 1)]

        def solved(size: int) -> str:
            context, _ = insert_at_depths(
                request.haystack, example_start, size, example.links, spread
            )
            return example.task(context) + example.prefix + " ".join(example.names)

        budget = request.length // EXAMPLE_SHARE
        shot = solved(0)  # the bare chain when even that exceeds the example's share
        if request.count(shot) < budget:
            shot = fit(solved, request.count, budget, smallest=0, what="vt example").prompt

        def context(size: int) -> tuple[str, tuple[float, ...]]:
            return insert_at_depths(request.haystack, start, size, chain.links, depths)

        return Draft(
            task=lambda size: shot + "\n" + chain.task(context(size)[0]),
            prefix=chain.prefix,
            references=tuple(chain.names),
            depths=lambda size: context(size)[1],
        )


@dataclass(frozen=True, kw_only=True)
class _Links:
    names: list[str]
    value: str
    links: list[str]

    def task(self, context: str) -> str:
        return VT_TASK.format(context=context, query=self.value)

    @property
    def prefix(self) -> str:
        return VT_PREFIX.format(count=len(self.names), query=self.value)


def _chain(rng: random.Random, hops: int) -> _Links:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    links = [f"VAR {names[0]} = {value}."]
    links += [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    return _Links(names=names, value=value, links=links)
