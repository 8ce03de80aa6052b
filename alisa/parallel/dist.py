"""Process groups for multi-process prefill and decode: torch.distributed only, no own transport."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the group torchrun describes (env://); returns (rank, world size).

    Every collective then fails after ``timeout_s`` instead of hanging when a rank dies.
    """
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(
                f"{name} is not set: launch with torchrun --nproc-per-node N -m alisa ..."
            )
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, timeout_s: float, function: Callable, args: tuple
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        function(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(function: Callable, world: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``function(rank, world, *args)`` in ``world`` local processes joined by gloo.

    A failing rank makes the others fail at their next collective within ``timeout_s``, and
    ``spawn`` raises; nothing waits forever.
    """
    if world < 1:
        raise ValueError(f"world={world!r} must be at least 1")
    mp.spawn(_entry, args=(world, free_port(), timeout_s, function, args), nprocs=world, join=True)
