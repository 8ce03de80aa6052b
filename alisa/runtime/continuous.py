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

While rows are running, a newcomer is prefilled inside their next decode step, one newcomer a
forward (a mixed forward, :mod:`alisa.kv.packed`): the running rows do not wait for its prefill
and the forward's fixed cost (reading every weight) is paid once for both. Models whose positions
do not come from ``position_ids`` alone (no rotary embedding) or that have sliding-window layers
prefill newcomers in a forward of their own, as when nothing runs.

Preemption loses nothing: when the running rows would outgrow what the admission rule allows
(rows admitted with room for only their next few tokens, ``ByteBudget(reserve_tokens=...)``),
the newest row is paused: its cache rows are taken out (:meth:`AlisaCache.take_rows`) and its
device KV copied to host memory (:func:`alisa.kv.swap.swap_out`), never re-prefilled (under
eviction a prefill would keep another token set). It rejoins, as a newcomer's cache does,
before any new request starts, and continues exactly where it stopped.

Compiled (the engine's decode steps through ``torch.compile``, issue 65): every row lives in a
static cache of one ``max_cache_len`` (:mod:`alisa.kv.static`), rows join and leave it as they
do a growing one, and each decode step runs over a bucket of rows (:func:`~alisa.runtime.
compiled.batch_bucket`, the next power of two within the admission's rows), the difference
filled with copies of the last row whose tokens are not read: one graph per bucket, replayed
while rows come and go (nano-vllm's captured batch sizes). Admission counts every row, and every
copy, at the static slot space of ``max_cache_len`` tokens. Newcomers prefill in a forward of
their own (eager), never mixed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from alisa.kv.cache import AlisaCache, PackedCache
from alisa.kv.swap import Swapped, swap_out
from alisa.model.adapter import ModelAdapter
from alisa.model.loading import context_length, prompt_length_error
from alisa.runtime.compiled import batch_bucket
from alisa.runtime.engine import DecodeState, Engine
from alisa.runtime.requests import (
    PREFILL_TOKENS,
    Admission,
    RowLimit,
    RowShape,
    SchedulerStats,
    StepRecord,
    StreamRequest,
    StreamResult,
    vocabulary_size,
)


@dataclass(kw_only=True)
class _Row:
    request: StreamRequest
    arrival_s: float
    order: int  # arrival index: the newest row is paused first
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    paused: int = 0

    @property
    def shape(self) -> RowShape:
        done = len(self.tokens)
        return RowShape(len(self.request.prompt_ids) + done, self.request.max_new_tokens - done)


@dataclass(frozen=True)
class _Paused:
    """A row waiting in host memory: its cache rows and its decode state."""

    row: _Row
    cache: Swapped[AlisaCache]
    state: DecodeState


class ContinuousScheduler:
    """Runs requests through one model with iteration-level batching.

    Parameters
    ----------
    engine
        The decode loop's forward and pick (greedy or sampling; seeded sampling draws from a
        generator per row, so a row's tokens do not depend on its batch).
    new_cache
        Builds an empty :class:`AlisaCache` for each group of newcomers (same config every
        time; given ``max_cache_len=`` when the rows run in static caches).
    admission
        Whether waiting requests may join, and running rows step (default: at most 64 rows).
    prefill_rows
        Newcomers admitted in one iteration, at most: prefilled together in one left-padded
        forward, or (rows running, ``packing``) one by one, each in a mixed forward.
    prefill_tokens
        Padded tokens (rows x longest prompt) of one left-padded prefill forward, at most: a
        newcomer joins the group only while the group stays within it (the first always
        does). It bounds the compute spent on padding, which on a CPU buys nothing: prefill
        runs at the same tokens/s one row at a time (measured: SmolLM2-135M, 2 threads, ~500
        tok/s for 1 x 491 and for 8 x 491). None: no bound.
    on_step
        Told each iteration's :class:`StepRecord` (timelines; None: nothing recorded).
    packing
        Prefill a newcomer inside the running rows' decode step when the model allows it
        (:func:`packs`); False: always in a forward of its own.
    max_cache_len
        Run the rows in static caches of this many tokens per row (``new_cache`` takes it),
        for decode steps compiled by the engine (one graph per bucket of rows); a request
        whose prompt and new tokens would pass it does not run (``"context_exceeded"``, the
        error naming it). None: growing caches.
    """

    def __init__(
        self,
        engine: Engine,
        new_cache: Callable[..., AlisaCache],
        admission: Admission | None = None,
        *,
        prefill_rows: int = 8,
        prefill_tokens: int | None = PREFILL_TOKENS,
        on_step: Callable[[StepRecord], None] | None = None,
        packing: bool = True,
        max_cache_len: int | None = None,
    ) -> None:
        for name, value in (("prefill_rows", prefill_rows), ("prefill_tokens", prefill_tokens)):
            if value is None and name == "prefill_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        self.prefill_tokens = prefill_tokens
        self.engine, self.new_cache = engine, new_cache
        # Token ids the model can embed: a request's ids are checked once, as it is queued.
        self.vocabulary = vocabulary_size(engine.model)
        self.context = context_length(engine.model, engine.tokenizer)  # None: unknown
        self.admission = admission or RowLimit(64)
        self.prefill_rows = prefill_rows
        self.on_step = on_step
        self.max_cache_len = max_cache_len
        # A static cache's rows prefill in a forward of their own (a mixed one is eager and
        # grows what a static layer keeps fixed).
        self.packing = packing and packs(engine.model) and max_cache_len is None
        # Positions from position_ids alone (a rotary embedding): past the prefill a compiled
        # step needs no padding mask (attention masks by slot positions), and one graph serves
        # the first rows, prefilled with padding, and every later batch, which has none.
        self._unmasked = ModelAdapter.of(engine.model).rotary is not None
        self.queue: deque[_Row] = deque()
        self.rows: list[_Row] = []  # running, in cache row order
        self.paused: list[_Paused] = []  # in arrival order
        self.cache: AlisaCache | None = None
        self.state: DecodeState | None = None
        self.stats = SchedulerStats()
        self._arrivals = 0
        self._recorded = 0  # generated tokens told to on_step so far

    def submit(self, request: StreamRequest) -> None:
        """Queue ``request`` (its TTFT counts from its ``arrival_s``, else from now).

        Raises
        ------
        ValueError
            A prompt id past the model's vocabulary (named, before it reaches the model).
        """
        request.check_vocabulary(self.vocabulary)
        if request.id is None:
            request = StreamRequest(
                prompt_ids=request.prompt_ids,
                max_new_tokens=request.max_new_tokens,
                id=self._arrivals,
                arrival_s=request.arrival_s,
            )
        arrival = time.perf_counter() if request.arrival_s is None else request.arrival_s
        self.queue.append(_Row(request=request, arrival_s=arrival, order=self._arrivals))
        self._arrivals += 1

    @property
    def idle(self) -> bool:
        return not self.queue and not self.rows and not self.paused

    def progress(self) -> list[tuple[object, list[int]]]:
        """(id, tokens generated so far) of every running row, in row order: a server streams
        them as they come (results hand a row's tokens over only when it finishes). The lists
        are the rows' own: read them, never change them."""
        return [(row.request.id, row.tokens) for row in self.rows]

    def cancel(self, request_id: object) -> bool:
        """Drop request ``request_id`` wherever it is: waiting, paused in host memory, or
        running (its cache rows are freed now, not at its next step), with no result.

        Returns
        -------
        bool
            False when no such request is here (finished, or never submitted).
        """
        for row in self.queue:
            if row.request.id == request_id:
                self.queue.remove(row)
                self.stats.queued = len(self.queue)
                return True
        for index, entry in enumerate(self.paused):
            if entry.row.request.id == request_id:
                del self.paused[index]  # its host copy goes with it
                self._note_kv()
                return True
        for index, row in enumerate(self.rows):
            if row.request.id == request_id:
                self._remove({index})
                self.stats.running = len(self.rows)
                return True
        return False

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
        """One iteration: pause rows that no longer fit, resume paused ones that do, else admit
        and prefill newcomers; one decode step; finished rows leave."""
        self._make_room()
        self._resume()
        done = [] if self.paused else self._admit()  # paused rows go first
        stepped = len(self.rows)
        if self.rows:
            self.stats.peak_rows = max(self.stats.peak_rows, len(self.rows))
            tokens = self._decode()
            self.state.advance(tokens)
            done += self._leave(self._append(tokens, 0))
        self._record(stepped)
        return done

    def _decode(self) -> torch.Tensor:
        """(rows,) the running rows' next tokens from one decode step: compiled, over their
        bucket (copies of the last row fill it; their tokens are not read)."""
        if not self._compiled:
            self._unfill()
            return self.engine.step(self.state, self.cache)
        rows = len(self.rows)
        bucket = batch_bucket(rows, self.admission.max_rows)
        if self.cache.batch_rows != bucket:  # the running rows, then copies of the last
            index = list(range(rows)) + [rows - 1] * (bucket - rows)
            self.cache.batch_select_indices(torch.tensor(index, device=self.engine.device))
        feeding = self.state.filled(bucket, mask=not self._unmasked)
        logits = self.engine.forward(feeding, self.cache)[:rows]
        self.stats.compile_s = self.engine.compiled.compile_s
        return self.engine.choose(self.state, logits)

    @property
    def _compiled(self) -> bool:
        """Whether the decode steps run compiled (over buckets of rows) from here on."""
        return self.engine.compiled is not None and self.engine.compiled.choice.compiled

    def _unfill(self) -> None:
        """The cache back to the running rows alone (before they change)."""
        if self.cache is not None and self.cache.batch_rows > len(self.rows):
            rows = torch.arange(len(self.rows), device=self.engine.device)
            self.cache.batch_select_indices(rows)

    def _record(self, rows: int) -> None:
        """Update the counts and tell ``on_step`` of the forward just run over ``rows`` rows:
        the tokens generated since the last record (each mixed forward is recorded as it
        happens, so timelines and the progress bar never stall through an admission)."""
        stats = self.stats
        stats.running, stats.queued = len(self.rows), len(self.queue)
        tokens, self._recorded = stats.generated_tokens - self._recorded, stats.generated_tokens
        if self.on_step is not None:
            record = StepRecord(
                time_s=self.engine.clock(),
                rows=rows,
                tokens=tokens,
                queued=stats.queued,
                paused=stats.paused,
                kv_bytes=stats.kv_bytes,
            )
            self.on_step(record)

    # ---- admission, prefill, preemption ---------------------------------------------------

    def _admit(self) -> list[StreamResult]:
        """Prefill the waiting requests that fit (FIFO) and merge them into the running rows."""
        joining: list[_Row] = []
        done: list[StreamResult] = []
        packed = 0
        while self.queue and len(joining) + packed < self.prefill_rows:
            running = [row.shape for row in self.rows]
            head = self.queue[0]
            if head.request.max_new_tokens == 0:
                done.append(self._result(self.queue.popleft(), "length"))
                continue
            prompt, new = len(head.request.prompt_ids), head.request.max_new_tokens
            error = prompt_length_error(prompt, self.context, new)
            if error is None and not self._fits_static([head]):
                reason, error = "context_exceeded", self._too_long(head)
                done.append(self._result(self.queue.popleft(), reason, error))
                continue
            if error is not None:  # past the context, positions are garbage: never run it
                alone = self.context is not None and prompt > self.context[0]
                reason = "prompt_too_long" if alone else "context_exceeded"
                done.append(self._result(self.queue.popleft(), reason, error))
                continue
            if joining and not self._fits_prefill([*joining, head]):
                break
            if not self._admits(running, [r.shape for r in [*joining, head]]):
                if not running and not joining:  # nothing will ever leave to make room
                    done.append(self._refused(self.queue.popleft()))
                    continue
                break
            if self.packing and self.rows and not joining:
                rows = len(self.rows) + 1
                self.stats.peak_rows = max(self.stats.peak_rows, rows)
                done += self._prefill_packed(self.queue.popleft())
                self._record(rows)
                packed += 1
                continue
            joining.append(self.queue.popleft())
        if joining:
            done += self._prefill(joining)
        return done

    def _fits_prefill(self, rows: list[_Row]) -> bool:
        """Whether ``rows`` prefill together within ``prefill_tokens`` (padding counted) and,
        in static caches, every row's padded prompt and new tokens within their length."""
        if not self._fits_static(rows):
            return False
        longest = max(len(row.request.prompt_ids) for row in rows)
        return self.prefill_tokens is None or len(rows) * longest <= self.prefill_tokens

    def _fits_static(self, rows: list[_Row]) -> bool:
        """Whether ``rows``, prefilled together (left-padded to the longest prompt), keep their
        new tokens within the static caches' ``max_cache_len`` (growing caches: always)."""
        if self.max_cache_len is None:
            return True
        longest = max(len(row.request.prompt_ids) for row in rows)
        most = max(row.request.max_new_tokens for row in rows)
        return longest + most <= self.max_cache_len

    def _too_long(self, row: _Row) -> str:
        prompt, new = len(row.request.prompt_ids), row.request.max_new_tokens
        return (
            f"a prompt of {prompt} tokens with max_new_tokens={new} passes the "
            f"max_cache_len={self.max_cache_len} of the compiled step's static caches"
        )

    def _prefill(self, joining: list[_Row]) -> list[StreamResult]:
        """Prefill ``joining`` in a cache of their own, pick their first tokens, merge."""
        state = _padded_state(joining, self.engine.pad, self.engine.device)
        cache = self._new_cache()
        tokens = self.engine.step(state, cache)
        state.advance(tokens)
        first = len(self.rows)
        self._join(joining, cache, state)
        return self._leave(self._append(tokens, first))

    def _prefill_packed(self, row: _Row) -> list[StreamResult]:
        """Prefill ``row`` in the running rows' next decode step (one mixed forward), pick the
        tokens of both, let finished rows leave, and merge the newcomer after the others."""
        state = _padded_state([row], self.engine.pad, self.engine.device)
        cache = self._new_cache()
        packed = PackedCache(self.cache, cache, len(self.rows))
        running_logits, prompt_logits = self.engine.forward_packed(self.state, state, packed)
        tokens = self.engine.choose(self.state, running_logits)
        self.state.advance(tokens)
        first = self.engine.choose(state, prompt_logits)
        state.advance(first)
        done = self._leave(self._append(tokens, 0))
        self._join([row], cache, state)
        return done + self._leave(self._append(first, len(self.rows) - 1))

    def _admits(self, running: list[RowShape], joining: list[RowShape]) -> bool:
        """The admission rule's answer for the rows as their caches hold them: a static cache
        holds every row's slot space for ``max_cache_len`` tokens whatever its length, and the
        copies that fill a compiled step's bucket hold as much."""
        if self.max_cache_len is None:
            return self.admission.admits(running, joining)
        return self.admission.admits(self._static(len(running) + len(joining)), [])

    def _fits(self, running: list[RowShape]) -> bool:
        """:meth:`_admits` for the running rows' next step."""
        if self.max_cache_len is None:
            return self.admission.fits(running)
        return self.admission.fits(self._static(len(running)))

    def _static(self, rows: int) -> list[RowShape]:
        """``rows`` rows of static caches as their bytes count, with the copies of a compiled
        step's bucket."""
        held = batch_bucket(rows, self.admission.max_rows) if self._compiled else rows
        return [RowShape(self.max_cache_len, 0)] * held

    def _new_cache(self) -> AlisaCache:
        if self.max_cache_len is None:
            return self.new_cache()
        return self.new_cache(max_cache_len=self.max_cache_len)

    def _join(self, rows: list[_Row], cache: AlisaCache, state: DecodeState) -> None:
        """Rows past their prefill (new or resumed) join the running ones, after them."""
        self._unfill()
        self.rows.extend(rows)
        if self.cache is None:
            cache.trim()  # as extend() trims the rows joining: sizing counts kept tokens
            self.cache, self.state = cache, state
        else:
            self.cache.extend(cache)
            self.state.extend(state, pad=self.engine.pad)

    def _make_room(self) -> None:
        """Pause the newest row while the running rows do not fit their next step (the
        oldest always stays: alone it fits, or it would not have been admitted)."""
        while len(self.rows) > 1 and not self._fits([row.shape for row in self.rows]):
            newest = max(range(len(self.rows)), key=lambda index: self.rows[index].order)
            self._pause(newest)

    def _pause(self, index: int) -> None:
        """Row ``index`` leaves the batch for host memory, its state intact."""
        self._unfill()
        row = self.rows.pop(index)
        chosen = torch.tensor([index], device=self.engine.device)
        cache = swap_out(self.cache.take_rows(chosen), self.engine.device)
        row.paused += 1
        self.paused.append(_Paused(row=row, cache=cache, state=self.state.take(chosen)))
        self.paused.sort(key=lambda entry: entry.row.order)
        self.stats.preemptions += 1
        self._note_kv()

    def _resume(self) -> None:
        """Bring paused rows back (oldest first) while the admission rule allows them, or
        the first one whatever it says when nothing runs."""
        while self.paused:
            entry = self.paused[0]
            running = [row.shape for row in self.rows]
            if self.rows and not self._admits([*running, entry.row.shape], []):
                return
            self.paused.pop(0)
            self._join([entry.row], entry.cache.swap_in(), entry.state)
            self._note_kv()

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
        results = []
        for index in leaving:
            row = self.rows[index]
            stopped = row.tokens[-1] in self.engine.eos_ids
            results.append(self._result(row, "stop" if stopped else "length"))
        self._remove(set(leaving))
        return results

    def _remove(self, gone: set[int]) -> None:
        """Rows ``gone`` leave the cache and the state; the others keep their order."""
        kept = [index for index in range(len(self.rows)) if index not in gone]
        self.rows = [self.rows[index] for index in kept]
        if not kept:
            self.cache = self.state = None
        else:
            indices = torch.tensor(kept, device=self.engine.device)
            self.cache.keep_rows(indices)
            self.state.keep(indices)
        self._note_kv()

    def _note_kv(self) -> None:
        held = self.cache.tier_bytes()["device"] if self.cache is not None else 0
        self.stats.kv_bytes, self.stats.paused = held, len(self.paused)
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
            paused=row.paused,
        )

    def _refused(self, row: _Row) -> StreamResult:
        shape = row.shape
        error = (
            f"a prompt of {shape.tokens} tokens with max_new_tokens={shape.new_tokens} "
            "does not fit the admission rule even alone"
        )
        return self._result(row, "did_not_fit", error)


def packs(model: torch.nn.Module) -> bool:
    """Whether a mixed forward computes for ``model`` what two forwards would: every layer full
    attention (a sliding window would need each part's own window mask) and positions from
    ``position_ids`` alone, through a rotary embedding (learned or ALiBi positions may be
    derived from the padding mask)."""
    adapter = ModelAdapter.of(model)
    return not adapter.shape.hybrid and adapter.rotary is not None


def _padded_state(rows: list[_Row], pad: int, device: torch.device) -> DecodeState:
    """The newcomers' prompts, left-padded to the longest (no mask for one row)."""
    prompts = [list(row.request.prompt_ids) for row in rows]
    width = max(len(ids) for ids in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = None
    if any(len(p) < width for p in prompts):
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return DecodeState.start(ids, mask)
