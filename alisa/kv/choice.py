"""Which tokens each (sequence, KV head) attends to at a host-retention decode step.

The chosen set is, in order: the policy's protections (the first ``sinks`` real tokens and the
``recent`` newest), up to ``shares[b]`` held tokens in between with the most attention history
(> 0; ALISA's "globally dynamic" tokens, https://arxiv.org/abs/2403.17312), then the rest of
the budget by the key sketch's logit (the max over the KV head's query heads; InfiniGen's
partial-channel estimate, https://arxiv.org/abs/2406.19707). Ranking is by integer keys, the
value's order with the position as the tie rule (equal values: the newer position first), so
the result is defined exactly: on a CPU the compiled kernel (:func:`alisa.kv.kernels.choose`)
computes it in one pass per row; elsewhere (CUDA) the PyTorch ops below, which tests compare
against the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from alisa.kernel_threads import kernel_parts
from alisa.kv import fused, kernels
from alisa.kv.selection import top_k
from alisa.storage.kernels import HALVES
from alisa.storage.sketch import Scoring
from alisa.storage.transfer import upload

# Keys: value level << 32 | position. Protected positions above every ranked one, padding below.
_TOP = 1 << 62
_BOTTOM = -(1 << 62)


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


def choose(inputs: ChoiceInputs, *, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen positions, (B, H_kv, K) ascending with K = max budget, and a bool of the
    same shape, False past a sequence's budget (those entries hold ``seen``)."""
    batch, heads = inputs.logits.shape[:2]
    count = int(inputs.budget.max())
    wanted = np.arange(count) < inputs.budget.reshape(-1, 1, 1)  # (B, 1, K)
    taken = upload(wanted, inputs.logits.device).expand(batch, heads, -1)
    if not compiled:
        return _choose_with_torch(inputs, count), taken
    chosen = np.empty((batch, heads, count), dtype=np.int64)
    nothing = np.empty((4, 0), dtype=np.int64)  # no fetch list: choose only
    kernels.choose(*_kernel_inputs(inputs), chosen, nothing, kernel_parts(batch * heads))
    return torch.from_numpy(chosen), taken


def choose_and_swap(inputs: ChoiceInputs) -> tuple[np.ndarray, int]:
    """:func:`choose` (compiled), then the slots ``inputs.positions`` (rewritten in place) made
    exactly the chosen positions as :meth:`alisa.kv.slots.SlotMap.swap` makes them, in one
    kernel call (:func:`alisa.kv.kernels.choose` with a fetch list; for that method on a CPU).

    Returns (fetch, E): the sequence, KV head, slot and position of each token to bring in, in
    the first E columns of a (4, ·) int64 array, in the order ``swap`` lists them.
    """
    batch, heads = inputs.logits.shape[:2]
    chosen = np.empty((batch, heads, int(inputs.budget.max())), dtype=np.int64)
    fetch = np.empty((4, chosen.size), dtype=np.int64)
    parts = kernel_parts(batch * heads)
    count = kernels.choose(*_kernel_inputs(inputs), chosen, fetch, parts)
    return fetch, count


def choose_swap_fetch(
    inputs: ChoiceInputs,
    scoring: Scoring,
    codes: tuple[np.ndarray, np.ndarray, np.ndarray],
    keys: torch.Tensor,
    values: torch.Tensor,
) -> int:
    """:func:`choose_and_swap` from logits the same call scores first, then the tokens to
    bring in decoded from the host region into their slots, all in one compiled call
    (:func:`alisa.kv.fused.select_and_fetch`, CPU).

    Parameters
    ----------
    inputs
        The choice's inputs; ``inputs.logits`` is ``scoring.logits``, written by the call.
    scoring
        The key sketch's product for this step (:meth:`alisa.storage.sketch.KeySketch.scoring`).
    codes
        The host region's INT8 rows (:meth:`alisa.storage.pages.HostPages.row_codes`).
    keys, values
        (B, H_kv, S, D) float32 contiguous device buffers; fetched tokens land in their slots.

    Returns
    -------
    int
        Tokens fetched.
    """
    if inputs.logits is not scoring.logits:
        raise ValueError("choose_swap_fetch chooses from the logits its scoring writes")
    batch, heads, slots, dim = keys.shape
    chosen = np.empty((batch, heads, int(inputs.budget.max())), dtype=np.int64)
    fetched, missing = fused.select_and_fetch(
        *scoring.operands,
        *_rule_inputs(inputs),  # the logits are the call's own scoring
        chosen,
        *codes,
        HALVES,
        keys.detach().numpy().reshape(-1, dim),  # views: the rows land in the buffers
        values.detach().numpy().reshape(-1, values.shape[-1]),
        kernel_parts(batch * heads),
    )
    if missing:
        raise IndexError(f"{missing} chosen positions are past the host region")
    return fetched


def _kernel_inputs(inputs: ChoiceInputs) -> tuple:
    """``inputs`` as the compiled kernels take them: numpy arrays, the logits as the int16 bits
    of their bfloat16 values, then :func:`_rule_inputs`."""
    return (inputs.logits.view(torch.int16).numpy(), *_rule_inputs(inputs))


def _rule_inputs(inputs: ChoiceInputs) -> tuple:
    """``inputs`` but the logits as the compiled kernels take them: numpy arrays, the history
    as the int32 bits of its float32 sums ((B, H, 0) without one)."""
    batch, heads = inputs.positions.shape[:2]
    history = inputs.history
    history_bits = (
        np.zeros((batch, heads, 0), dtype=np.int32)
        if history is None
        else history.view(torch.int32).numpy()
    )
    return (
        history_bits,
        inputs.shares,
        inputs.positions.numpy(),
        inputs.first,
        inputs.budget,
        inputs.recent,
        inputs.sinks,
        inputs.seen,
    )


def ordered_key(values: torch.Tensor) -> torch.Tensor:
    """int64 integers in the order of ``values`` (bfloat16 or float32): the bits, with those of
    negative values flipped (as the kernels' ``_bf16_key`` / ``_f32_key``)."""
    if values.dtype == torch.bfloat16:
        bits = values.view(torch.int16)
        return torch.where(bits < 0, bits ^ 0x7FFF, bits).to(torch.int64)
    bits = values.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def _choose_with_torch(inputs: ChoiceInputs, count: int) -> torch.Tensor:
    """The PyTorch reference of :func:`alisa.kv.kernels.choose` (same keys, same result)."""
    logits, seen = inputs.logits, inputs.seen
    device = logits.device
    every = torch.arange(seen, device=device)
    first = upload(inputs.first, device).view(-1, 1, 1)
    low = (first + inputs.sinks).clamp(max=seen)
    high = torch.maximum(seen - upload(inputs.recent, device).view(-1, 1, 1), low)
    width = min(logits.shape[-1], seen)
    level = ordered_key(logits[..., :width].amax(dim=2)) + 32768  # (B, H, width)
    level = torch.nn.functional.pad(level, (0, seen - width))  # past C: never ranked
    key = (level << 32) | every
    ranked = (every >= low) & (every < high)
    key = torch.where(ranked, key, torch.where(every >= first, _TOP, _BOTTOM))
    if inputs.history is not None and int(inputs.shares.max()) > 0:
        slots = inputs.positions
        column = slots.clamp(min=0)
        sums = inputs.history.gather(-1, column)
        candidate = (slots >= low) & (slots < high) & (sums > 0)
        history_key = torch.where(candidate, (ordered_key(sums) << 32) | column, _BOTTOM)
        top, taken = top_k(history_key, np.minimum(inputs.shares, slots.shape[-1]))
        taken &= history_key.gather(-1, top) > _BOTTOM
        # Picks not taken go to an extra column (an empty slot's clamped 0 could name a taken
        # position, and two writes to one index would race).
        picked = torch.where(taken, column.gather(-1, top), seen)
        key = torch.nn.functional.pad(key, (0, 1)).scatter_(-1, picked, _TOP)[..., :seen]
    top, taken = top_k(key, inputs.budget)
    return torch.where(taken, top, seen).sort(dim=-1).values
