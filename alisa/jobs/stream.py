"""A stream of prompts through continuous batching under a byte budget: results as they finish."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial

from alisa.checks import check_bool, check_int, unordered
from alisa.config import AlisaConfig, config_or_default
from alisa.jobs.sizing import BatchMemory, fits, ring_refusal_note, rows_host, running_memory
from alisa.kv.attention import attached
from alisa.kv.cache import AlisaCache
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.compiled import choose_compile, rows_capacity, static_row_note
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import Engine
from alisa.runtime.generate import check_prompt, rows_compile
from alisa.runtime.requests import PREFILL_TOKENS, RowShape, StreamRequest, StreamResult
from alisa.runtime.sampling import RepeatedPrompts, SamplingOptions, sampling_or_default
from alisa.settings import check_host_admission, check_untiered, no_host_region
from alisa.sizes import parse_budget
from scheduler import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ByteBudget:
    """Admits rows while the batch's predicted peak fits the budgets
    (:func:`alisa.jobs.sizing.running_memory`: each row's device KV at its bounded size,
    rectangular slots, the newcomers' prefill; with ``retention="host"`` the host regions).

    Parameters
    ----------
    spec, config
        The model's sizes and the cache's config. Its ``host_memory`` is the budget of the host
        regions of ``retention="host"``, counted over the whole batch here (the caches are
        built with :attr:`cache_config`, which leaves it out: each would check only itself).
    device_bytes
        Budget for weights, KV and activations; None: no limit.
    kv_bytes
        Budget for the KV alone; None: no limit.
    max_rows
        Rows at most, whatever the budgets allow.
    reserve_tokens
        None: a row is admitted with room for all its ``max_new_tokens`` (rows never outgrow
        what was reserved). A count: with room for that many more tokens only (more rows run;
        most answers stop at EOS long before their limit), and when the running rows would
        exceed a budget at their next step the scheduler pauses the newest in host memory,
        token-identically. A request must still fit alone at its full length to be admitted.
    """

    spec: ModelSpec
    config: AlisaConfig
    device_bytes: int | None = None
    kv_bytes: int | None = None
    max_rows: int = 64
    reserve_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "kv_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive byte count or None")
        check_int("max_rows", self.max_rows, minimum=1)  # 1.5 too: a count of rows
        reserve = self.reserve_tokens
        if reserve is not None and (
            isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0
        ):
            raise ValueError(f"reserve_tokens={reserve!r} must be an integer >= 0 or None")
        check_host_admission(self.config, reserve)
        host = self.config.host_memory if self.config.retention == "host" else None
        if host is not None and not rows_host(self.spec, self.config, [(1, 1)]):
            raise no_host_region(host)

    @cached_property
    def host_bytes(self) -> int | None:
        """The host regions' budget in bytes (``config.host_memory``; None: no limit)."""
        return self.config.host_memory_bytes

    @cached_property
    def cache_config(self) -> AlisaConfig:
        """The config each row's cache is built with: :attr:`config` without ``host_memory``
        under ``retention="host"``, where admission counts it over the batch (a cache's own
        check would count only its rows, for the cache's ``max_new_tokens``, not theirs); kept
        otherwise, for the cache to refuse as having no effect."""
        if self.config.host_memory is None or self.config.retention != "host":
            return self.config
        return self.config.with_overrides(host_memory=None)

    def admits(self, running: Sequence[RowShape], joining: Sequence[RowShape]) -> bool:
        if len(running) + len(joining) > self.max_rows:
            return False
        if self.reserve_tokens is not None and not all(
            self._fit(running_memory(self.spec, self.config, [], [_full(row)])) for row in joining
        ):
            return False  # it could never finish, even alone
        memory = running_memory(
            self.spec,
            self.config,
            [self._reserved(row) for row in running],
            [self._reserved(row) for row in joining],
        )
        return self._fit(memory)

    def fits(self, running: Sequence[RowShape]) -> bool:
        """Whether the running rows' next step stays within the budgets (the tokens they hold
        plus the step's new one, whatever was reserved)."""
        if len(running) > self.max_rows:
            return False
        if self.reserve_tokens is None:  # every row was admitted with room for all its tokens
            return True
        memory = running_memory(self.spec, self.config, [(row.tokens, 0) for row in running])
        return self._fit(memory)

    def _reserved(self, row: RowShape) -> tuple[int, int]:
        ahead = row.new_tokens if self.reserve_tokens is None else self.reserve_tokens
        return row.tokens, min(row.new_tokens, ahead)

    def _fit(self, memory) -> bool:
        return fits(memory, self.device_bytes, self.kv_bytes, self.host_bytes)


def _full(row: RowShape) -> tuple[int, int]:
    return row.tokens, row.new_tokens


def over_budget(
    need: BatchMemory,
    device: int | None,
    device_name: str,
    kv: int | None,
    kv_name: str,
    host: int | None = None,
    host_name: str = "",
) -> str:
    """What a request that fits no budget alone needs, and the budget it exceeds, for its error
    (``alisa batch``'s rows and :func:`stream_generate`'s results say it alike).

    Parameters
    ----------
    need
        The request's predicted memory alone (:func:`alisa.jobs.sizing.running_memory`).
    device, device_name, kv, kv_name, host, host_name
        The device, KV and host-region budgets in bytes (None: no limit) and how the message
        names them (``"--kv-memory 1KB"``, ``"kv_memory='1KB'"``).

    Returns
    -------
    str
        ``"18944 bytes of KV, over the KV budget --kv-memory 1KB (1000 bytes)"`` when the KV
        budget is exceeded, the host regions over the host budget when that one is, else the
        whole (weights included) over the device budget.
    """
    if kv is not None and need.kv > kv:
        return f"{need.kv} bytes of KV, over the KV budget {kv_name} ({kv} bytes)"
    if host is not None and need.host > host:
        return (
            f"{need.host} bytes of host region (retention='host'), over the host budget "
            f"{host_name} ({host} bytes)"
        )
    return (
        f"{need.total} bytes ({need.kv} of KV), over the device budget {device_name} "
        f"({device} bytes)"
    )


def stream_generate(
    model,
    tokenizer,
    prompts: str | StreamRequest | Iterable[str | StreamRequest],
    config: AlisaConfig | None = None,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingOptions | None = None,
    gpu_memory: int | str | None = None,
    kv_memory: int | str | None = None,
    max_rows: int = 64,
    prefill_rows: int = 8,
    prefill_tokens: int | None = PREFILL_TOKENS,
    reserve_tokens: int | None = None,
    stop_at_eos: bool = True,
    compile: str = "auto",
    max_cache_len: int | None = None,
) -> Iterator[StreamResult]:
    """Complete a stream of prompts with continuous batching; results in completion order.

    Rows leave the batch the step they finish and waiting prompts join while the predicted
    memory fits ``gpu_memory`` / ``kv_memory`` (:class:`ByteBudget`). Each result carries its
    own TTFT (from when the prompt was read) and finish reason.

    Parameters
    ----------
    prompts
        Strings (``max_new_tokens`` each) or :class:`StreamRequest` (token ids, own length and
        id); read lazily, a few rows ahead, so an endless iterator is fine. One string (or one
        request) is one prompt, as in :func:`alisa.generate`. A request without an ``id`` gets
        its arrival index; two requests with one id are refused (the id is what tells results,
        which come in completion order, apart).
    config
        The cache's KV policy and storage (device tiers, ``gpu_memory`` in the config, are not
        supported: their layout is planned per batch).
    gpu_memory, kv_memory
        Byte budgets (``"8GiB"``) for weights + KV + activations, and for the KV alone; a
        ``gpu_memory`` the weights alone fill is refused.
    max_rows, prefill_rows, prefill_tokens
        Rows running at most; newcomers prefilled together at most, and their padded prompt
        tokens (rows x longest) in that forward at most (None: no bound).
    reserve_tokens
        Admit rows with room for this many new tokens rather than all of them; rows that
        outgrow it are paused in host memory and resumed (see :class:`ByteBudget`).
    compile
        Decode steps through ``torch.compile`` (:mod:`alisa.runtime.continuous`: one graph
        per bucket of rows, rows joining and leaving static caches): ``"auto"`` where that
        pays on the model's device (CUDA) and the mode has a static step, ``"on"`` forced
        (refused for a mode without one), ``"off"`` never. The tokens are the same.
    max_cache_len
        Tokens per row (prompt and new tokens) of the static caches of compiled steps,
        rounded up to a capacity bucket (:func:`~alisa.runtime.compiled.compiled_capacity`);
        a prompt that needs more ends ``"context_exceeded"``. None: the model's context.

    Yields
    ------
    StreamResult
        One per prompt; ``finish_reason="did_not_fit"`` for a prompt the budget refuses alone
        (``error`` quotes the bytes it needs and the budget), ``"prompt_too_long"`` /
        ``"context_exceeded"`` for one that, alone or with its ``max_new_tokens``, is longer
        than the model's context (never run; ``error`` says why).

    Raises
    ------
    ValueError
        Prompts of the wrong type (a dict, bytes, a non-string item; an empty one or one
        holding a lone surrogate), a flag that is not True or False, a budget the weights alone
        fill, or an id given twice, naming them; a prompt's when it is read.
    """
    prompts = _prompt_stream(prompts)
    check_bool("stop_at_eos", stop_at_eos)
    config = config_or_default(config)
    check_untiered(config, "stream_generate", "stream_generate(gpu_memory=...)")
    spec = model_spec(model, model_shape(model))
    admission = ByteBudget(
        spec=spec,
        config=config,
        device_bytes=None if gpu_memory is None else parse_budget(gpu_memory, field="gpu_memory"),
        kv_bytes=None if kv_memory is None else parse_budget(kv_memory, field="kv_memory"),
        max_rows=max_rows,
        reserve_tokens=reserve_tokens,
    )
    _check_weights_fit(admission, gpu_memory)
    sampling = sampling_or_default(sampling)
    device = next(model.parameters()).device
    compiled = rows_compile(choose_compile(compile, device), model, config, max_new_tokens)
    capacity = rows_capacity(model, compiled, max_cache_len)
    engine = Engine(model, tokenizer, sampling, stop_at_eos=stop_at_eos, compile=compiled)
    scheduler = ContinuousScheduler(
        engine,
        partial(AlisaCache, model, admission.cache_config),
        admission,
        prefill_rows=prefill_rows,
        prefill_tokens=prefill_tokens,
        max_cache_len=capacity,
    )
    # The scheduler checks each request's ids against the vocabulary as it queues it.
    pending: dict[object, StreamRequest] = {}  # by id, until its result comes
    seed = sampling.seed if sampling.do_sample else None  # None: no repeat to warn of
    requests = _requests(tokenizer, prompts, max_new_tokens, pending, seed)
    with attached(model):  # the model's attention is restored when the stream ends
        for result in scheduler.run(requests, lookahead=max_rows):
            request = pending.pop(result.id)
            if result.finish_reason == "did_not_fit":  # the scheduler knows no bytes: say them
                error = _refusal(admission, request, gpu_memory, kv_memory, capacity)
                result = replace(result, error=error)
            yield result


def _check_weights_fit(admission: ByteBudget, gpu_memory: int | str | None) -> None:
    """A device budget the weights alone fill would refuse every prompt: say so once (as
    ``alisa batch`` does), not as each prompt's ``did_not_fit``."""
    weights = admission.spec.total_weight_bytes
    if admission.device_bytes is not None and admission.device_bytes <= weights:
        raise ValueError(
            f"gpu_memory={gpu_memory!r} ({admission.device_bytes} bytes) is smaller than the "
            f"weights ({weights} bytes): no prompt could run; raise it"
        )


def _refusal(
    admission: ByteBudget,
    request: StreamRequest,
    gpu_memory: int | str | None,
    kv_memory: int | str | None,
    static: int | None = None,
) -> str:
    """Why ``request`` never ran: the bytes it needs even alone and the budget they exceed,
    as ``alisa batch`` says it; ``static``: the ``max_cache_len`` of compiled steps' static
    caches, whose slot space a row holds whatever its length."""
    tokens, new = len(request.prompt_ids), request.max_new_tokens
    held = (tokens, new) if static is None else (static, 0)
    need = running_memory(admission.spec, admission.config, [], [held])
    over = over_budget(
        need,
        admission.device_bytes,
        f"gpu_memory={gpu_memory!r}",
        admission.kv_bytes,
        f"kv_memory={kv_memory!r}",
        admission.host_bytes,
        f"config.host_memory={admission.config.host_memory!r}",
    )
    error = f"a prompt of {tokens} tokens with max_new_tokens={new} needs about {over} even alone"
    if static is not None:
        hint = static_row_note(static)
    else:
        hint = ring_refusal_note(admission.spec, admission.config, tokens, new)
    return f"{error}: {hint}" if hint else error


def _prompt_stream(prompts) -> Iterable[str | StreamRequest]:
    """``prompts`` as an iterable of prompts: one string or request is one prompt (iterating a
    string would make each character a prompt)."""
    if isinstance(prompts, str | StreamRequest):
        return [prompts]
    if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts={prompts!r} must be a string, a StreamRequest or an iterable of them"
        )
    kind = unordered(prompts)
    if kind is not None:
        raise ValueError(
            f"prompts={prompts!r} must be a string, a StreamRequest or an iterable of them, "
            f"not {kind}"
        )
    return prompts


def _requests(
    tokenizer,
    prompts: Iterable[str | StreamRequest],
    max_new_tokens: int,
    pending: dict[object, StreamRequest],
    seed: int | None = None,
) -> Iterator[StreamRequest]:
    """The request of each prompt, lazily, each put in ``pending`` by its id; with the
    ``seed`` of sampled rows, the first prompt repeating an earlier one is warned of.

    Raises
    ------
    ValueError
        An id given twice, naming the prompt (an unhashable one is refused by
        :class:`~alisa.runtime.requests.StreamRequest` itself).
    """
    seen: set[object] = set()  # every id so far: a finished request's too
    repeats = RepeatedPrompts(seed)
    for index, prompt in enumerate(prompts):
        request = _request(tokenizer, prompt, max_new_tokens, index)
        repeats.see(tuple(request.prompt_ids), index)
        if request.id in seen:  # hashable: StreamRequest refuses an id that is not
            raise ValueError(
                f"prompts[{index}] has id={request.id!r}, as an earlier prompt does: results "
                "come in completion order and only their ids tell them apart (a request "
                "without an id takes its index)"
            )
        seen.add(request.id)
        pending[request.id] = request
        yield request


def _request(
    tokenizer, prompt: str | StreamRequest, max_new_tokens: int, index: int
) -> StreamRequest:
    """The request for ``prompt``, the ``index``-th: a string tokenized, a request as it is;
    either named ``index`` when it has no id (its arrival index, as the scheduler would)."""
    if isinstance(prompt, StreamRequest):
        return prompt if prompt.id is not None else replace(prompt, id=index)
    check_prompt(prompt, index)
    ids = tokenizer(prompt)["input_ids"]
    return StreamRequest(prompt_ids=ids, max_new_tokens=max_new_tokens, id=index)
