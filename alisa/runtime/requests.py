"""What continuous batching takes and gives: requests, admission rules, results, statistics."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Protocol

from alisa.checks import check_int, check_number, unordered

# Padded prompt tokens (rows x longest) of one prefill forward, by default: see
# ContinuousScheduler's prefill_tokens.
PREFILL_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    """One prompt to complete.

    Parameters
    ----------
    prompt_ids
        The prompt's token ids, in order (at least one; integers >= 0, below the model's
        vocabulary size, which :meth:`check_vocabulary` checks where the request meets the
        model): a list, a tuple, a numpy array, or a 1-D torch tensor (kept as a list).
    max_new_tokens
        Tokens to generate at most (the row also stops at EOS); an integer, numpy's included
        (kept as a Python int).
    id
        The caller's name for it, returned with the result (default: its arrival index); not
        NaN, which equals no id, itself included, so results could not be told apart by it.
    arrival_s
        When it arrived (``time.perf_counter()``), which its TTFT counts from; None: when
        submitted to the scheduler. A batch job's rows all arrive when the job starts.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    id: object = None
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        try:  # ids key the results (and refuse duplicates) in dicts: a list could not be one
            hash(self.id)
        except TypeError:
            raise ValueError(
                f"id={self.id!r} of a StreamRequest must be a string, an integer or None, not "
                f"a {type(self.id).__name__}"
            ) from None
        if isinstance(self.id, Real) and math.isnan(self.id):
            # Ids tell results apart by equality (duplicates are refused by it), and NaN equals
            # nothing: two NaN-named requests would pass as distinct and return alike.
            raise ValueError(
                f"id={self.id!r} of a StreamRequest is NaN, which equals no id (itself "
                "included): results could not be told apart by it; give a string or an integer"
            )
        # Frozen: the two fields are set to plain values once, while being validated.
        object.__setattr__(self, "prompt_ids", self._plain_ids())
        ids = self.prompt_ids
        if isinstance(ids, str | bytes | bytearray) or not (
            isinstance(ids, Sized) and isinstance(ids, Iterable)
        ):
            raise ValueError(
                f"prompt_ids={ids!r} of {self._who()} must be a list of token ids (integers >= 0)"
            )
        kind = unordered(ids)
        if kind is not None:
            raise ValueError(
                f"prompt_ids={ids!r} of {self._who()} must be a list of token ids "
                f"(integers >= 0) in prompt order, not {kind}"
            )
        if len(ids) == 0:
            raise ValueError(f"prompt_ids of {self._who()} is empty")
        for index, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
                raise ValueError(
                    f"prompt_ids[{index}]={token!r} of {self._who()} must be a token id "
                    "(an integer >= 0)"
                )
        check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        if self.arrival_s is not None:
            check_number("arrival_s", self.arrival_s)
            # A time.perf_counter() reading taken already: a later one would give a negative
            # TTFT, one below zero (no such reading) a TTFT of the machine's uptime.
            now = time.perf_counter()
            if not 0 <= self.arrival_s <= now:
                raise ValueError(
                    f"arrival_s={self.arrival_s!r} of {self._who()} must be in [0, {now:.3f}]: "
                    "a time.perf_counter() reading taken already (not an offset from now), "
                    "or None"
                )

    def _who(self) -> str:
        """This request, as its messages name it: by its id, else (one of many, before
        :func:`~alisa.jobs.stream.stream_generate` numbers it) by its first prompt ids."""
        if self.id is not None:
            return f"request {self.id!r}"
        ids = self.prompt_ids
        if isinstance(ids, list | tuple) and ids:
            head = ", ".join(map(repr, ids[:4])) + (", ..." if len(ids) > 4 else "")
            return f"the request with no id whose prompt_ids are [{head}]"
        return "a request with no id"

    def _plain_ids(self) -> object:
        """``prompt_ids``, a torch tensor (a tokenizer's ``return_tensors="pt"`` output, one
        prompt's row) as the list it holds: its elements are tensors, which no check of a token
        id would take; anything else as it is."""
        from torch import Tensor  # here: the CLI imports this module without torch, to start fast

        ids = self.prompt_ids
        if not isinstance(ids, Tensor):
            return ids
        if ids.dim() != 1:
            raise ValueError(
                f"prompt_ids of {self._who()} is a tensor of shape {tuple(ids.shape)}; give "
                "one prompt's ids: a 1-D tensor or a list (e.g. input_ids[0])"
            )
        return ids.tolist()

    def check_vocabulary(self, size: int) -> None:
        """Refuse a prompt id that is no token of a model with ``size`` token ids (its
        embedding table's rows, :func:`vocabulary_size`), before it reaches the model (whose
        embedding lookup would fail with an ``IndexError`` mid-batch).

        Raises
        ------
        ValueError
            Naming the first id past the vocabulary, its index and ``size``.
        """
        found = past_vocabulary(self.prompt_ids, size)
        if found is None:
            return
        index, token = found
        raise ValueError(
            f"prompt_ids[{index}]={token} of {self._who()} is past the model's "
            f"vocabulary of {size} tokens (ids 0..{size - 1})"
        )


# Said where a tokenizer turned text into an id the model cannot embed: a tokenizer of another
# model (its added tokens, or another vocabulary altogether).
TOKENIZER_HINT = "does the tokenizer belong to this model?"


def past_vocabulary(ids: Sequence[int], size: int) -> tuple[int, int] | None:
    """(index, id) of the first of ``ids`` that a model with ``size`` token ids cannot embed,
    or None (every id in 0 .. size - 1)."""
    return next(((index, int(token)) for index, token in enumerate(ids) if token >= size), None)


def vocabulary_size(model) -> int:
    """Token ids ``model`` can embed: its input embedding table's rows (ids 0 .. rows - 1; a
    larger id, from a tokenizer's added tokens say, would fail the embedding lookup)."""
    return model.get_input_embeddings().num_embeddings


@dataclass(frozen=True)
class RowShape:
    """What admission knows of a row: the tokens it holds (its prompt, then those generated)
    and how many it may still add."""

    tokens: int
    new_tokens: int


class Admission(Protocol):
    """Decides whether waiting requests may join the running rows, and whether the running
    rows may take their next step."""

    max_rows: int  # rows running together at most (a compiled step's bucket stays within it)

    def admits(self, running: Sequence[RowShape], joining: Sequence[RowShape]) -> bool:
        """Whether ``joining`` (prefilled together) fit next to ``running``."""
        ...

    def fits(self, running: Sequence[RowShape]) -> bool:
        """Whether ``running`` may take their next step (False: the newest row is paused)."""
        ...


@dataclass(frozen=True)
class RowLimit:
    """Admit while the rows stay at most ``max_rows`` (no byte budget)."""

    max_rows: int

    def admits(self, running: Sequence[RowShape], joining: Sequence[RowShape]) -> bool:
        return len(running) + len(joining) <= self.max_rows

    def fits(self, running: Sequence[RowShape]) -> bool:
        return len(running) <= self.max_rows


@dataclass(kw_only=True)
class StreamResult:
    """One finished request.

    Attributes
    ----------
    id
        The request's id.
    token_ids
        Generated tokens, EOS included when emitted.
    text
        Decoded tokens (EOS excluded), or None without a tokenizer.
    prompt_tokens
        Prompt length in tokens.
    finish_reason
        ``"stop"`` (EOS), ``"length"`` (max_new_tokens reached), ``"did_not_fit"`` (the
        admission rule refuses it even alone), ``"prompt_too_long"`` (the prompt is longer
        than the model's context) or ``"context_exceeded"`` (with its ``max_new_tokens`` it
        would be); ``error`` says why, and such a row never runs.
    ttft_s
        From the request's arrival (queueing included) to its first token, seconds.
    latency_s
        From arrival to its last token, seconds.
    paused
        Times it was paused (its KV swapped to host memory) to make room, and resumed.
    """

    id: object
    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    finish_reason: str
    ttft_s: float
    latency_s: float
    error: str | None = None
    paused: int = 0


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One scheduler iteration, for timelines (``ContinuousScheduler(on_step=...)``).

    Attributes
    ----------
    time_s
        ``time.perf_counter()`` once the iteration's tokens were picked.
    rows
        Rows that took the iteration's decode step (0: only a prefill ran).
    tokens
        Tokens generated in the iteration: the newcomers' first tokens and the decode step's.
    queued, paused
        Requests waiting to start, and rows paused in host memory, after the iteration.
    kv_bytes
        Device KV held by the running rows after it (None where not measured).
    """

    time_s: float
    rows: int
    tokens: int
    queued: int = 0
    paused: int = 0
    kv_bytes: int | None = None


@dataclass(kw_only=True)
class SchedulerStats:
    """Where the scheduler stands (for progress lines)."""

    running: int = 0
    peak_rows: int = 0  # the most rows that ran one step together
    queued: int = 0
    paused: int = 0  # rows whose KV waits in host memory
    preemptions: int = 0  # rows paused so far
    finished: int = 0
    generated_tokens: int = 0
    kv_bytes: int = 0  # device KV held by the running rows (the key sketch included)
    peak_kv_bytes: int = 0
    compile_s: float | None = None  # the compiled step's first steps, per shape (None: none)
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self.started_s
        return self.generated_tokens / elapsed if elapsed > 0 else 0.0
