"""Aggregation families: common-words (CWE) and frequent-words (FWE) extraction.

Rules follow NVIDIA RULER (https://arxiv.org/abs/2404.06654,
``common_words_extraction.py`` and ``freq_words_extraction.py``). CWE: a numbered list where 10
words appear 30 times and the others 3 times (6 and 1 below 4,096 tokens), after one solved
example; the words come from the haystack text (RULER: ``wonderwords``). FWE: coded words of 6
random letters with Zipf counts (alpha = 2), the most frequent one replaced by '...'; the answer
is the next three. No single token holds the answer: every occurrence counts, which is where
keeping a few tokens is expected to fail.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

import numpy as np
from scipy.special import zeta

from experiments.tasks.ruler.sample import Draft, Request

CWE_TASK = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
    "common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TASK = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?"
)
FWE_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
SHORT_LENGTH = 4096  # RULER repeats CWE's words less below this length


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@dataclass(frozen=True, kw_only=True)
class CommonWords:
    """CWE: ``common`` words repeated ``common_repeats`` times among words repeated
    ``other_repeats`` times; the haystack size is the number of distinct words."""

    common: int = 10
    common_repeats: int = 30
    other_repeats: int = 3
    example_words: int = 40

    def __call__(self, request: Request, rng: random.Random, index: int) -> Draft:
        request.haystack.require_words(self.common + 1 + self.example_words, "cwe")
        pool = list(request.haystack.words)
        rng.shuffle(pool)
        example = pool[-self.example_words :]
        order_seed = rng.random()
        short = request.length < SHORT_LENGTH
        repeats = (6, 1) if short else (self.common_repeats, self.other_repeats)
        example_repeats = (3, 1) if short else (10, 3)
        shown = self._listing(example[: 20 if short else self.example_words], example_repeats)
        answer = _numbered(example[: self.common])
        solved = CWE_TASK.format(context=shown) + CWE_PREFIX + " " + answer

        def task(size: int) -> str:
            listing = self._listing(pool[:size], repeats, order_seed)
            return solved + "\n" + CWE_TASK.format(context=listing)

        return Draft(
            task=task,
            prefix=CWE_PREFIX,
            references=tuple(pool[: self.common]),
            smallest=self.common + 1,
            largest=len(pool) - self.example_words,  # the example's words stay out of the list
        )

    def _listing(self, words: list[str], repeats: tuple[int, int], seed: float = 0.0) -> str:
        common, others = words[: self.common], words[self.common :]
        listed = common * repeats[0] + others * repeats[1]
        random.Random(seed).shuffle(listed)
        return _numbered(listed)


@dataclass(frozen=True, kw_only=True)
class FrequentWords:
    """FWE: coded words with counts n * k^-alpha / zeta(alpha) for rank k; the haystack size n
    is the number of words. The vocabulary has one word per 50 tokens of the length."""

    alpha: float = 2.0
    word_length: int = 6
    answers: int = 3

    def __call__(self, request: Request, rng: random.Random, index: int) -> Draft:
        size = max(self.answers + 2, request.length // 50)
        vocabulary: list[str] = []
        seen: set[str] = set()
        while len(vocabulary) < size:
            word = "".join(rng.choices(string.ascii_lowercase, k=self.word_length))
            if word not in seen:
                seen.add(word)
                vocabulary.append(word)
        vocabulary[0] = "..."  # the most frequent word is noise, as in RULER
        order_seed = rng.random()
        ranks = np.arange(1, size + 1)

        def task(words: int) -> str:
            counts = (words * ranks**-self.alpha / zeta(self.alpha)).astype(int)
            text = [w for w, n in zip(vocabulary, counts, strict=True) for _ in range(n)]
            random.Random(order_seed).shuffle(text)
            return FWE_TASK.format(context=" ".join(text))

        # At this many words the answers' counts differ from each other and from the next rank.
        distinct = int(np.ceil(zeta(self.alpha) * (self.answers + 2) ** self.alpha * 4))
        return Draft(
            task=task,
            prefix=FWE_PREFIX,
            references=tuple(vocabulary[1 : 1 + self.answers]),
            smallest=distinct,
        )
