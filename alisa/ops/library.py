"""The CPU's compiled kernels as PyTorch operators, so that a compiled decode step runs them.

``torch.compile`` cannot trace numba's kernels, but it calls a registered operator as one node
(https://pytorch.org/tutorials/advanced/python_custom_ops.html): inductor generates no code for
what the operator computes, so a static step (:mod:`alisa.kv.static`) compiles a third fewer
nodes and runs the kernels the eager step runs. Each operator has a fake (meta) twin that gives
the compiler its outputs' shapes: the attention over a float32 region's slots, dropping's
eviction, host retention's choice, swap and fetch, and the weights' product at a few rows
(:func:`alisa.ops.cpu.weight_product`, which a compiled step's linear functions call where
:mod:`alisa.ops.products` measured it faster). Registered for CPU tensors only: a CUDA step
traces PyTorch's operators (:mod:`alisa.ops.reference`), which a CUDA graph captures. A static
cache calls the step's kernels with ``kernels="cpu"`` (``Ops.operators``); ``auto`` traces
PyTorch's on a CPU too, whose compiled code measured as fast at 16 sequences and faster at one
(docs/compile.md), and the weights' product under either.
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.ops import cpu
from alisa.ops.reference import ChoiceInputs, Eviction, decoded

# The operators' schemas. Registered through torch.library's lower-level API, with a CPU kernel
# and a fake one each (:data:`OPERATORS`): ``torch.library.custom_op`` adds an autograd layer
# (never used here) that cost 40 us a call against 9 us, 1.2 ms a step for SmolLM2's 30 layers
# (a throw-away timing).
ATTEND_SLOTS = (
    "attend_slots(Tensor query, Tensor keys, Tensor values, Tensor positions, Tensor seen, "
    "int window, float scaling) -> (Tensor, Tensor)"
)
EVICT_ONE = (
    "evict_one(Tensor scores, Tensor positions, Tensor first, Tensor seen, Tensor recent, "
    "int sinks) -> Tensor"
)

WEIGHT_PRODUCT = "weight_product(Tensor x, Tensor weight) -> Tensor"

CHOOSE_AND_FETCH = (
    "choose_and_fetch(Tensor logits, Tensor history, Tensor shares, Tensor(a!) positions, "
    "Tensor first, Tensor budget, Tensor recent, int sinks, Tensor seen, Tensor[] region, "
    "Tensor(b!) keys, Tensor(c!) values) -> Tensor"
)


def _attend_slots_cpu(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    seen: torch.Tensor,
    window: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alisa.ops.cpu.attend_slots` over a float32 region's slots, with the tokens seen
    as a static step has them.

    Parameters
    ----------
    query
        (B, H, 1, D) float32 queries.
    keys, values
        (B, H_kv, C, D) float32 rows.
    positions
        (B, Hs, C) int64 position held by each slot (negative: empty).
    seen
        (1,) int64: tokens seen, the query's included (read here: the tensor is on the CPU).
    window
        A sliding layer's window, 0 for none.
    scaling
        Softmax scale.

    Returns
    -------
    tuple
        ((B, 1, H, D) output, (B, H_kv, G, 1, C) float32 probabilities).
    """
    return cpu.attend_slots(query, keys, values, positions, int(seen), window or None, scaling)


def _attend_slots_shapes(query, keys, values, positions, seen, window, scaling):
    batch, heads, _, head_dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    output = query.new_empty(batch, 1, heads, head_dim)
    groups = heads // kv_heads
    probabilities = query.new_empty(batch, kv_heads, groups, 1, capacity, dtype=torch.float32)
    return output, probabilities


def _evict_one_cpu(scores, positions, first, seen, recent, sinks: int) -> torch.Tensor:
    """:func:`alisa.ops.reference.evict_one` by the compiled eviction (the same slots; the
    arguments as :data:`EVICT_ONE` types them): (B, Hs, S) float32 scores and int64 positions,
    (B,) int64 ``first`` and ``recent``, (1,) int64 ``seen``; returns the (B, Hs, 1) int64
    slots."""
    step = Eviction(
        scores=scores,
        positions=positions,
        first=first.numpy(),
        seen=int(seen),
        recent=recent.numpy(),
        sinks=sinks,
        excess=np.ones(scores.shape[0], dtype=np.int64),
    )
    return cpu.evict(step)[0]


def _evict_one_shapes(scores, positions, first, seen, recent, sinks):
    return positions.new_empty(*scores.shape[:2], 1)


def _choose_and_fetch_cpu(
    logits,
    history,
    shares,
    positions,
    first,
    budget,
    recent,
    sinks: int,
    seen,
    region,
    keys,
    values,
) -> torch.Tensor:
    """Host retention's static selection by the eager step's compiled kernels: the choice and
    the slot swap in one call (:func:`alisa.ops.cpu.choose_and_swap`), then the rows the slots
    lack read from the host ``region`` and written into ``keys`` and ``values``.

    Parameters
    ----------
    logits
        (B, H_kv, G, C) bfloat16 sketch logits.
    history
        (B, H_kv, W) float32 attention sums, or (B, H_kv, 0) for none.
    shares, first, budget, recent
        (B,) int64 (:class:`alisa.ops.reference.ChoiceInputs`).
    positions
        (B, H_kv, S) int64 slot map, rewritten in place.
    sinks
        Leading real tokens protected.
    seen
        (1,) int64: positions so far (read here: the tensor is on the CPU).
    region
        The host region's tensors (:attr:`alisa.ops.reference.HostRegion.tensors`).
    keys, values
        (B, H_kv, S, D) device rows, written in place.

    Returns
    -------
    torch.Tensor
        0-d int64: the tokens fetched.
    """
    inputs = ChoiceInputs(
        logits=logits,
        history=history if history.shape[-1] else None,
        shares=shares.numpy(),
        positions=positions,
        first=first.numpy(),
        budget=budget.numpy(),
        recent=recent.numpy(),
        sinks=sinks,
        seen=int(seen),
    )
    incoming = cpu.choose_and_swap(inputs)
    if incoming is None:
        return torch.zeros((), dtype=torch.int64)
    rows, groups, targets, tokens = incoming[:4]
    read = decoded([t[:, rows, groups, tokens] for t in region], keys.dtype).to(keys.dtype)
    keys[rows, groups, targets] = read[0]
    values[rows, groups, targets] = read[1]
    return torch.tensor(rows.numel(), dtype=torch.int64)


def _choose_and_fetch_shapes(
    logits, history, shares, positions, first, budget, recent, sinks, seen, region, keys, values
):
    return positions.new_empty(())


def _weight_product_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(R, N) ``x @ weight.T`` by :func:`alisa.ops.cpu.weight_product`, the row kernel a
    decode step's weight products take at a few float32 rows (:mod:`alisa.ops.products`):
    ``x`` (R, K) float32 rows, ``weight`` (N, K) float32, contiguous."""
    return cpu.weight_product(x, weight)


def _weight_product_shapes(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


# (schema, CPU kernel, fake kernel) of each operator; its name is the schema's.
OPERATORS = (
    (ATTEND_SLOTS, _attend_slots_cpu, _attend_slots_shapes),
    (EVICT_ONE, _evict_one_cpu, _evict_one_shapes),
    (CHOOSE_AND_FETCH, _choose_and_fetch_cpu, _choose_and_fetch_shapes),
    (WEIGHT_PRODUCT, _weight_product_cpu, _weight_product_shapes),
)


def _register() -> torch.library.Library:
    """Define :data:`OPERATORS` under the ``alisa`` namespace, each with its kernels."""
    library = torch.library.Library("alisa", "DEF")
    for schema, kernel, fake in OPERATORS:
        name = schema.partition("(")[0]
        library.define(schema)
        library.impl(name, kernel, "CPU")
        torch.library.register_fake(f"alisa::{name}", fake, lib=library)
    return library


# The registration's handle: the operators live as long as this module (loaded once).
_LIBRARY = _register()
# What a static step calls (the compiler sees one node each); documented by their kernels.
attend_slots = torch.ops.alisa.attend_slots.default
evict_one = torch.ops.alisa.evict_one.default
choose_and_fetch = torch.ops.alisa.choose_and_fetch.default
weight_product = torch.ops.alisa.weight_product.default
