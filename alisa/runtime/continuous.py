"""Continuous (iteration-level) batching: rows leave the moment they finish, newcomers join.

Orca's iteration-level scheduling (Yu et al., OSDI 2022,
https://www.usenix.org/conference/osdi22/presentation/yu), in nano-vllm's shape: each iteration
admits waiting requests while an :class:`Admission` rule allows, prefills them together in a
cache of their own (one left-padded forward: the running rows wait for one prefill, never for a
whole batch), merges that cache into the running one (:meth:`AlisaCache.extend`: rows of
different lengths side by side, no re-padding), runs one decode step over every row, and lets
finished rows leave (:meth:`AlisaCache.keep_rows`). With eviction or host retention a row's
device KV is bounded by its budget, so admission by bytes is predictable
(:mod:`alisa.jobs.sizing`).

Exactness: every row computes what it would alone. Its RoPE positions are its own
(``DecodeState.positions``), its budget follows its own length (``SlotMap.first``), and after
prefill attention masks by slot positions only. Float rounding may differ with the batch's shape
(matrix products over other batch sizes and slot orders), as in any batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from alisa.kv.cache import AlisaCache
from alisa.model.loading import context_length, prompt_length_error
from alisa.runtime.engine import DecodeState, Engine


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    """One prompt to complete.

    Parameters
    ----------
    prompt_ids
        The prompt's token ids (at least one).
    max_new_tokens
        Tokens to generate at most (the row also stops at EOS).
    id
        The caller's name for it, returned with the result (default: its arrival index).
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    id: object = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"prompt_ids of request {self.id!r} is empty")
        count = self.max_new_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"max_new_tokens={count!r} must be an integer >= 0")


@dataclass(frozen=True)
class RowShape:
    """What admission knows of a row: its prompt and how many tokens it may still add."""

    prompt_tokens: int
    new_tokens: int


class Admission(Protocol):
    """Decides whether waiting requests may join the running rows."""

    def admits(self, running: Sequence[RowShape], joining: Sequence[RowShape]) -> bool:
        """Whether ``joining`` (prefilled together) fit next to ``running``."""
        ...


@dataclass(frozen=True)
class RowLimit:
    """Admit while the rows stay at most ``max_rows`` (no byte budget)."""

    max_rows: int

    def admits(self, running: Sequence[RowShape], joining: Sequence[RowShape]) -> bool:
        return len(running) + len(joining) <= self.max_rows


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
    """

    id: object
    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    finish_reason: str
    ttft_s: float
    latency_s: float
    error: str | None = None


@dataclass(kw_only=True)
class SchedulerStats:
    """Where the scheduler stands (for progress lines)."""

    running: int = 0
    peak_rows: int = 0  # the most rows that ran one step together
    queued: int = 0
    finished: int = 0
    generated_tokens: int = 0
    kv_bytes: int = 0  # device KV held by the running rows (the key sketch included)
    peak_kv_bytes: int = 0
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self.started_s
        return self.generated_tokens / elapsed if elapsed > 0 else 0.0


@dataclass(kw_only=True)
class _Row:
    request: StreamRequest
    arrival_s: float
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0

    @property
    def shape(self) -> RowShape:
        return RowShape(len(self.request.prompt_ids), self.request.max_new_tokens)


class ContinuousScheduler:
    """Runs requests through one model with iteration-level batching.

    Parameters
    ----------
    engine
        The decode loop's forward and pick (greedy or sampling; with sampling, rows share
        one generator, so a row's draws depend on its batch).
    new_cache
        Builds an empty :class:`AlisaCache` for each group of newcomers (same config every
        time).
    admission
        Whether waiting requests may join (default: at most 64 rows).
    prefill_rows
        Newcomers prefilled together in one left-padded forward, at most.
    """

    def __init__(
        self,
        engine: Engine,
        new_cache: Callable[[], AlisaCache],
        admission: Admission | None = None,
        *,
        prefill_rows: int = 8,
    ) -> None:
        if isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int) or prefill_rows < 1:
            raise ValueError(f"prefill_rows={prefill_rows!r} must be an integer >= 1")
        self.engine, self.new_cache = engine, new_cache
        self.context = context_length(engine.model, engine.tokenizer)  # None: unknown
        self.admission = admission or RowLimit(64)
        self.prefill_rows = prefill_rows
        self.queue: deque[_Row] = deque()
        self.rows: list[_Row] = []  # running, in cache row order
        self.cache: AlisaCache | None = None
        self.state: DecodeState | None = None
        self.stats = SchedulerStats()
        self._arrivals = 0

    def submit(self, request: StreamRequest) -> None:
        """Queue ``request`` (its TTFT counts from now)."""
        if request.id is None:
            request = StreamRequest(
                prompt_ids=request.prompt_ids,
                max_new_tokens=request.max_new_tokens,
                id=self._arrivals,
            )
        self._arrivals += 1
        self.queue.append(_Row(request=request, arrival_s=time.perf_counter()))

    @property
    def idle(self) -> bool:
        return not self.queue and not self.rows

    def run(self, requests: Iterable[StreamRequest], lookahead: int = 64) -> Iterator[StreamResult]:
        """Results of ``requests`` in completion order; up to ``lookahead`` are read ahead of
        the running rows (an endless iterator is fine)."""
        source = iter(requests)
        exhausted = False
        while True:
            while not exhausted and len(self.queue) < lookahead:
                request = next(source, None)
                if request is None:
                    exhausted = True
                else:
                    self.submit(request)
            if self.idle:
                return
            yield from self.step()

    @torch.inference_mode()
    def step(self) -> list[StreamResult]:
        """One iteration: admit and prefill newcomers, one decode step, finished rows leave."""
        done = self._admit()
        if self.rows:
            self.stats.peak_rows = max(self.stats.peak_rows, len(self.rows))
            tokens = self.engine.step(self.state, self.cache)
            self.state.advance(tokens)
            done += self._leave(self._append(tokens, 0))
        self.stats.running, self.stats.queued = len(self.rows), len(self.queue)
        return done

    # ---- admission and prefill ------------------------------------------------------------

    def _admit(self) -> list[StreamResult]:
        """Prefill the waiting requests that fit (FIFO) and merge them into the running rows."""
        joining: list[_Row] = []
        done: list[StreamResult] = []
        running = [row.shape for row in self.rows]
        while self.queue and len(joining) < self.prefill_rows:
            head = self.queue[0]
            if head.request.max_new_tokens == 0:
                done.append(self._result(self.queue.popleft(), "length"))
                continue
            shape = head.shape
            error = prompt_length_error(shape.prompt_tokens, self.context, shape.new_tokens)
            if error is not None:  # past the context, positions are garbage: never run it
                alone = self.context is not None and shape.prompt_tokens > self.context[0]
                reason = "prompt_too_long" if alone else "context_exceeded"
                done.append(self._result(self.queue.popleft(), reason, error))
                continue
            if not self.admission.admits(running, [r.shape for r in [*joining, head]]):
                if not running and not joining:  # nothing will ever leave to make room
                    done.append(self._refused(self.queue.popleft()))
                    continue
                break
            joining.append(self.queue.popleft())
        if joining:
            done += self._prefill(joining)
        return done

    def _prefill(self, joining: list[_Row]) -> list[StreamResult]:
        """Prefill ``joining`` in a cache of their own, pick their first tokens, merge."""
        state = _padded_state(joining, self.engine.pad, self.engine.device)
        cache = self.new_cache()
        tokens = self.engine.step(state, cache)
        state.advance(tokens)
        first = len(self.rows)
        self.rows.extend(joining)
        if self.cache is None:
            self.cache, self.state = cache, state
        else:
            self.cache.extend(cache)
            self.state.extend(state, pad=self.engine.pad)
        return self._leave(self._append(tokens, first))

    # ---- bookkeeping ----------------------------------------------------------------------

    def _append(self, tokens: torch.Tensor, first: int) -> list[int]:
        """Give rows ``first``, ``first + 1``, ... their new ``tokens``; the rows finishing.

        One host read per call (the tokens and finish flags together), not per layer.
        """
        finished = self.state.finished[first : first + len(tokens)]
        picked, stops = torch.stack([tokens, finished.long()]).tolist()
        now = self.engine.clock()
        leaving = []
        for index, (token, stop) in enumerate(zip(picked, stops, strict=True), start=first):
            row = self.rows[index]
            if not row.tokens:
                row.ttft_s = now - row.arrival_s
            row.tokens.append(token)
            if stop or len(row.tokens) >= row.request.max_new_tokens:
                leaving.append(index)
        self.stats.generated_tokens += len(picked)
        return leaving

    def _leave(self, leaving: list[int]) -> list[StreamResult]:
        """Results of the rows ``leaving``; the cache and state keep the others."""
        self._note_kv()
        if not leaving:
            return []
        gone = set(leaving)
        results = []
        for index in leaving:
            row = self.rows[index]
            stopped = row.tokens[-1] in self.engine.eos_ids
            results.append(self._result(row, "stop" if stopped else "length"))
        kept = [index for index in range(len(self.rows)) if index not in gone]
        self.rows = [self.rows[index] for index in kept]
        if not kept:
            self.cache = self.state = None
        else:
            indices = torch.tensor(kept, device=self.engine.device)
            self.cache.keep_rows(indices)
            self.state.keep(indices)
        self._note_kv()
        return results

    def _note_kv(self) -> None:
        held = self.cache.tier_bytes()["device"] if self.cache is not None else 0
        self.stats.kv_bytes = held
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)

    def _result(self, row: _Row, reason: str, error: str | None = None) -> StreamResult:
        self.stats.finished += 1
        tokenizer = self.engine.tokenizer
        text = None
        if tokenizer is not None:
            shown = row.tokens[:-1] if reason == "stop" else row.tokens
            text = tokenizer.decode(shown, skip_special_tokens=True)
        return StreamResult(
            id=row.request.id,
            token_ids=list(row.tokens),
            text=text,
            prompt_tokens=len(row.request.prompt_ids),
            finish_reason=reason,
            ttft_s=row.ttft_s,
            latency_s=time.perf_counter() - row.arrival_s,
            error=error,
        )

    def _refused(self, row: _Row) -> StreamResult:
        shape = row.shape
        error = (
            f"a prompt of {shape.prompt_tokens} tokens with max_new_tokens={shape.new_tokens} "
            "does not fit the admission rule even alone"
        )
        return self._result(row, "did_not_fit", error)


def _padded_state(rows: list[_Row], pad: int, device: torch.device) -> DecodeState:
    """The newcomers' prompts, left-padded to the longest (no mask for one row)."""
    prompts = [list(row.request.prompt_ids) for row in rows]
    width = max(len(ids) for ids in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = None
    if any(len(p) < width for p in prompts):
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return DecodeState.start(ids, mask)
