"""A stream of prompts through continuous batching under a byte budget: results as they finish."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from alisa.config import AlisaConfig, config_or_default
from alisa.jobs.sizing import fits, running_memory
from alisa.kv.cache import AlisaCache
from alisa.kv.hooks import attached
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import Engine
from alisa.runtime.requests import PREFILL_TOKENS, RowShape, StreamRequest, StreamResult
from alisa.runtime.sampling import SamplingOptions, sampling_or_default
from alisa.sizes import parse_budget
from scheduler import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ByteBudget:
    """Admits rows while the batch's predicted peak fits the budgets
    (:func:`alisa.jobs.sizing.running_memory`: each row's device KV at its bounded size,
    rectangular slots, the newcomers' prefill).

    Parameters
    ----------
    spec, config
        The model's sizes and the cache's config.
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
        if isinstance(self.max_rows, bool) or self.max_rows < 1:
            raise ValueError(f"max_rows={self.max_rows!r} must be an integer >= 1")
        reserve = self.reserve_tokens
        if reserve is not None and (
            isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0
        ):
            raise ValueError(f"reserve_tokens={reserve!r} must be an integer >= 0 or None")

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
        return fits(memory, self.device_bytes, self.kv_bytes)


def _full(row: RowShape) -> tuple[int, int]:
    return row.tokens, row.new_tokens


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
        request) is one prompt, as in :func:`alisa.generate`.
    config
        The cache's KV policy and storage (device tiers, ``gpu_memory`` in the config, are not
        supported: their layout is planned per batch).
    gpu_memory, kv_memory
        Byte budgets (``"8GiB"``) for weights + KV + activations, and for the KV alone.
    max_rows, prefill_rows, prefill_tokens
        Rows running at most; newcomers prefilled together at most, and their padded prompt
        tokens (rows x longest) in that forward at most (None: no bound).
    reserve_tokens
        Admit rows with room for this many new tokens rather than all of them; rows that
        outgrow it are paused in host memory and resumed (see :class:`ByteBudget`).

    Yields
    ------
    StreamResult
        One per prompt; ``finish_reason="did_not_fit"`` for a prompt the budget refuses alone,
        ``"prompt_too_long"`` / ``"context_exceeded"`` for one that, alone or with its
        ``max_new_tokens``, is longer than the model's context (never run; ``error`` says why).
    """
    prompts = _prompt_stream(prompts)
    config = config_or_default(config)
    if config.gpu_memory is not None:
        raise ValueError(
            f"gpu_memory={config.gpu_memory!r} in the config plans device tiers per batch; "
            "continuous batching takes the budget as stream_generate(gpu_memory=...) instead"
        )
    spec = model_spec(model, model_shape(model))
    admission = ByteBudget(
        spec=spec,
        config=config,
        device_bytes=None if gpu_memory is None else parse_budget(gpu_memory, field="gpu_memory"),
        kv_bytes=None if kv_memory is None else parse_budget(kv_memory, field="kv_memory"),
        max_rows=max_rows,
        reserve_tokens=reserve_tokens,
    )
    engine = Engine(model, tokenizer, sampling_or_default(sampling), stop_at_eos=stop_at_eos)
    scheduler = ContinuousScheduler(
        engine,
        lambda: AlisaCache(model, config),
        admission,
        prefill_rows=prefill_rows,
        prefill_tokens=prefill_tokens,
    )
    # The scheduler checks each request's ids against the vocabulary as it queues it.
    requests = (_request(tokenizer, prompt, max_new_tokens) for prompt in prompts)
    with attached(model):  # the model's attention is restored when the stream ends
        yield from scheduler.run(requests, lookahead=max_rows)


def _prompt_stream(prompts) -> Iterable[str | StreamRequest]:
    """``prompts`` as an iterable of prompts: one string or request is one prompt (iterating a
    string would make each character a prompt)."""
    if isinstance(prompts, str | StreamRequest):
        return [prompts]
    if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts={prompts!r} must be a string, a StreamRequest or an iterable of them"
        )
    return prompts


def _request(tokenizer, prompt: str | StreamRequest, max_new_tokens: int) -> StreamRequest:
    """The request for ``prompt`` (a string tokenized, a request as it is)."""
    if isinstance(prompt, StreamRequest):
        return prompt
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt {prompt!r} is empty or not a string")
    ids = tokenizer(prompt)["input_ids"]
    return StreamRequest(prompt_ids=ids, max_new_tokens=max_new_tokens)
