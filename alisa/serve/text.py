"""An answer's text as its tokens come: the new text of each step, and where a stop string ends
it.

The text is always the decode of every token so far (``skip_special_tokens``, as ``alisa
generate`` and the scheduler's results decode), so what the deltas add up to is the text a
whole decode gives. A step's delta holds back what may still change: a trailing replacement
character (a character whose bytes are still arriving) and, with stop strings, the last
characters that could begin one.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character


class TextStream:
    """The text of one answer, grown token by token.

    Parameters
    ----------
    tokenizer
        Decodes the tokens (an HF tokenizer).
    stop
        Strings that end the answer where they first appear (they are not part of it).
    eos_ids
        Tokens that end a row (not part of the text).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), eos_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.eos_ids = eos_ids
        self.tokens: list[int] = []
        self.text = ""  # the whole decode, cut at a stop string once one is found
        self.sent = 0  # characters of text handed out as deltas
        self.stopped = False  # a stop string was found: no token after it counts
        self._searched = 0  # characters already searched for stop strings
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, tokens: Sequence[int]) -> int:
        """Append ``tokens`` up to the one that completes a stop string (none once one was
        found); returns how many were taken: a step can hand over several (a newcomer's first
        two), and those after the stop are neither part of the answer nor counted."""
        if self.stopped or not tokens:
            return 0
        if not self.stop:
            self._extend(tokens)
            return len(tokens)
        for taken, token in enumerate(tokens, start=1):
            self._extend([token])
            self._find_stop()
            if self.stopped:
                return taken
        return len(tokens)

    def _extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        shown = [t for t in self.tokens if t not in self.eos_ids] if self.eos_ids else self.tokens
        self.text = self.tokenizer.decode(shown, skip_special_tokens=True)

    def _find_stop(self) -> None:
        """Cut the text at the first stop string, searching only what may hold a new one."""
        if not self.stop:
            return
        start = max(0, self._searched - self._hold)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
        self._searched = len(self.text)

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (``final``: all of it)."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._hold if self.stop else 0
            while end > self.sent and self.text[end - 1] == REPLACEMENT:
                end -= 1  # a character still arriving byte by byte
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
