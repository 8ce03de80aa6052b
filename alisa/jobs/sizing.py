"""Predicted peak memory of one batch, and the largest batch that fits a byte budget.

Counted: weights, every layer's KV store after sparsity and quantization (kept tokens plus the
slot headroom the cache allocates), and the prefill transient (one layer's full-precision prompt
KV, the layer activations, the padding mask and the logits). The same arithmetic serves the
ALISA cache and, with r = 1 and 16 bits, HF's ``DynamicCache`` (whose concatenation briefly
holds one layer twice).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from alisa.config import AlisaConfig
from alisa.settings import IgnoredSettingWarning, full_precision_note, ring_tokens
from alisa.sizes import format_bytes
from alisa.storage.pages import PAGE_TOKENS, host_region_bytes
from alisa.storage.store import headroom
from scheduler import ModelSpec, layers_kept

SAFETY = 1.10  # allocator slack on activations


@dataclass(frozen=True, kw_only=True)
class BatchMemory:
    """Predicted bytes of one batch: on the device (``total``: weights, KV, transient) and, with
    ``retention="host"``, the host regions (``host``, in host memory, not in ``total``)."""

    weights: int
    kv: int
    transient: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.transient


def kept_tokens(
    config: AlisaConfig | None,
    num_layers: int,
    tokens: int | Sequence[int],
    windows: Sequence[int | None] = (),
) -> np.ndarray:
    """(num_layers, *shape of tokens) tokens a sequence keeps in each layer after ``tokens``
    seen (one count, or one per sequence).

    The cache's own budget rule (:meth:`AlisaConfig.keep_rules`): ratio or token budget, sinks,
    pyramid scales and dense layers; ``config=None`` (HF's cache) keeps every token. Either way a
    layer with a sliding window (``windows``, as :attr:`scheduler.ModelSpec.windows`) holds at
    most its window.
    """
    rules = (config or AlisaConfig()).keep_rules(num_layers, windows)
    return layers_kept(rules, np.asarray(tokens, dtype=np.int64))


def batch_memory(
    spec: ModelSpec, config: AlisaConfig | None, batch: int, prompt_len: int, new_tokens: int
) -> BatchMemory:
    """Peak bytes of generating ``new_tokens`` for ``batch`` prompts of ``prompt_len`` tokens.

    ``config=None`` sizes HF's ``DynamicCache``: every token, model dtype, no headroom.
    """
    total = prompt_len + new_tokens
    full_token = spec.kv_bytes_per_token(16)
    layer_full = full_token / spec.num_layers
    if config is None:
        held = int(
            kept_tokens(None, spec.num_layers, total, spec.windows).sum()
        )  # every token, windows bounded
        kv = batch * held * layer_full + batch * total * layer_full  # cat holds a layer twice
    else:  # a static batch is so many equal rows: the continuous batch's arithmetic
        kv = rows_kv(spec, config, [(prompt_len, new_tokens)] * batch)
    host = 0 if config is None else rows_host(spec, config, [(prompt_len, new_tokens)] * batch)
    element = spec.bytes_per_element
    activations = batch * prompt_len * (4 * spec.hidden_size + 2 * spec.intermediate_size) * element
    mask = batch * prompt_len * prompt_len  # boolean padding mask of the prefill
    prompt_layer = batch * prompt_len * layer_full  # the layer being prefilled, uncompressed
    logits = batch * spec.vocab_size * 4
    transient = int(SAFETY * (activations + mask + logits) + prompt_layer)
    return BatchMemory(weights=spec.total_weight_bytes, kv=int(kv), transient=transient, host=host)


def fits(
    memory: BatchMemory, budget: int | None, kv_budget: int | None, host_budget: int | None = None
) -> bool:
    """Whether predicted memory stays within the total, the KV and the host budgets (None: no
    limit)."""
    return (
        (budget is None or memory.total <= budget)
        and (kv_budget is None or memory.kv <= kv_budget)
        and (host_budget is None or memory.host <= host_budget)
    )


def largest_batch(
    spec: ModelSpec,
    config: AlisaConfig | None,
    budget: int | None,
    prompt_len: int,
    new_tokens: int,
    limit: int,
    kv_budget: int | None = None,
    host_budget: int | None = None,
) -> int:
    """The largest batch (<= limit) that :func:`fits` the budgets; 0 if none."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        memory = batch_memory(spec, config, middle, prompt_len, new_tokens)
        if fits(memory, budget, kv_budget, host_budget):
            low = middle
        else:
            high = middle - 1
    return low


def row_slots(spec: ModelSpec, config: AlisaConfig, rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """(num_layers, len(rows)) slots each row of a running batch, a (prompt tokens, new tokens
    at most) pair, may occupy in each layer, at any time.

    A row keeps at most ``kept(prompt + new tokens)`` tokens (budgets only grow with the
    tokens seen; a joining row's cache is compacted to its kept prompt before it joins), plus
    the step's new token before eviction or selection: new tokens refill freed slots first, in
    drop and host retention alike, so a row never spans more.
    """
    # One call for every row: the layers' rules are built once (admission asks each step).
    totals = [prompt + new for prompt, new in rows]
    return kept_tokens(config, spec.num_layers, totals, spec.windows) + 1


def _capacity(spec: ModelSpec, config: AlisaConfig, rows: Sequence[tuple[int, int]]) -> list[int]:
    """Per layer, the slots every row of a batch of ``rows`` has: the widest row's
    :func:`row_slots` plus the growth headroom (slots are rectangular)."""
    widest = row_slots(spec, config, rows).max(axis=1)
    return [int(slots) + headroom(int(slots)) for slots in widest]


def rows_kv(spec: ModelSpec, config: AlisaConfig, rows: Sequence[tuple[int, int]]) -> int:
    """Peak device KV bytes of a batch of ``rows``, each a (prompt tokens, new tokens at most)
    pair, over every layer.

    Every row of a layer has the same capacity (:func:`_capacity`); with INT8/INT4 stores each
    row also keeps its newest tokens in full precision; with ``retention="host"`` the key sketch
    spans the longest row (plus its growth) and the tokens waiting for a host page stay on the
    device.
    """
    return _rows_kv(spec, config, rows, _capacity(spec, config, rows)) if rows else 0


def _rows_kv(
    spec: ModelSpec, config: AlisaConfig, rows: Sequence[tuple[int, int]], capacity: list[int]
) -> int:
    """:func:`rows_kv` of ``rows`` whose per-layer ``capacity`` (:func:`_capacity`) is known."""
    layers, count = spec.num_layers, len(rows)
    slot_bytes = spec.kv_bytes_per_token(config.kv_bits) / layers
    kv = count * sum(capacity) * slot_bytes
    if config.kv_bits < 16:  # the full-precision ring of the newest tokens, within the context
        ring = ring_tokens(config, spec.context_tokens)
        kv += count * layers * ring * spec.kv_bytes_per_token(16) / layers
    if config.retention == "host":
        span = max(p + n for p, n in rows)
        kv += count * (span + 2 * headroom(span)) * spec.sketch_bytes_per_token()
        kv += count * PAGE_TOKENS * spec.kv_bytes_per_token(16)
    return int(kv)


def rows_host(spec: ModelSpec, config: AlisaConfig, rows: Sequence[tuple[int, int]]) -> int:
    """Peak host-memory bytes of the host regions of a batch of ``rows`` (``retention="host"``;
    0 otherwise), each a (prompt tokens, new tokens at most) pair.

    Every layer that can leave tokens out (not a dense or sliding-window layer) keeps every
    position of every row in host memory at ``host_bits``; rows are rectangular, so each spans
    the longest row, with the region's growth room
    (:func:`~alisa.storage.pages.host_region_bytes`, what the cache's own check counts).
    """
    if config.retention != "host" or not rows:
        return 0
    rules = config.keep_rules(spec.num_layers, spec.windows)
    windows = spec.windows or (None,) * spec.num_layers
    layers = sum(
        window is None and not rule.keeps_everything
        for rule, window in zip(rules, windows, strict=True)
    )
    span = max(prompt + new for prompt, new in rows)
    return layers * host_region_bytes(
        len(rows),
        spec.num_kv_heads,
        spec.head_dim,
        span,
        bits=config.host_bits,
        element_bytes=spec.bytes_per_element,
    )


def running_memory(
    spec: ModelSpec,
    config: AlisaConfig,
    running: Sequence[tuple[int, int]],
    joining: Sequence[tuple[int, int]] = (),
) -> BatchMemory:
    """Peak bytes of a continuous batch: ``running`` rows and ``joining`` ones prefilled together,
    each a (prompt tokens, new tokens at most) pair.

    Slots are rectangular: every row of a layer has the widest row's capacity
    (:func:`row_slots` plus the growth headroom), so the KV is rows x that. With
    ``retention="host"`` the key sketch spans the longest row and the tokens waiting for a host
    page stay on the device. The transient is the newcomers' prefill (as :func:`batch_memory`,
    plus their own cache before it is compacted into the batch: their prompts with headroom),
    one layer copied while it merges, and a decode step's activations and logits.
    """
    rows = [*running, *joining]
    if not rows:
        return BatchMemory(weights=spec.total_weight_bytes, kv=0, transient=0)
    host = rows_host(spec, config, rows)
    layers, count = spec.num_layers, len(rows)
    capacity = _capacity(spec, config, rows)
    slot_bytes = spec.kv_bytes_per_token(config.kv_bits) / layers
    kv = _rows_kv(spec, config, rows, capacity)  # the capacity computed once
    transient = max(capacity) * count * slot_bytes  # the layer being merged
    if joining:
        longest = max(p for p, _ in joining)
        prefill = batch_memory(spec, config, len(joining), longest, 0).transient
        prompts = len(joining) * layers * (longest + headroom(longest)) * slot_bytes
        transient += prefill + prompts
    element = spec.bytes_per_element
    step = count * ((4 * spec.hidden_size + 2 * spec.intermediate_size) * element)
    transient += int(SAFETY * (step + count * spec.vocab_size * 4))
    return BatchMemory(
        weights=spec.total_weight_bytes, kv=int(kv), transient=int(transient), host=host
    )


def ring_refusal_note(
    spec: ModelSpec, config: AlisaConfig, prompt_tokens: int, new_tokens: int
) -> str:
    """Why a row that fits no budget alone needs more KV than it would with another
    ``residual_tokens``, for the refusal's message, or ``""``.

    With ``kv_bits < 16`` and a full-precision ring (``residual_tokens``) as long as the row,
    every token stays in full precision and the coded store's scales and slots come on top: the
    row needs more KV than 16-bit KV would, and the fix is the ring, not a shorter row
    (:func:`~alisa.settings.full_precision_note`, the warning a run gives).

    Parameters
    ----------
    spec
        The model's :class:`~scheduler.ModelSpec`.
    config
        The config the row was refused under.
    prompt_tokens, new_tokens
        The row: its prompt's tokens and the most it generates.

    Returns
    -------
    str
        ``"residual_tokens=64 keeps all 25 tokens of this row in full precision, so kv_bits=8
        codes nothing: residual_tokens=0 would need 9.0 KiB of KV, kv_bits=16 20.0 KiB"``;
        ``""`` when the ring does not cover the row.
    """
    tokens = prompt_tokens + new_tokens
    if full_precision_note(config, tokens) is None:
        return ""
    rows = [(prompt_tokens, new_tokens)]
    with warnings.catch_warnings():  # what-ifs, not the user's settings: nothing to warn
        warnings.simplefilter("ignore", IgnoredSettingWarning)
        coded = running_memory(spec, replace(config, residual_tokens=0), rows).kv
        plain = running_memory(spec, replace(config, kv_bits=16), rows).kv
    return (
        f"residual_tokens={config.residual_tokens} keeps all {tokens} tokens of this row in "
        f"full precision, so kv_bits={config.kv_bits} codes nothing: residual_tokens=0 would "
        f"need {format_bytes(coded)} of KV, kv_bits=16 {format_bytes(plain)}"
    )
