"""The haystack: any text cut into sentences (the distractor context) and words (keys, word lists).

RULER (https://arxiv.org/abs/2404.06654) hides needles in Paul Graham's essays and draws keys and
word lists from the ``wonderwords`` lists; here both come from one text the user chooses
(WikiText-2's test split by default), so nothing is downloaded and any corpus can serve.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

# A sentence ends at ., ! or ? followed by whitespace (headings merge into the next sentence).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")
_WORD = re.compile(r"\b[a-z]{4,12}\b")
# The most frequent words of a text are mostly function words ("that", "with"): a list of them
# would test the model's prior, not its memory of the context.
FREQUENT_WORDS_SKIPPED = 200
MIN_SENTENCES = 8


@dataclass(frozen=True, eq=False)
class Haystack:
    """A text as sentences (with their token counts under one tokenizer) and distinct words.

    Attributes
    ----------
    sentences
        The text's sentences, whitespace collapsed, in order.
    sentence_tokens
        (len(sentences),) tokens of each sentence alone (the tokenizer's, no special tokens).
    words
        Distinct lowercase words of 4-12 letters, sorted, the text's most frequent ones left out.
    """

    sentences: tuple[str, ...]
    sentence_tokens: np.ndarray
    words: tuple[str, ...]

    @classmethod
    def from_text(cls, text: str, tokenizer, *, source: str = "haystack") -> Haystack:
        """Cut ``text`` into sentences and words; ``source`` names it in errors.

        Raises
        ------
        ValueError
            Fewer than :data:`MIN_SENTENCES` sentences.
        """
        sentences = tuple(s for s in _SENTENCE_END.split(re.sub(r"\s+", " ", text).strip()) if s)
        if len(sentences) < MIN_SENTENCES:
            raise ValueError(
                f"{source} has {len(sentences)} sentence(s); a haystack needs at least "
                f"{MIN_SENTENCES} (sentences end with '.', '!' or '?')"
            )
        counts = tokenizer(list(sentences), add_special_tokens=False)["input_ids"]
        frequency = Counter(_WORD.findall(text.lower()))
        common = {word for word, _ in frequency.most_common(FREQUENT_WORDS_SKIPPED)}
        return cls(
            sentences=sentences,
            sentence_tokens=np.array([len(ids) for ids in counts], dtype=np.int64),
            words=tuple(sorted(set(frequency) - common)),
        )

    def window(self, start: int, count: int) -> list[str]:
        """``count`` consecutive sentences from ``start``, wrapping around to the beginning (a
        text shorter than the context is repeated, as RULER repeats its essays)."""
        total = len(self.sentences)
        return [self.sentences[(start + i) % total] for i in range(count)]

    def window_tokens(self, start: int, count: int) -> np.ndarray:
        """(count,) token counts of :meth:`window`'s sentences."""
        index = (start + np.arange(count)) % len(self.sentences)
        return self.sentence_tokens[index]

    def require_words(self, count: int, purpose: str) -> None:
        """Refuse a task that needs more distinct words than the text has (naming both)."""
        if count > len(self.words):
            raise ValueError(
                f"{purpose} needs {count} distinct words; the haystack has {len(self.words)} "
                f"(lowercase, 4-12 letters, its {FREQUENT_WORDS_SKIPPED} most frequent left out): "
                "use a longer text or a shorter length"
            )
