"""What every RULER family shares: the request, a drafted sample, and fitting it to a length.

A family draws its random choices first (a :class:`Draft`), then renders a prompt for any
haystack size, so :func:`~experiments.tasks.ruler.prompts.fit` grows the haystack to the
requested token length without changing the needles (https://arxiv.org/abs/2404.06654).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from experiments.tasks.ruler.haystack import Haystack
from experiments.tasks.ruler.prompts import PromptFormat, fit


@dataclass(frozen=True, kw_only=True)
class Request:
    """What every sample of one (family, length) shares.

    Attributes
    ----------
    haystack
        The text needles hide in and words come from.
    tokenizer
        The model's tokenizer: lengths are measured with it.
    format
        Chat template or plain continuation.
    length
        Tokens of the prompt plus the tokens to generate (RULER's ``max_seq_length``).
    samples
        Samples per (family, length) (the grid spaces its depths over them).
    seed
        Base seed; sample i of a family at a length is generated from (seed, family, length, i).
    """

    haystack: Haystack
    tokenizer: object
    format: PromptFormat
    length: int
    samples: int
    seed: int = 0

    def count(self, prompt: str) -> int:
        """Tokens of ``prompt`` as the model receives it."""
        return len(self.format.encode(self.tokenizer, prompt))


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One generated prompt and what a correct answer must contain.

    Attributes
    ----------
    input_ids
        The prompt's token ids (template, context, question and answer prefix).
    references
        Strings RULER's ``string_match_all`` looks for in the prediction.
    depths
        Where each needle (or chain link) sits, as a share of the context's tokens; empty for
        the word-extraction families.
    new_tokens
        Tokens to generate; ``len(input_ids) + new_tokens`` is at most the requested length.
    """

    family: str
    index: int
    prompt: str
    input_ids: list[int]
    references: tuple[str, ...]
    depths: tuple[float, ...]
    new_tokens: int


@dataclass(frozen=True, kw_only=True)
class Draft:
    """A sample's random choices, renderable at any haystack size (sentences or words)."""

    task: Callable[[int], str]
    prefix: str
    references: tuple[str, ...]
    depths: Callable[[int], tuple[float, ...]] = lambda size: ()
    smallest: int = 1
    largest: int | None = None  # None: the haystack repeats, any size renders


Drafter = Callable[[Request, random.Random, int], Draft]


@dataclass(frozen=True, kw_only=True)
class Family:
    """A task family: its name, its default answer budget and how it drafts a sample."""

    name: str
    new_tokens: int
    draft: Drafter

    def sample(self, request: Request, index: int, new_tokens: int | None = None) -> Sample:
        """Sample ``index`` at ``request.length`` tokens (prompt + ``new_tokens``, the family's
        budget when None), deterministic in (seed, family, length, index).

        Raises
        ------
        ValueError
            The length cannot hold the smallest prompt, or the haystack has too few words.
        """
        budget = new_tokens or self.new_tokens
        rng = random.Random(f"ruler:{request.seed}:{self.name}:{request.length}:{index}")
        draft = self.draft(request, rng, index)

        def render(size: int) -> str:
            return request.format.render(request.tokenizer, draft.task(size), draft.prefix)

        fitted = fit(
            render,
            request.count,
            request.length - budget,
            smallest=draft.smallest,
            largest=draft.largest,
            what=f"{self.name} at length={request.length}",
        )
        return Sample(
            family=self.name,
            index=index,
            prompt=fitted.prompt,
            input_ids=request.format.encode(request.tokenizer, fitted.prompt),
            references=draft.references,
            depths=draft.depths(fitted.size),
            new_tokens=budget,
        )
