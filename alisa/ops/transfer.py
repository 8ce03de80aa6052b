"""Host values onto the model's device without stalling it.

The decode step keeps its bookkeeping (lengths, budgets, first positions, fade weights) in
numpy on the host and hands pieces of it to device kernels. ``torch.as_tensor(x, device=cuda)``
copies from pageable memory, which waits until the device has drained its queue: one stall per
call, several per layer and step. :func:`upload` stages the value in page-locked memory and
copies it asynchronously on the current stream instead (PyTorch's caching host allocator keeps
the staging block until the copy has run), so the host runs ahead of the device.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(
    value: np.ndarray | torch.Tensor | float | int | bool | list,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``value`` as a tensor on ``device`` (and ``dtype``), copied without a device sync.

    On CUDA the copy is asynchronous from page-locked memory; elsewhere this is
    ``torch.as_tensor(value, dtype=dtype, device=device)`` (on a CPU it may share a numpy
    array's memory, as that does).
    """
    if device.type != "cuda":
        return torch.as_tensor(value, dtype=dtype, device=device)
    staged = torch.as_tensor(value, dtype=dtype)
    if staged.device.type != "cpu":
        return staged.to(device)
    return staged.pin_memory().to(device, non_blocking=True)
