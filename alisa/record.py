"""What ran where: the machine, its kernels and the code's version, recorded beside every figure.

A speed figure means little without the CPU it ran on, what that CPU can do (AVX2 or AVX-512
BF16 decide which sketch product runs, :mod:`alisa.ops.backends`), numba's threading layer and
the commit. Every benchmark row and run record carries :func:`machine_record`.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

import numba
import torch

from alisa.ops.backends import available_ops, cpu_bfloat16
from alisa.ops.cpu import shares_torch_threads
from alisa.planning.hardware import cpu_model

REPOSITORY = Path(__file__).resolve().parents[1]


@functools.cache
def git_commit() -> str | None:
    """The checked-out commit when alisa runs from a git checkout (with ``+`` when it has
    uncommitted changes), else None."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPOSITORY, capture_output=True, text=True
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
        )
    except OSError:  # no git on this machine
        return None
    return head.stdout.strip() + ("+" if status.stdout.strip() else "")


def machine_record() -> dict:
    """The CPU, its capability, the kernels this machine runs and the versions.

    Returns
    -------
    dict
        ``cpu`` (model name), ``cpu_capability`` (torch's, e.g. ``AVX2``, ``AVX512``),
        ``onednn_bfloat16``, ``kernels_available``, ``numba_threading`` (numba's threading
        layer), ``gpu``, ``python``, ``torch``, ``transformers``, ``numba`` and ``git_commit``.
    """
    import transformers

    shares_torch_threads()  # numba names its threading layer after a first parallel loop
    return {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bfloat16": cpu_bfloat16(),
        "kernels_available": list(available_ops()),
        "numba_threading": numba.threading_layer(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numba": numba.__version__,
        "git_commit": git_commit(),
    }
