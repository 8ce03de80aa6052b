"""The PyTorch reference (``kernels="reference"``): the definitions every backend is tested against.

Host retention's decode step (ALISA's token-level scheduling, https://arxiv.org/abs/2403.17312,
§IV, phase II) and dropping's selection, written as PyTorch operators on tensors and arrays, one
function per concept:

* the choice (:func:`select_rule`): per (sequence, KV head), the policy's protections (the
  first ``sinks`` real tokens and the ``recent`` newest), up to ``shares[b]`` held tokens in
  between with the most attention history (> 0; ALISA's "globally dynamic" tokens), then the
  rest of the budget by the key sketch's logit (the max over the KV head's query heads;
  InfiniGen's partial-channel estimate, https://arxiv.org/abs/2406.19707). Ranking is by
  integer keys, the value's order with the position as the tie rule (equal values: the newer
  position first), so the result is defined exactly and every backend returns the same
  positions (:func:`alisa.ops.cpu.choose`, :func:`alisa.ops.cuda.choose_and_place`);
* the slot swap and placement (:func:`swap`, :func:`place`): a layer's slots made exactly the
  chosen positions, the tokens the device lacks listed to fetch;
* the fetch of placed rows from a host region (:func:`fetch_placed`);
* dropping's choice (:func:`evict`: :func:`protected_slots`, :func:`eviction_key`,
  :func:`top_k`), the writes it makes (:func:`put_taken`) and the attention sums it ranks by
  (:func:`add_sums`, :func:`combine_queries`); ties are broken by position there too (equal
  priorities: the older token goes first), so the compiled kernels (:func:`alisa.ops.cpu.evict`)
  choose the same slots.

The compiled CPU kernels (:mod:`alisa.ops.cpu`) and the Triton kernels (:mod:`alisa.ops.cuda`)
compute the same results; ``tests/test_ops.py`` and ``tests/test_kernels.py`` compare them with
these exactly. On CUDA without Triton, and wherever ``kernels="reference"`` is asked for, these
run. This module imports nothing of alisa but :mod:`alisa.ops.transfer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from alisa.ops.transfer import upload

FREE = -1  # an empty slot (the slot map's name for it; the kernels use the same value)
# Keys: value level << 32 | position. Protected positions above every ranked one, padding below.
_TOP = 1 << 62
_BOTTOM = -(1 << 62)


def with_protections(
    scores: torch.Tensor,
    protected: torch.Tensor,
    excluded: torch.Tensor | None = None,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Scores made priorities: +inf where ``protected``, -inf where ``excluded``.

    Parameters
    ----------
    scores
        (B, Hs, n) float scores; overwritten only when ``inplace`` (a policy's scores may be a
        view of its attention sums).
    protected, excluded
        bool masks broadcastable to ``scores`` (e.g. (B, 1, n)).
    """
    priority = (
        scores.masked_fill_(protected, torch.inf)
        if inplace
        else scores.masked_fill(protected, torch.inf)
    )
    if excluded is not None:
        priority.masked_fill_(excluded, -torch.inf)
    return priority


def put_taken(
    target: torch.Tensor, index: torch.Tensor, taken: torch.Tensor | None, value: float
) -> None:
    """Write ``value`` into ``target`` at ``index`` along the last dimension where ``taken``
    (as :func:`top_k` returns them: False past a row's count; None: every entry), in place. An
    index taken in a row must not appear again in that row (both writes would race).

    A masked scatter: the entries not taken write back what they read. Indexing only the taken
    entries would first read the mask on the host (``nonzero``), a device round trip per layer
    and step; a caller that knows on the host that every entry counts passes None (one
    operator instead of three).
    """
    if taken is None:
        target.scatter_(-1, index, value)
        return
    target.scatter_(-1, index, torch.where(taken, value, target.gather(-1, index)))


def protected_slots(
    positions: torch.Tensor,
    first: torch.Tensor,
    seen: int | torch.Tensor,
    recent: torch.Tensor,
    sinks: int,
) -> torch.Tensor:
    """(B, Hs, S) bool: the slots dropping never evicts, the first ``sinks`` real tokens
    (StreamingLLM's attention sinks, https://arxiv.org/abs/2309.17453), the ``recent`` newest
    of the ``seen`` (ALISA's locally static tokens) and empty slots.

    Parameters
    ----------
    positions
        (B, Hs, S) position of each slot's token, negative for an empty slot.
    first
        (B,) position of each sequence's first real token.
    seen
        Tokens seen per sequence, padding included (an int, or a (1,) device tensor in a static
        step).
    recent
        (B,) newest tokens each sequence keeps.
    sinks
        The policy's ``sink_tokens``.
    """
    relative = positions - first.view(-1, 1, 1)
    newest = positions >= (seen - recent).view(-1, 1, 1)
    return (relative < sinks) | newest | (positions < 0)


def eviction_key(priority: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, Hs, S) int64 keys in the order dropping evicts: the priority's, and among equal
    priorities the older position first; every key of a row differs (held positions do).

    Parameters
    ----------
    priority
        (B, Hs, S) float32 priorities (:func:`with_protections`: protected slots +inf).
    positions
        (B, Hs, S) int64 position of each slot's token, negative for an empty slot (protected,
        so its key's low half, 0, never decides).

    The rule mirrors host retention's choice (:func:`select_rule`: equal values keep the newer
    position), ALISA, https://arxiv.org/abs/2403.17312, Alg. 1.
    """
    return (ordered_key(priority) << 32) | positions.clamp(min=0)


class Eviction(NamedTuple):
    """What one layer's dropping reads at a decode step (:func:`evict`).

    Attributes
    ----------
    scores
        (B, Hs, S) float32 the policy's scores of the slots (higher is kept first), e.g. the
        attention sums themselves.
    positions
        (B, Hs, S) int64 position of each slot's token, negative for an empty slot.
    first
        (B,) int64 position of each sequence's first real token.
    seen
        Tokens seen per sequence, padding included.
    recent
        (B,) int64 newest tokens each sequence keeps.
    sinks
        The policy's ``sink_tokens``.
    excess
        (B,) int64 tokens each sequence evicts per group, at least one of them above 0.
    """

    scores: torch.Tensor
    positions: torch.Tensor
    first: np.ndarray
    seen: int
    recent: np.ndarray
    sinks: int
    excess: np.ndarray


def evict(step: Eviction) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots each sequence evicts: its ``excess`` unprotected slots of lowest score (ties:
    the older token), ALISA's SWA eviction, https://arxiv.org/abs/2403.17312, Alg. 1.

    Returns
    -------
    tuple
        (B, Hs, K) slots, K = ``excess.max()``, lowest key first, and a bool of the same shape,
        False past a sequence's excess (those entries are the next ranked slots: distinct from
        the taken ones, so :func:`put_taken` may write them back).
    """
    device = step.positions.device
    first, recent = upload(step.first, device), upload(step.recent, device)
    protected = protected_slots(step.positions, first, step.seen, recent, step.sinks)
    priority = with_protections(step.scores, protected)
    return top_k(eviction_key(priority, step.positions), step.excess, largest=False, ordered=True)


def evict_one(
    scores: torch.Tensor,
    positions: torch.Tensor,
    first: torch.Tensor,
    seen: torch.Tensor,
    recent: torch.Tensor,
    sinks: int,
) -> torch.Tensor:
    """A static step's eviction (:mod:`alisa.kv.static`): each row's one unprotected slot of
    lowest score (ties: the older token), :func:`evict` with an excess of one for every
    sequence and every number on the device (the caller applies it where the excess is 1).

    Parameters
    ----------
    scores, positions
        As :class:`Eviction` has them: (B, Hs, S) float32 and int64.
    first, recent
        (B,) int64 on the device: each sequence's first real position and newest tokens kept.
    seen
        (1,) int64 on the device: tokens seen per sequence, padding included.
    sinks
        The policy's ``sink_tokens``.

    Returns
    -------
    torch.Tensor
        (B, Hs, 1) int64 slots.
    """
    protected = protected_slots(positions, first, seen, recent, sinks)
    priority = eviction_key(with_protections(scores, protected), positions)
    return torch.topk(priority, 1, dim=-1, largest=False, sorted=True).indices


def combine_queries(probabilities: torch.Tensor, head_max: bool) -> torch.Tensor:
    """(B, H_kv, G, ...) attention to (B, H_kv, ...): each KV head's G query heads combined by
    their max, or by their sum added in head order.

    The order is the compiled kernels' (:func:`alisa.ops.cpu.accumulate`), so every backend's
    sums have the same bits: ``torch.sum`` over a dimension of five or more adds in another
    order (a model with 7 query heads per KV head, as Qwen2.5's, differed in the last bit).
    """
    if head_max:
        return probabilities.amax(dim=2)
    rows = probabilities[:, :, 0]
    for group in range(1, probabilities.shape[2]):
        rows = rows + probabilities[:, :, group]
    return rows


def add_sums(
    total: torch.Tensor, probabilities: torch.Tensor, keep: np.ndarray | None, head_max: bool
) -> None:
    """Add a decode step's attention to the per-slot sums, in place: ``total`` (B, Hs, S)
    float32 is first faded by ``keep`` (B,) float32 per sequence (a decayed window; None: not
    faded), then ``probabilities`` (B, Hs, G, S') float32, each group's G query heads combined
    (:func:`combine_queries`), is added to its first S' slots (A2SF's forgetting factor,
    https://arxiv.org/abs/2407.20485; H2O's plain sums without it)."""
    rows = combine_queries(probabilities, head_max)
    if keep is not None:
        total.mul_(upload(keep, total.device).view(-1, 1, 1))
    total[..., : rows.shape[-1]].add_(rows)


def top_k(
    priority: torch.Tensor, counts: np.ndarray, *, largest: bool = True, ordered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``counts[b]`` highest (or lowest) entries of each (B, Hs, n) row.

    Parameters
    ----------
    priority
        (B, Hs, n) priorities (protected entries +inf).
    counts
        (B,) entries wanted per sequence (host-side integers: no device sync).
    largest
        Highest first (choose what to keep) or lowest first (choose victims).
    ordered
        Rank the entries even when every row takes the same count.

    Returns
    -------
    tuple
        (B, Hs, max count) indices and a bool of the same shape that is False past a row's
        count (rows with smaller counts take the first of the ranked entries: only then sort).
    """
    count = int(counts.max())
    ranked = ordered or bool((counts != count).any())
    top = torch.topk(priority, count, dim=-1, largest=largest, sorted=ranked).indices
    wanted = torch.arange(count, device=priority.device).view(1, 1, -1)
    taken = wanted < upload(counts, priority.device).view(-1, 1, 1)
    return top, taken.expand_as(top).clone()


@dataclass(frozen=True)
class ChoiceInputs:
    """What a step's choice reads.

    Attributes
    ----------
    logits
        (B, H_kv, G, C) bfloat16 sketch logits of positions [0, C); every ranked position is
        below C.
    history
        (B, H_kv, W) float32 attention sums in each sequence's own scale (W >= seen), or None.
    shares
        (B,) int64 history picks at most.
    positions
        (B, H_kv, S) position each device slot holds (negative: none).
    first, budget, recent
        (B,) int64: first real position, tokens to choose, newest tokens protected.
    sinks
        Leading real tokens protected.
    seen
        Positions so far (padded coordinates).
    """

    logits: torch.Tensor
    history: torch.Tensor | None
    shares: np.ndarray
    positions: torch.Tensor
    first: np.ndarray
    budget: np.ndarray
    recent: np.ndarray
    sinks: int
    seen: int

    def __post_init__(self) -> None:
        # The ranked span ends where a sequence's recent window starts: past the shortest
        # window's start no logit is read, so the sketch need not score it (KeySketch's upto).
        needed = self.seen - int(self.recent.min())
        if self.logits.shape[-1] < needed:
            raise ValueError(
                f"logits of {self.logits.shape[-1]} positions cannot rank positions up to "
                f"seen - min(recent) = {needed}"
            )


def ordered_key(values: torch.Tensor) -> torch.Tensor:
    """int64 integers in the order of ``values`` (bfloat16 or float32): the bits, with those of
    negative values flipped (as the kernels' ``_bf16_key`` / ``_f32_key``)."""
    if values.dtype == torch.bfloat16:
        bits = values.view(torch.int16)
        return torch.where(bits < 0, bits ^ 0x7FFF, bits).to(torch.int64)
    bits = values.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


class Incoming(NamedTuple):
    """The E tokens a :meth:`SlotMap.swap` brings in, each (E,): where they go on the model's
    device (``rows``, ``groups``, ``slots``, ``positions``) and what the host region reads
    (``host_rows``, ``host_groups``, ``host_positions``: the same values in host memory; the
    same tensors on a CPU)."""

    rows: torch.Tensor
    groups: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    host_rows: torch.Tensor
    host_groups: torch.Tensor
    host_positions: torch.Tensor


class Placement(NamedTuple):
    """Where :meth:`SlotMap.place` puts the chosen tokens, each (B, Hs, K) on the model's device:
    the ``chosen`` positions, whether each must be ``fetch``ed (not held before), and its
    ``target`` slot (meaningful where ``fetch``)."""

    chosen: torch.Tensor
    fetch: torch.Tensor
    target: torch.Tensor


class HostRegion(NamedTuple):
    """A layer's host region as a selection reads it (:meth:`alisa.storage.pages.HostPages.region`).

    Attributes
    ----------
    tensors
        Plain (2, B, H_kv, N, D) keys and values in the model dtype, or INT8/INT4 codes
        (data (2, B, H_kv, N, ·) uint8, scale and zero point (2, B, H_kv, N, ·) float16).
    codes
        INT8 rows with one float16 scale each as the compiled CPU kernels read them ((2, R, D)
        uint8 codes, (2, R) int16 scale and zero-point bits, R = B * H_kv * N), or None
        where the region is not in that format or not in ordinary host memory.
    maps
        Whether :func:`fetch_placed` can read it: 16-bit rows, or INT8 rows with one float16
        scale each.
    """

    tensors: tuple[torch.Tensor, ...]
    codes: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    maps: bool


class SelectionStep(NamedTuple):
    """What one layer's selection reads and may write, as tensors and arrays.

    Attributes
    ----------
    inputs
        The choice's inputs; ``inputs.positions`` (the layer's slot map) is rewritten in place.
    operands
        The key sketch's product not yet run (:meth:`alisa.kv.ranking.KeySketch.scoring`:
        its operands, whose output is ``inputs.logits``) for a backend that runs it inside its
        own call, or None: ``inputs.logits`` hold the logits.
    host
        The host region.
    device
        The layer's plain (B, H_kv, S, D) device keys and values, which a backend may write the
        fetched rows into itself; None where the device region is coded.
    """

    inputs: ChoiceInputs
    operands: tuple[np.ndarray, ...] | None
    host: HostRegion
    device: tuple[torch.Tensor, torch.Tensor] | None


class Selected(NamedTuple):
    """What a selection did: ``count`` tokens fetched (an int, or a 0-d device tensor where
    counting would wait for the device), and the ``incoming`` ones the caller must still read
    from the host region and write through its device store (None: none, or the backend wrote
    them into ``SelectionStep.device`` itself)."""

    count: int | torch.Tensor
    incoming: Incoming | None


def select_rule(inputs: ChoiceInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's chosen positions (see the module), by PyTorch operators.

    Parameters
    ----------
    inputs
        The choice's inputs.

    Returns
    -------
    tuple
        (chosen, taken), each (B, H_kv, K) with K = ``budget.max()``: the positions, ascending,
        and whether each counts (False past a sequence's budget; those entries hold ``seen``).
    """
    logits, seen = inputs.logits, inputs.seen
    device = logits.device
    first = upload(inputs.first, device).view(-1, 1, 1)
    low = (first + inputs.sinks).clamp(max=seen)
    high = torch.maximum(seen - upload(inputs.recent, device).view(-1, 1, 1), low)
    key = _choice_keys(logits, seen, first, low, high, seen)
    if inputs.history is not None and int(inputs.shares.max()) > 0:
        shares = np.minimum(inputs.shares, inputs.positions.shape[-1])
        key = _with_history(
            key, inputs.history, inputs.positions, low, high, lambda k: top_k(k, shares)
        )
    top, taken = top_k(key, inputs.budget)
    return torch.where(taken, top, seen).sort(dim=-1).values, taken_by_budget(inputs)


class StaticChoice(NamedTuple):
    """What a static step's choice reads (:func:`select_rule_static`): :class:`ChoiceInputs`
    with every number a step changes on the device and every shape fixed for the longest
    context (``width`` positions), so that one trace serves every step.

    Attributes
    ----------
    logits
        (B, H_kv, G, C) bfloat16 sketch logits, C >= ``width``.
    history
        (B, H_kv, W) float32 attention sums (W >= ``width``), or None.
    shares, first, budget, recent
        (B,) int64 on the device: history picks at most, first real position, tokens to
        choose, newest tokens protected.
    positions
        (B, H_kv, S) position each device slot holds (negative: none).
    sinks
        Leading real tokens protected.
    seen
        (1,) int64 on the device: positions so far.
    width
        Positions a step may reach (``max_cache_len``); every position is below it.
    most
        The largest budget any step chooses (the budget at ``width`` tokens).
    """

    logits: torch.Tensor
    history: torch.Tensor | None
    shares: torch.Tensor
    positions: torch.Tensor
    first: torch.Tensor
    budget: torch.Tensor
    recent: torch.Tensor
    sinks: int
    seen: torch.Tensor
    width: int
    most: int


def select_rule_static(inputs: StaticChoice) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_rule` with one shape for every step and no host read: the same positions.

    Positions at or past ``seen`` rank below every real one, and each top-k takes the most any
    step takes, its entries past a sequence's count masked, so the chosen set is the eager
    step's (its keys are distinct but for the protected ones, which every budget covers).

    Returns
    -------
    tuple
        (chosen, taken), each (B, H_kv, ``most``): the positions, ascending where taken, and
        whether each counts (entries not taken hold ``width``).
    """
    width, seen = inputs.width, inputs.seen.view(1, 1, 1)
    first = inputs.first.view(-1, 1, 1)
    low = torch.minimum(first + inputs.sinks, seen)
    high = torch.maximum(seen - inputs.recent.view(-1, 1, 1), low)
    key = _choice_keys(inputs.logits, width, first, low, high, seen)
    if inputs.history is not None:
        slots = inputs.positions.shape[-1]
        key = _with_history(
            key,
            inputs.history[..., :width],
            inputs.positions,
            low,
            high,
            lambda k: top_counted(k, inputs.shares, slots),
        )
    top, taken = top_counted(key, inputs.budget, inputs.most)
    return torch.where(taken, top, width).sort(dim=-1).values, taken


def top_counted(
    priority: torch.Tensor, counts: torch.Tensor, most: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k` with device ``counts`` (B,) int64 and a fixed width: the ``most`` highest
    entries of each (B, Hs, n) row, highest first, and whether each is within its row's
    count."""
    top = torch.topk(priority, most, dim=-1, sorted=True).indices
    wanted = torch.arange(most, device=priority.device).view(1, 1, -1)
    return top, (wanted < counts.view(-1, 1, 1)).expand_as(top)


def _choice_keys(
    logits: torch.Tensor,
    width: int,
    first: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    seen: int | torch.Tensor,
) -> torch.Tensor:
    """(B, H_kv, width) int64 keys of positions [0, width): ranked ones (``low`` <= p <
    ``high``) by their best sketch logit with the position as the tie rule, protected real
    ones above all (``first`` <= p < ``seen``), padding and positions not seen below all."""
    every = torch.arange(width, device=logits.device)
    scored = min(logits.shape[-1], width)
    level = ordered_key(logits[..., :scored].amax(dim=2)) + 32768  # (B, H, scored)
    level = torch.nn.functional.pad(level, (0, width - scored))  # past C: never ranked
    key = (level << 32) | every
    ranked = (every >= low) & (every < high)
    real = (every >= first) & (every < seen)
    return torch.where(ranked, key, torch.where(real, _TOP, _BOTTOM))


def _with_history(
    key: torch.Tensor,
    history: torch.Tensor,
    positions: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    pick: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """``key`` with the held ranked tokens of most attention history (> 0) protected: ``pick``
    takes (top, taken) of the (B, H_kv, S) history keys of the slots (ALISA's "globally
    dynamic" tokens)."""
    width = key.shape[-1]
    column = positions.clamp(min=0)
    sums = history.gather(-1, column)
    candidate = (positions >= low) & (positions < high) & (sums > 0)
    history_key = torch.where(candidate, (ordered_key(sums) << 32) | column, _BOTTOM)
    top, taken = pick(history_key)
    taken = taken & (history_key.gather(-1, top) > _BOTTOM)
    # Picks not taken go to an extra column (an empty slot's clamped 0 could name a taken
    # position, and two writes to one index would race).
    picked = torch.where(taken, column.gather(-1, top), width)
    return torch.nn.functional.pad(key, (0, 1)).scatter_(-1, picked, _TOP)[..., :width]


def taken_by_budget(inputs: ChoiceInputs) -> torch.Tensor:
    """(B, H_kv, K) bool, K = ``budget.max()``: entry k of a sequence counts below its budget."""
    batch, heads = inputs.logits.shape[:2]
    count = int(inputs.budget.max())
    wanted = np.arange(count) < inputs.budget.reshape(-1, 1, 1)  # (B, 1, K)
    return upload(wanted, inputs.logits.device).expand(batch, heads, -1)


def free_slots(free: torch.Tensor) -> torch.Tensor:
    """(B, Hs, capacity + 1): column j of a row is its j-th free slot, lowest first, for j below
    its free count (the rest is not meaningful; the last column takes the occupied slots)."""
    capacity = free.shape[-1]
    rank = torch.where(free, free.cumsum(-1) - 1, capacity)
    slots = torch.empty(*free.shape[:2], capacity + 1, dtype=torch.long, device=free.device)
    return slots.scatter_(-1, rank, torch.arange(capacity, device=free.device).expand_as(rank))


def release(
    positions: torch.Tensor, chosen: torch.Tensor, taken: torch.Tensor, seen: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Free the slots of tokens not ``chosen`` (``positions`` rewritten in place).

    Returns (B, Hs, K) whether each chosen token must be fetched and (B, Hs, capacity) which
    slots are free.
    """
    device = chosen.device
    held = positions >= 0
    # Per position: whether it is wanted / held; an extra column takes the rest.
    wanted = torch.zeros(*chosen.shape[:2], seen + 1, dtype=torch.bool, device=device)
    wanted.scatter_(-1, torch.where(taken, chosen, seen), True)
    holding = torch.zeros_like(wanted).scatter_(-1, torch.where(held, positions, seen), True)
    leaving = held & ~wanted.gather(-1, positions.clamp(min=0))
    fetch = taken & ~holding.gather(-1, chosen)  # (B, Hs, K)
    free = (positions == FREE) | leaving
    positions.masked_fill_(leaving, FREE)
    return fetch, free


def swap(
    positions: torch.Tensor, chosen: torch.Tensor, taken: torch.Tensor, seen: int
) -> Incoming | None:
    """Make each (sequence, group)'s slots exactly its ``chosen`` positions.

    Slots whose token was not chosen are freed; the chosen tokens not held, in the order given,
    take the free slots lowest first. Work is over the slots and the K chosen, not every
    position seen.

    Parameters
    ----------
    positions
        (B, Hs, S) the position each slot holds (:data:`FREE`: none), rewritten in place.
    chosen
        (B, Hs, K) positions to hold, ascending where ``taken``.
    taken
        (B, Hs, K) bool: which of them count (False past a sequence's budget).
    seen
        Positions so far.

    Returns
    -------
    Incoming or None
        The tokens that must be brought in (the caller fills their slots), or None when every
        chosen token was already held.
    """
    fetch, free = release(positions, chosen, taken, seen)
    device = chosen.device
    # The selection's one host round trip: the positions to bring in ((B, Hs, K), -1 for the
    # rest) come to the host, whose region reads them; the device gets the index lists back
    # without waiting (a device-side nonzero would be a second round trip).
    incoming = torch.where(fetch, chosen, -1)
    on_host = incoming.to("cpu")
    host_rows, host_groups, host_entries = (on_host >= 0).nonzero(as_tuple=True)
    if host_rows.numel() == 0:
        return None
    host_tokens = on_host[host_rows, host_groups, host_entries]
    rows, groups, entries = (upload(t, device) for t in (host_rows, host_groups, host_entries))
    # The j-th fetched token of a (sequence, group) goes to its j-th free slot, lowest first.
    rank = fetch.cumsum(-1)[rows, groups, entries] - 1
    target = free_slots(free)[rows, groups, rank]
    tokens = chosen[rows, groups, entries]
    positions[rows, groups, target] = tokens
    return Incoming(rows, groups, target, tokens, host_rows, host_groups, host_tokens)


def place(
    positions: torch.Tensor, chosen: torch.Tensor, taken: torch.Tensor, seen: int
) -> Placement:
    """:func:`swap` without a host round trip: the same slots, as (B, Hs, K) tensors.

    Where :func:`swap` brings the fetch list to the host (so the host region can be read there),
    this leaves it on the device for a reader that is there too (:func:`fetch_placed`): entry
    ``k`` of a row is fetched when ``fetch[..., k]``, into slot ``target[..., k]``. Same
    parameters as :func:`swap`.
    """
    fetch, free = release(positions, chosen, taken, seen)
    capacity = positions.shape[-1]
    # The j-th fetched token of a row takes its j-th free slot, lowest first, as in swap.
    free_slot = free_slots(free)
    rank = (fetch.cumsum(-1) - 1).clamp(min=0)
    target = torch.where(fetch, free_slot.gather(-1, rank), capacity)  # capacity: no slot
    placed = torch.nn.functional.pad(positions, (0, 1), value=FREE)
    placed.scatter_(-1, target, torch.where(fetch, chosen, FREE))
    positions.copy_(placed[..., :capacity])
    return Placement(chosen, fetch, target)


def fetch_placed(
    region: tuple[torch.Tensor, ...],
    chosen: torch.Tensor,
    fetch: torch.Tensor,
    target: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write the flagged chosen tokens' rows of a host region into their device slots.

    Parameters
    ----------
    region
        The host region (:attr:`HostRegion.tensors`).
    chosen, fetch, target
        (B, H_kv, K) on the device: positions, whether to fetch each, the slot it goes to
        (:func:`place`).
    keys, values
        (B, H_kv, capacity, D) device buffers, written in place.

    Every chosen row is read on the host and the flagged ones written (on CUDA one round trip
    to list the rows; :func:`alisa.ops.cuda.fetch_placed` reads only the flagged rows, by the
    device itself).
    """
    head_dim = keys.shape[-1]
    capacity = region[0].shape[3]
    rows_out = _region_rows(region, chosen.clamp(0, capacity - 1), keys)
    # Entries not fetched write to one spare slot past the buffer (no data-dependent shape).
    spare = keys.shape[2]
    slots = torch.where(fetch, target, spare).unsqueeze(-1).expand(-1, -1, -1, head_dim)
    for buffer, rows_half in zip((keys, values), rows_out, strict=True):
        padded = torch.nn.functional.pad(buffer, (0, 0, 0, 1))
        buffer.copy_(padded.scatter_(2, slots, rows_half)[:, :, :spare])


def fetch_placed_static(
    region: tuple[torch.Tensor, ...],
    chosen: torch.Tensor,
    fetch: torch.Tensor,
    target: torch.Tensor,
    anchor: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """:func:`fetch_placed` in a static step, whose region is where the device is (a CPU's
    memory): one shape, and only the fetched rows read and written.

    Entries not fetched read their row's position 0 and rewrite the ``anchor`` slot (B, H_kv,
    1), one every row holds through the step (its new token's), with its own value, so the
    scatter needs neither a copy of the buffers nor a slot to spare. Same parameters as
    :func:`fetch_placed` otherwise.
    """
    rows_out = _region_rows(region, torch.where(fetch, chosen, 0), keys)
    for buffer, rows_half in zip((keys, values), rows_out, strict=True):
        _scatter_placed(buffer, rows_half, fetch, target, anchor)


def fetch_codes_static(
    region: tuple[torch.Tensor, ...],
    region_level: torch.Tensor,
    chosen: torch.Tensor,
    fetch: torch.Tensor,
    target: torch.Tensor,
    anchor: torch.Tensor,
    codes: tuple[torch.Tensor, ...],
    level: torch.Tensor,
) -> None:
    """:func:`fetch_placed_static` into a device region of codes from a host region coded the
    same way (INT8, one scale a row, scales and zero points kept as float64 values of the
    dtype their ``level`` names): the fetched rows' codes, scales and zero points copied as
    they are, and the device's level raised to the host's where a row was fetched (as
    :meth:`alisa.storage.quantized.QuantizedPair.put` widens the scales).

    Parameters
    ----------
    region, region_level
        The host region's (data, scale, zero point), each (2, B, H_kv, positions, ·), and
        its (1,) int64 level.
    chosen, fetch, target, anchor
        As :func:`fetch_placed_static`.
    codes, level
        The device's (data, scale, zero point), each (2, B, H_kv, capacity, ·), and its
        (1,) level, written in place.
    """
    picked = _region_picked(region, torch.where(fetch, chosen, 0))
    for buffer, rows in zip(codes, picked, strict=True):
        for half in range(2):  # a view of the buffer: the scatter writes the buffer
            _scatter_placed(buffer[half], rows[half].to(buffer.device), fetch, target, anchor)
    raised = torch.maximum(level, region_level.to(level.device))
    level.copy_(torch.where(fetch.any(), raised, level))


def _scatter_placed(
    buffer: torch.Tensor,
    rows: torch.Tensor,
    fetch: torch.Tensor,
    target: torch.Tensor,
    anchor: torch.Tensor,
) -> None:
    """Write (B, H_kv, K, ·) ``rows`` into (B, H_kv, capacity, ·) ``buffer`` at their
    ``target`` slots where ``fetch``; the others rewrite the ``anchor`` slot with its own value
    (:func:`fetch_placed_static`)."""
    width = buffer.shape[-1]
    slots = torch.where(fetch, target, anchor).unsqueeze(-1).expand(-1, -1, -1, width)
    held = anchor.unsqueeze(-1).expand(-1, -1, 1, width)
    buffer.scatter_(2, slots, torch.where(fetch.unsqueeze(-1), rows, buffer.gather(2, held)))


def _region_rows(
    region: tuple[torch.Tensor, ...], positions: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """(2, B, H_kv, K, D) keys and values of a host region's (B, H_kv, K) ``positions`` (each
    within the region), read where the region is and decoded to ``keys``' dtype and device."""
    batch, heads, entries = positions.shape
    picked = [t.flatten(1, 3) for t in _region_picked(region, positions)]
    read = decoded(picked, keys.dtype).to(keys.device, keys.dtype)
    return read.view(2, batch, heads, entries, keys.shape[-1])


def _region_picked(region: tuple[torch.Tensor, ...], positions: torch.Tensor) -> list[torch.Tensor]:
    """A host region's tensors at (B, H_kv, K) ``positions``, as stored: (2, B, H_kv, K, ·)
    each, where the region is."""
    batch, heads, entries = positions.shape
    capacity = region[0].shape[3]
    rows = torch.arange(batch * heads, device=positions.device).view(batch, heads, 1)
    source = (rows * capacity + positions).view(-1).to(region[0].device)
    return [
        t.view(2, -1, t.shape[-1]).index_select(1, source).view(2, batch, heads, entries, -1)
        for t in region
    ]


def decoded(picked: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a host region, (2, R, D), decoded for keys of ``dtype``: 16-bit rows as
    they are, INT8 codes in float32 (float16 for float16 keys), or in float64 where the scales
    are (a widened or static region: as :func:`quant.asymmetric.dequantize` decodes them)."""
    if len(picked) == 1:
        return picked[0]
    data, scale, zero = picked
    compute = torch.float16 if dtype == torch.float16 else torch.float32
    if scale.dtype == torch.float64:
        return ((data.double() - zero) * scale).to(compute)
    return (data.to(compute) - zero.to(compute)) * scale.to(compute)


# ---- the selection, composed ------------------------------------------------------------
# A backend binds one of these once (alisa.ops.backends.Ops.select), with its own kernels.

Choose = Callable[[ChoiceInputs], tuple[torch.Tensor, torch.Tensor]]


def swapped(step: SelectionStep, *, choose: Choose = select_rule) -> Selected:
    """The selection by :func:`swap`: ``choose`` the positions, swap them into the slots; the
    caller fetches the incoming rows through its stores."""
    inputs = step.inputs
    chosen, taken = choose(inputs)
    incoming = swap(inputs.positions, chosen, taken, inputs.seen)
    return Selected(0 if incoming is None else incoming.rows.numel(), incoming)


def placed(
    step: SelectionStep,
    *,
    choose_and_place: Callable[[ChoiceInputs], Placement],
    fetch: Callable[..., None],
    otherwise: Callable[[SelectionStep], Selected],
) -> Selected:
    """The selection with no fetch list on the host: ``choose_and_place`` makes the slots the
    chosen positions, ``fetch`` writes the rows they lack from the host region into the plain
    device buffers. A coded device region, or a host region ``fetch`` cannot read, takes
    ``otherwise``."""
    if step.device is None or not step.host.maps:
        return otherwise(step)
    placement = choose_and_place(step.inputs)
    fetch(step.host.tensors, *placement, *step.device)
    return Selected(placement.fetch.sum(), None)


def chosen_then_placed(inputs: ChoiceInputs, *, choose: Choose = select_rule) -> Placement:
    """``choose``, then :func:`place` (what :func:`alisa.ops.cuda.choose_and_place` does in one
    kernel)."""
    chosen, taken = choose(inputs)
    return place(inputs.positions, chosen, taken, inputs.seen)
