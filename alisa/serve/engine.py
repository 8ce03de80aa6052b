"""The engine thread: the one thread that runs the model, through continuous schedulers.

It is the thread that loaded the model (``alisa serve`` runs it on the main thread, and HTTP on
another, :class:`~alisa.serve.server.AlisaServer`): GNU OpenMP, which runs torch's CPU
operators, keeps a pool of worker threads for each thread that has run a parallel operator, and
once its threads outnumber the CPUs its workers spin only briefly between operators before they
sleep (``GOMP_SPINCOUNT``'s documented throttling), so that each operator waits for its workers
to wake. Computing on a second thread after loading on the first made each decode step about a
third slower on a 2-core CPU (``docs/results.md``, "Serving on the thread that loaded the
model").

Requests come in through a thread-safe inbox (:meth:`ServeEngine.submit`, :meth:`cancel`); the
thread takes them between scheduler steps, so the HTTP event loop never waits for a forward and
a cancelled request leaves the batch (its KV freed) before the next step. What a request gets
(text deltas, its end) goes back through the ``deliver`` callback it brought, which hands it to
the request's event loop (``loop.call_soon_threadsafe``).

Rows of one scheduler share one sampling rule, one cache config and one EOS rule
(:class:`Engine` picks with one :class:`SamplingOptions`; a batch's cache has one config). So
requests are grouped by (cache config, sampling, ``ignore_eos``): one group runs at a time,
holding the whole budget; while requests of another group wait, the running group takes no
newcomers and finishes its rows, then the group with the oldest waiting request runs (taking
every waiting request of its own). Greedy requests of the server's cache settings, the common
case, all share one batch.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from alisa.config import AlisaConfig
from alisa.jobs.stream import ByteBudget
from alisa.kv.attention import attached
from alisa.kv.cache import AlisaCache
from alisa.ops.backends import model_ops
from alisa.ops.products import WeightProducts
from alisa.runtime.compiled import choose_compile, compiled_decode, rows_capacity
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import Engine
from alisa.runtime.generate import rows_compile
from alisa.runtime.requests import StreamRequest, StreamResult
from alisa.runtime.sampling import SamplingOptions
from alisa.serve.errors import APIError, bad_request, internal_error
from alisa.serve.metrics import ServeMetrics
from alisa.serve.prepare import Prepared
from alisa.serve.settings import ServeSettings
from alisa.serve.text import TextStream

logger = logging.getLogger("alisa.serve")

# The scheduler's reasons for a request it will never run (the server checks for them first).
REFUSALS = ("did_not_fit", "prompt_too_long", "context_exceeded")


@dataclass(frozen=True)
class Delta:
    """New text of a streamed answer, and the tokens that brought it."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    """The end of an answer: the rest of its text (``delta``, for streams), all of it, its
    tokens and why it ended (``stop``: EOS or a stop string; ``length``: ``max_tokens``)."""

    delta: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request could not be answered."""

    error: APIError


Event = Delta | Finished | Failed
# What the rows of one scheduler share: cache config, sampling, and whether EOS ends a row.
GroupKey = tuple[AlisaConfig, SamplingOptions, bool]


@dataclass(eq=False, kw_only=True)
class Job:
    """One accepted request, as the engine thread keeps it.

    Parameters
    ----------
    prepared
        Its tokens, length and cache config.
    sampling
        How its tokens are picked.
    stop
        Strings that end it.
    stream
        Deliver a :class:`Delta` as text comes (else only the :class:`Finished`).
    ignore_eos
        EOS does not end it (its ``max_tokens`` are all generated).
    deliver
        Hands an event to the request (called on the engine thread; must not block).
    """

    prepared: Prepared
    sampling: SamplingOptions
    deliver: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    stream: bool = False
    ignore_eos: bool = False
    id: int = -1
    arrival_s: float = field(default_factory=time.perf_counter)
    text: TextStream | None = None
    received: int = 0  # tokens handed over so far
    last_token_s: float = 0.0

    @property
    def key(self) -> GroupKey:
        """What rows sharing a batch must share."""
        return self.prepared.config, self.sampling, self.ignore_eos


@dataclass(eq=False)
class _Group:
    """A scheduler and the jobs it holds, by id."""

    key: GroupKey
    scheduler: ContinuousScheduler
    jobs: dict[int, Job] = field(default_factory=dict)
    preemptions: int = 0  # the scheduler's count already added to the metric


class ServeEngine:
    """Owns the model and its schedulers, on the thread that calls :meth:`run` (or one of its
    own, :meth:`start`).

    Parameters
    ----------
    model, tokenizer
        The served model.
    settings
        Budgets, rows and queue limits.
    metrics
        Updated as requests start, step and end.
    """

    def __init__(self, model, tokenizer, settings: ServeSettings, metrics: ServeMetrics) -> None:
        from alisa.model.adapter import model_shape
        from alisa.planning.spec import model_spec

        self.model, self.tokenizer = model, tokenizer
        self.settings, self.metrics = settings, metrics
        self.spec = model_spec(model, model_shape(model))
        self.eos_ids = Engine(model, tokenizer).eos_ids
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the counts the HTTP side reads
        self._waiting = 0  # accepted, not started
        self._open = 0  # accepted, not finished
        self._ids = itertools.count()
        self._pending: deque[Job] = deque()  # accepted, not in a scheduler (engine thread)
        self._active: _Group | None = None
        # The weights' product form measured per form asked (alisa.ops.products), kept for the
        # server's life: each group's scheduler goes on with it instead of measuring afresh.
        self._products: dict[str, WeightProducts] = {}
        # The decode step compiled once for the server's life (its graphs, one per bucket of
        # rows, serve every group), settled for the default config before anything runs.
        device = next(model.parameters()).device
        choice = rows_compile(
            choose_compile(settings.compile, device), model, settings.config, settings.max_tokens
        )
        self.compile = choice  # what the decode steps of the default config run as, and why
        self._decode = compiled_decode(model, choice)
        self._capacity = rows_capacity(model, choice, settings.max_cache_len)
        self._thread: threading.Thread | None = None  # the engine's own, when start()ed
        self._ready = threading.Event()
        self._running = False  # the loop has begun (on whichever thread runs it)
        self._stopped = False  # no more submits: the engine thread has left its loop
        self.failure: str | None = None  # why the engine thread stopped, if it failed
        metrics.waiting.set_function(lambda: self.waiting)  # read at each scrape

    @property
    def waiting(self) -> int:
        """Requests accepted and not started."""
        with self._lock:
            return self._waiting

    # ---- the HTTP side ----------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine on a thread of its own; returns once it has routed the model's
        attention through alisa (so that checking a request's config, which builds a cache,
        changes nothing). :meth:`run` on the thread that loaded the model computes faster."""
        self._thread = threading.Thread(target=self.run, name="alisa-engine", daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def alive(self) -> bool:
        """Whether the engine's loop runs (started, not yet stopped or failed)."""
        return self._running and not self._stopped

    @property
    def open_requests(self) -> int:
        """Requests accepted and not finished (a draining server exits when it reaches 0)."""
        with self._lock:
            return self._open

    def submit(self, job: Job) -> None:
        """Queue ``job`` (its ``id`` is set here).

        Raises
        ------
        APIError
            503 at once when ``max_queue`` requests wait already, or the engine is not running.
        """
        limit = self.settings.max_queue
        with self._lock:  # held to the put: a job is either refused here or failed at the stop
            if self._stopped or not self.alive:
                raise APIError(
                    status=503, message="the engine is not running", code="engine_stopped"
                )
            if self._waiting >= limit:
                raise APIError(
                    status=503,
                    message=f"the server's queue is full ({limit} requests waiting, --max-queue "
                    f"{limit}); retry later",
                    code="queue_full",
                )
            self._waiting += 1
            self._open += 1
            job.id = next(self._ids)
            self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Drop ``job`` before the engine's next step (a no-op once it finished)."""
        self._inbox.put(("cancel", job))

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine after its current step; requests still open fail (503). Waits up to
        ``timeout`` for a thread :meth:`start` began; returns at once otherwise."""
        self._inbox.put(("stop", None))
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------

    def run(self, ready: Callable[[], None] | None = None) -> None:
        """Run the engine on the calling thread until :meth:`stop` (or a failure, logged and
        kept in :attr:`failure`); requests still open then fail (503).

        ``ready`` is called once the model's attention is routed through alisa, before the
        first request is taken: where the HTTP side starts.
        """
        self._running = True
        try:
            with attached(self.model):  # the model's attention is restored when it stops
                self._ready.set()
                if ready is not None:
                    ready()
                while self._take(block=self._active is None and not self._pending):
                    self._schedule()
                    if self._active is not None:
                        self._step(self._active)
        except BaseException as error:  # noqa: BLE001 - the server must say it, not hang
            logger.exception("the engine thread failed")
            self.failure = f"{type(error).__name__}: {error}"
        self._ready.set()  # a thread that failed to start must not leave start() waiting
        with self._lock:
            self._stopped = True
        self._fail_all(APIError(status=503, message="the server stopped", code="server_stopped"))

    def _take(self, block: bool) -> bool:
        """Apply the inbox's messages (waiting for one when ``block``); False on stop."""
        try:
            message = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, job = message
            if kind == "stop":
                return False
            if kind == "submit":
                self._pending.append(job)
            else:
                self._cancel(job)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _schedule(self) -> None:
        """Pick the group that runs: the running one until it drains, then the one whose
        request waited longest; hand the chosen group its waiting requests."""
        group = self._active
        if group is not None and group.scheduler.idle:
            self._active = group = None
            self._note(None)
        if not self._pending:
            return
        if group is None:
            key = self._pending[0].key
            try:
                group = _Group(key=key, scheduler=self._scheduler(*key))
            except Exception:  # noqa: BLE001 - a config the model refuses
                logger.exception("could not start a scheduler")
                for job in [job for job in self._pending if job.key == key]:
                    self._pending.remove(job)
                    self._end(job, Failed(internal_error("generation")), "error")
                return
            self._active = group
        elif any(job.key != group.key for job in self._pending):
            return  # others wait: the running group finishes its rows first, takes no more
        for job in [job for job in self._pending if job.key == group.key]:
            self._pending.remove(job)
            self._begin(group, job)

    def _scheduler(
        self, config: AlisaConfig, sampling: SamplingOptions, ignore_eos: bool
    ) -> ContinuousScheduler:
        settings = self.settings
        admission = ByteBudget(
            spec=self.spec,
            config=config,
            device_bytes=settings.device_bytes,
            kv_bytes=settings.kv_bytes,
            max_rows=settings.max_rows,
            reserve_tokens=settings.reserve_tokens,
        )
        form = model_ops(self.model, config.kernels).products
        products = self._products.setdefault(form, WeightProducts(form))
        decode = self._decode
        if decode is not None and config != settings.config:  # a request's own settings
            try:
                settled = rows_compile(decode.choice, self.model, config, settings.max_tokens)
            except ValueError as refusal:  # "on", and a mode without static rows
                settled = decode.choice.eager(str(refusal))
            if not settled.compiled:  # those requests run eager, said once per group
                logger.warning("decode steps eager for these requests: %s", settled.reason)
                decode = None
        return ContinuousScheduler(
            Engine(
                self.model,
                self.tokenizer,
                sampling,
                stop_at_eos=not ignore_eos,
                products=products,
                compiled=decode,
            ),
            partial(AlisaCache, self.model, admission.cache_config),
            admission,
            prefill_tokens=settings.prefill_tokens,
            packing=settings.packing,
            max_cache_len=None if decode is None else self._capacity,
        )

    def _begin(self, group: _Group, job: Job) -> None:
        prepared = job.prepared
        job.text = TextStream(self.tokenizer, job.stop, self.eos_ids)
        group.jobs[job.id] = job
        try:
            group.scheduler.submit(
                StreamRequest(
                    prompt_ids=list(prepared.prompt_ids),
                    max_new_tokens=prepared.max_tokens,
                    id=job.id,
                    arrival_s=job.arrival_s,
                )
            )
        except ValueError as refusal:  # one request's refusal ends that request, not the engine
            del group.jobs[job.id]
            self._end(job, Failed(bad_request(str(refusal), "prompt")), "error")

    def _step(self, group: _Group) -> None:
        """One scheduler step; hand out its tokens; end the rows that finished or stopped."""
        started = time.perf_counter()
        try:
            results = group.scheduler.step()
        except Exception:  # noqa: BLE001 - one batch's failure must not stop the server
            logger.exception("a scheduler step failed")
            for job in list(group.jobs.values()):
                self._end(job, Failed(internal_error("generation")), "error")
            self._active = None
            self._note(None)
            return
        now = time.perf_counter()
        self.metrics.steps.inc()
        self.metrics.step_seconds.observe(now - started)
        for request_id, tokens in group.scheduler.progress():
            job = group.jobs[request_id]
            if len(tokens) > job.received:
                self._receive(job, tokens[job.received :], now)
        ended = []
        for result in results:
            job = group.jobs.pop(result.id)
            self._receive(job, result.token_ids[job.received :], now)
            ended.append((job, "stop" if job.text.stopped else result))
        for job in [job for job in group.jobs.values() if job.text.stopped]:
            group.scheduler.cancel(job.id)  # a stop string ended it: its KV goes now
            del group.jobs[job.id]
            ended.append((job, "stop"))
        self._note(group)  # before the answers go: a client that reads /metrics next sees it
        for job, end in ended:
            if end == "stop":  # a stop string came with its last tokens
                self._end(job, self._finished(job, "stop"), "stop")
            else:
                self._finish(job, end)

    def _receive(self, job: Job, tokens: list[int], now: float) -> None:
        """Count, time and hand out a job's new tokens."""
        if not tokens or job.text.stopped:
            return
        tokens = tokens[: job.text.add(tokens)]  # none after a stop string's last token
        metrics = self.metrics
        if job.received == 0:
            metrics.ttft.observe(now - job.arrival_s)
            metrics.prompt_tokens.inc(len(job.prepared.prompt_ids))
            with self._lock:
                self._waiting -= 1
        else:
            gap = (now - job.last_token_s) / len(tokens)
            for _ in tokens:
                metrics.itl.observe(gap)
        metrics.generation_tokens.inc(len(tokens))
        job.received += len(tokens)
        job.last_token_s = now
        if job.stream:  # every step's tokens, with whatever text is final (maybe none)
            job.deliver(Delta(job.text.delta(), tuple(tokens)))

    def _finish(self, job: Job, result: StreamResult) -> None:
        """End a job the scheduler finished (or refused)."""
        if result.finish_reason in REFUSALS:  # the server checks these first: a safety net
            error = APIError(status=400, message=result.error or result.finish_reason)
            self._end(job, Failed(error), "error")
            return
        self._end(job, self._finished(job, result.finish_reason), result.finish_reason)

    def _finished(self, job: Job, reason: str) -> Finished:
        text = job.text
        return Finished(
            delta=text.delta(final=True),
            text=text.text,
            token_ids=tuple(text.tokens),
            finish_reason=reason,
            prompt_tokens=len(job.prepared.prompt_ids),
        )

    def _cancel(self, job: Job) -> None:
        """The client left: drop the job wherever it is, its KV freed now."""
        if job in self._pending:
            self._pending.remove(job)
        elif self._active is not None and job.id in self._active.jobs:
            self._active.scheduler.cancel(job.id)
            del self._active.jobs[job.id]
            self._note(self._active)
        else:
            return  # it finished before the cancel came
        self._end(job, None, "cancelled")

    def _end(self, job: Job, event: Event | None, reason: str) -> None:
        """Count how the job ended, then tell its request (which may read the counts next)."""
        self.metrics.finished.labels(reason=reason).inc()
        if job.received:
            self.metrics.latency.observe(time.perf_counter() - job.arrival_s)
        with self._lock:
            self._open -= 1
            if not job.received:
                self._waiting -= 1
        if event is not None:
            job.deliver(event)

    def _fail_all(self, error: APIError) -> None:
        jobs = list(self._pending)
        self._pending.clear()
        if self._active is not None:
            jobs += self._active.jobs.values()
            self._active = None
        while True:  # requests that came after the stop
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                jobs.append(job)
        for job in jobs:
            self._end(job, Failed(error), "error")

    def _note(self, group: _Group | None) -> None:
        """The gauges after a step or a cancel."""
        metrics = self.metrics
        if group is None:
            for gauge in (metrics.running, metrics.paused):
                gauge.set(0)
            for tier in ("device", "host"):
                metrics.kv_bytes.labels(tier=tier).set(0)
            return
        scheduler = group.scheduler
        metrics.running.set(len(scheduler.rows))
        metrics.paused.set(len(scheduler.paused))
        metrics.kv_bytes.labels(tier="device").set(scheduler.stats.kv_bytes)
        host = scheduler.cache.tier_bytes()["host"] if scheduler.cache is not None else 0
        # A paused row's KV waits in host memory, every tier of it.
        host += sum(sum(entry.cache.held.tier_bytes().values()) for entry in scheduler.paused)
        metrics.kv_bytes.labels(tier="host").set(host)
        new = scheduler.stats.preemptions - group.preemptions
        if new:
            metrics.preemptions.inc(new)
            group.preemptions = scheduler.stats.preemptions
