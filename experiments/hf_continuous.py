"""transformers' own continuous batching on a workload, under a KV byte budget.

``model.generate_batch`` takes one ``max_new_tokens`` for every request, so requests are given
to the engine behind it, the ``ContinuousBatchingManager`` (``continuous_batching_context_
manager``, as ``generate_batch`` does), each with its own ``max_new_tokens`` and
``record_timestamps=True``. Its paged cache gets ``num_blocks`` so that its KV bytes are the
budget (transformers 5.23, ``generation/continuous_batching/cache.py``).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache_allocators.full_attention import (
    FullAttentionCacheAllocator,
)

# The logger transformers' continuous batching reports preemptions on ("Offloaded N requests").
CB_LOGGER = "ContinuousBatchingLogger"


@dataclass(kw_only=True)
class PagedRun:
    """What one run of transformers' continuous batching produced.

    Attributes
    ----------
    tokens
        Generated token ids per request, in workload order (EOS included when emitted).
    token_times
        ``time.perf_counter()`` of each request's tokens (a request that was soft reset keeps
        only those after its reset: transformers drops the earlier ones).
    started_s, seconds
        When the requests were submitted, and the wall time until the last one finished.
    kv_bytes
        Bytes of the paged KV cache (``num_blocks`` whole-model blocks of ``page_size`` tokens).
    preemptions
        Requests its scheduler offloaded (soft reset: their cache freed and re-prefilled).
    errors
        Requests that came back with ``error`` set (transformers does not raise).
    """

    tokens: list[list[int]]
    token_times: list[list[float]]
    started_s: float
    seconds: float
    kv_bytes: int
    preemptions: int = 0
    errors: list[str] = field(default_factory=list)


def block_bytes(model, page_size: int) -> int:
    """Bytes of one paged-cache block: ``page_size`` tokens of K and V in every layer."""
    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    page = FullAttentionCacheAllocator.get_bytes_per_page(heads, head_dim, model.dtype, page_size)
    return config.num_hidden_layers * page


def run_paged(
    model,
    prompt_ids: list[list[int]],
    new_tokens: list[int],
    *,
    kv_bytes: int,
    eos_ids: list[int],
    page_size: int = 16,
    max_batch_tokens: int = 1024,
    max_rows: int = 64,
) -> PagedRun:
    """Greedy completions of ``prompt_ids`` (each up to its ``new_tokens``, stopping at EOS)
    by transformers' continuous batching with a paged cache of at most ``kv_bytes``.

    The model must use ``attn_implementation="sdpa"`` (or eager); on CPU its paged path packs
    every scheduled request into one row with a block-diagonal mask. CUDA graphs, async
    batching, flash switching and prefix sharing are off, as on CPU they do not apply.
    """
    blocks = kv_bytes // block_bytes(model, page_size)
    if blocks < 1:
        raise ValueError(f"kv_bytes={kv_bytes} holds no block of {page_size} tokens")
    paged = ContinuousBatchingConfig(
        num_blocks=blocks,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_rows,
        allow_block_sharing=False,
        auto_switch_to_flash=False,
        use_cuda_graph=False,
        use_async_batching=False,
        scheduler_type="fifo",
    )
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(new_tokens),
        eos_token_id=eos_ids,
    )
    with (
        _counting("Offloaded") as offloads,
        model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=paged, warmup=False, timeout=60
        ) as manager,
    ):
        started = time.perf_counter()
        requests = enumerate(zip(prompt_ids, new_tokens, strict=True))
        names = [
            manager.add_request(ids, f"r{index}", max_new_tokens=count, record_timestamps=True)
            for index, (ids, count) in requests
        ]
        results = {}
        while len(results) < len(names):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
        seconds = time.perf_counter() - started
    ordered = [results[name] for name in names]
    return PagedRun(
        tokens=[list(r.generated_tokens) for r in ordered],
        token_times=[list(r.timestamps or []) for r in ordered],
        started_s=started,
        seconds=seconds,
        kv_bytes=blocks * block_bytes(model, page_size),
        preemptions=sum(offloads),
        errors=[f"{r.request_id}: {r.error}" for r in ordered if r.error is not None],
    )


class _Counter(logging.Handler):
    """Counts the requests named in log lines that start with a word ("Offloaded 2 ...")."""

    def __init__(self, word: str) -> None:
        super().__init__(logging.INFO)
        self.word, self.counts = word, []

    def emit(self, record: logging.LogRecord) -> None:
        words = record.getMessage().split()
        if len(words) > 1 and words[0] == self.word and words[1].isdigit():
            self.counts.append(int(words[1]))


@contextmanager
def _counting(word: str):
    """The counts of ``word N ...`` lines transformers' continuous batching logs meanwhile."""
    logger = logging.getLogger(CB_LOGGER)
    counter = _Counter(word)
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers = [counter]  # counted here, not printed
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield counter.counts
    finally:
        logger.handlers, level, logger.propagate = saved[0], saved[1], saved[2]
        logger.setLevel(level)
