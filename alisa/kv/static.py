"""A static cache's decode step: fixed shapes, and the host's numbers handed over in one copy.

``torch.compile`` (and a CUDA graph) replays one trace of a decode step only while nothing the
trace read from Python changes: a length, a budget or a counter read as a Python number is baked
into the graph and guarded, so the next step would compile again. An ``AlisaCache`` built with
``max_cache_len`` is static: every layer's slot space is sized once for the longest context the
request may reach (as HF's ``StaticCache``), the new token takes the first free slot (found on
the device), and the numbers the host keeps per step (the new token's position, each layer's
excess over its budget, its recent window, its sums' fade, its rows' first positions) are
written into one :class:`StepPack` before the step and copied to the device at once. The traced
step reads them from that one tensor, whose address never changes (a CUDA graph replays reads of
it), so the host keeps its NumPy bookkeeping (exactly the numbers of the eager step: one rule)
and the device never waits for it. See issue 65, nano-vllm's static input buffers, and
https://pytorch.org/docs/stable/torch.compiler_cudagraph_trees.html.
"""

from __future__ import annotations

import numpy as np
import torch


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell the compiler these tensors keep their address for every step (as HF's
    ``StaticLayer`` does for its keys and values).

    A compiled step writes a static cache's buffers in place (the new token's slot, the
    evicted slots, the attention sums); CUDA graphs skip a graph whose inputs are mutated
    unless their addresses are fixed, and would otherwise copy every input into the graph's
    own buffers each replay. Called outside the traced region (when a layer binds its step).
    """
    for tensor in tensors:
        # Unguarded: a new cache of the same shape re-records the graph instead of compiling
        # the step again (older torch releases guarded by default).
        torch._dynamo.mark_static_address(tensor, guard=False)


class StepPack:
    """The host's numbers of one decode step, in one float64 buffer, uploaded in one copy.

    Float64 holds every integer a step needs exactly (positions, counts below 2**53) and each
    fade weight as the eager step computes it before its cast to float32. Users
    :meth:`reserve` their fields once, then :meth:`freeze` allocates the buffers; each step
    they fill their :meth:`host` rows and the owner calls :meth:`upload`.

    Parameters
    ----------
    device
        Where the traced step reads the numbers (the model's device).
    rows
        The sequences of the batch the fields are laid out for.
    pinned
        Stage the host numbers in page-locked memory and copy them asynchronously (the
        cache's kernels say where: :attr:`alisa.ops.backends.Ops.pinned`, on CUDA).
    """

    def __init__(self, device: torch.device, rows: int, *, pinned: bool) -> None:
        self.device = torch.device(device)
        self.rows = rows  # the batch the fields are laid out for
        self.pinned = pinned
        self.size = 1  # slot 0: the position of the token a step writes
        # Two host buffers taken in turn on CUDA: an asynchronous copy may still be reading
        # one when the host fills the next step's numbers (each waits for its own last copy).
        self._buffers: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = []
        self._turn = 0
        self.values: torch.Tensor | None = None  # the device copy the traced step reads
        self._reserved: list[tuple[int, int, int]] = []  # (offset, rows, width) of each block
        # Views of ``values``, made once by freeze(): the step's position, each field block.
        self._position: torch.Tensor | None = None
        self._blocks: dict[int, torch.Tensor] = {}

    def reserve(self, rows: int, width: int) -> int:
        """Room for ``rows`` fields of ``width`` numbers each; returns their offset."""
        if self.values is not None:
            raise ValueError("a step pack takes no fields once frozen")
        offset = self.size
        self.size += rows * width
        self._reserved.append((offset, rows, width))
        return offset

    def freeze(self) -> None:
        """Allocate the buffers: page-locked on the host where the device is CUDA (the copy
        is then asynchronous), and a device buffer whose address stays for every step."""
        for _ in range(2 if self.pinned else 1):
            buffer = torch.zeros(self.size, dtype=torch.float64, pin_memory=self.pinned)
            self._buffers.append(buffer)
            self._copied.append(None)
        self.values = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        # A view per block, made here (outside the traced step): the step reads each block
        # from the start of its own view, so every layer's kernels are the same code, compiled
        # once. Offsets into one buffer would be constants baked into each layer's kernels
        # (30 copies of each kernel for a 30-layer model, the most of a cold compile's time).
        self._position = self.values[:1]
        self._blocks = {
            offset: self.values[offset : offset + rows * width].view(rows, width)
            for offset, rows, width in self._reserved
        }
        mark_static(self.values, self._position, *self._blocks.values())

    def _current(self) -> np.ndarray:
        return self._buffers[self._turn].numpy()

    def begin(self, position: int) -> None:
        """Start filling a step: ``position`` is the padded position of the token it writes.
        Waits only for the copy that last read this host buffer (two steps ago on CUDA)."""
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()
        self._current()[0] = position

    def host(self, offset: int, rows: int, width: int) -> np.ndarray:
        """The (rows, width) host view of a field block, to fill before :meth:`upload`."""
        return self._current()[offset : offset + rows * width].reshape(rows, width)

    def upload(self) -> None:
        """Copy the host numbers to the device buffer (no wait for the device)."""
        source = self._buffers[self._turn]
        if self.pinned:
            self.values.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
            self._turn = 1 - self._turn
        else:
            self.values.copy_(source)

    def position(self) -> torch.Tensor:
        """(1,) int64 on the device: the position of the token this step writes."""
        return self._position.to(torch.int64)

    def field(self, offset: int, width: int, row: int) -> torch.Tensor:
        """(width,) float64 on the device: row ``row`` of the field block at ``offset``
        (reserved with ``width`` numbers a row)."""
        block = self._blocks[offset]
        if block.shape[1] != width:
            raise ValueError(f"the block at {offset} has rows of {block.shape[1]}, not {width}")
        return block[row]
