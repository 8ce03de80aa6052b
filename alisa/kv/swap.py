"""Sequences paused in host memory and resumed exactly: continuous batching's preemption by swap.

vLLM (V1, and V0 for single sequences) and transformers' continuous batching preempt by
recomputation: a paused request's KV is freed, and its prompt plus generated tokens are prefilled
again when it resumes. Under eviction (r < 1) that is not exact: a prefill keeps the tokens the
observation window votes for over the whole text, while step-by-step decoding kept another set,
so the continuation would change. A swap is exact, and cheap here: a row's device KV is bounded
by its budget (round(n·r), the floor, the sinks), so only its kept slots, slot map and scores
travel.

The functions work on any object graph (a cache, a layer, a keeper): every tensor reachable
through attributes, lists, tuples and dicts is found, and :func:`copy.deepcopy` rebuilds the
structure with each tensor replaced as asked. So a part added to the cache later travels
without code here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

T = TypeVar("T")
HOST = torch.device("cpu")
_LEAVES = (str, bytes, int, float, bool, complex, type(None), np.ndarray, torch.device, torch.dtype)


def tensors_in(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, lists, tuples, sets and dicts
    (each once)."""
    found: dict[int, torch.Tensor] = {}
    visited: set[int] = set()
    stack = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found[id(item)] = item
        elif isinstance(item, _LEAVES) or id(item) in visited or isinstance(item, type):
            continue
        else:
            visited.add(id(item))
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list | tuple | set | frozenset):
                stack.extend(item)
            elif hasattr(item, "__dict__"):
                stack.extend(vars(item).values())
    return list(found.values())


def copy_replacing(root: T, replace: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """A deep copy of ``root`` whose every tensor ``t`` is ``replace(t)`` (the identity shares
    the tensors: only the structure is copied)."""
    memo = {id(tensor): replace(tensor) for tensor in tensors_in(root)}
    return copy.deepcopy(root, memo)


@dataclass(frozen=True)
class Swapped(Generic[T]):
    """An object graph whose device tensors wait in host memory (:func:`swap_out`).

    Attributes
    ----------
    held
        The copy on the host. Tensors that were already there (host retention's pages) are
        shared with the original, not copied.
    device
        Where the moved tensors go back to.
    moved
        ``id`` of each host copy made of a device tensor (only those return to the device).
    """

    held: T
    device: torch.device
    moved: frozenset[int]

    def swap_in(self) -> T:
        """The graph with its moved tensors back on :attr:`device` (this object is spent)."""

        def back(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in self.moved:
                return tensor
            return tensor.to(self.device, non_blocking=tensor.is_pinned())

        return copy_replacing(self.held, back)


def swap_out(root: T, device: torch.device) -> Swapped[T]:
    """Copy ``root``'s tensors on ``device`` to host memory (pinned on CUDA, for the way back);
    ``root`` itself is left as it was, to be dropped by the caller.

    On a CPU model the device is host memory: the tensors are copied all the same, so a CPU run
    exercises exactly what a GPU's swap does (every tensor a new storage).
    """
    moved: set[int] = set()

    def out(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device != device:
            return tensor
        host = torch.empty_like(tensor, device=HOST, pin_memory=device.type == "cuda")
        host.copy_(tensor)
        moved.add(id(host))
        return host

    held = copy_replacing(root, out)
    return Swapped(held=held, device=device, moved=frozenset(moved))
