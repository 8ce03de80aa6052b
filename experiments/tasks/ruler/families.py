"""The task families by name (a plain registry; a new family is one entry).

RULER's families that need no download (https://arxiv.org/abs/2404.06654): needle retrieval
with one key, several keys (one asked), several values and several queries; variable tracking;
common-words and frequent-words extraction; plus ``niah_grid``, one needle at evenly spaced
depths for a length x depth heatmap. ``new_tokens`` is each family's answer budget: RULER's
for VT (30) and FWE (50); 32 / 64 for one / four needle values and 64 for CWE's ten words, where
RULER allows 128 / 120 (the answer prefix ends right before the answer, so the shorter budgets
hold every answer and spare CPU time).
"""

from __future__ import annotations

from experiments.tasks.ruler.needles import Chain, Needles
from experiments.tasks.ruler.sample import Family
from experiments.tasks.ruler.words import CommonWords, FrequentWords

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(name="niah_single", new_tokens=32, draft=Needles()),
        Family(name="niah_multikey", new_tokens=32, draft=Needles(keys=4)),
        Family(name="niah_multivalue", new_tokens=64, draft=Needles(values=4)),
        Family(name="niah_multiquery", new_tokens=64, draft=Needles(keys=4, queries=4)),
        Family(name="vt", new_tokens=30, draft=Chain()),
        Family(name="cwe", new_tokens=64, draft=CommonWords()),
        Family(name="fwe", new_tokens=50, draft=FrequentWords()),
        Family(name="niah_grid", new_tokens=32, draft=Needles(grid=True)),
    )
}
RETRIEVAL = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "niah_grid")
AGGREGATION = ("cwe", "fwe")


def family(name: str) -> Family:
    """The family called ``name``.

    Raises
    ------
    ValueError
        An unknown name (the valid ones listed).
    """
    if name not in FAMILIES:
        raise ValueError(f"family={name!r} is unknown; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]
