"""How many parts a compiled CPU kernel splits its rows into: torch's thread count, where numba's
parallel loops run on OpenMP as torch's operators do, else one.

Host retention's per-layer kernels (the key sketch's product, the choice, the fetch, the
attention history) work row by row, one row per (sequence, KV head), and rows are independent.
Between two torch operators, torch's OpenMP threads are idle (or spinning, waiting for work).
numba's ``omp`` threading layer runs its parallel loops on an OpenMP pool as well; with PyTorch's
pip wheels that is a second ``libgomp`` (the system's, beside the copy torch bundles), so the
kernel's threads are not torch's, but OpenMP's way of waiting keeps them out of each other's
way: on a 2-core AVX2 EPYC the sketch product took 0.55 instead of 0.94 ms at B = 16 x 2,300
positions, and a torch linear right after a kernel ran at 1.01x its time after a torch operator
(stop 46, interleaved, 750 pairs). The other layers (``workqueue``, ``tbb``) start threads that
do contend with torch's: the same split under ``workqueue`` was slower than one thread.
Splitting rows never changes a result: each row is computed by the same code, only on another
thread.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba.core import config
from numba.np.ufunc import parallel

from alisa.ops.numba_cache import kernel


@kernel(parallel=True)
def _probe(values: np.ndarray) -> float:
    """A parallel loop, so that numba chooses its threading layer."""
    total = 0.0
    for index in numba.prange(values.shape[0]):
        total += values[index]
    return total


@functools.cache
def shares_torch_threads() -> bool:
    """Whether numba's parallel loops run on OpenMP (the ``omp`` layer), whose threads keep out
    of torch's way (see the module; numba chooses its layer once per process, at its first
    parallel loop)."""
    threads = torch.get_num_threads()
    _probe(np.zeros(2))
    # Loading the omp layer sets OpenMP's thread count to numba's, whatever it was asked for
    # (torch's count read back 2 after a first loop on a machine set to 1): put torch's back.
    torch.set_num_threads(threads)
    return numba.threading_layer() == "omp"


def kernel_parts(rows: int) -> int:
    """Parts to split ``rows`` independent rows into for a parallel kernel: torch's intra-op
    thread count (capped by numba's and by ``rows``) where the threads are shared, else 1; numba's
    next parallel loop on this thread runs exactly that many threads.

    Every kernel call asks this before its first parallel loop, so numba's threads start in
    :func:`shares_torch_threads`, which keeps torch's thread count as it was.
    """
    shared = shares_torch_threads()
    parts = 1
    if rows > 1 and shared:
        parts = max(1, min(rows, torch.get_num_threads(), config.NUMBA_NUM_THREADS))
    # numba sizes a parallel loop's team by its own thread count, not by the loop's length: a
    # larger team than the parts wakes threads with nothing to do, whose wait at the loop's end
    # (a spin, by OpenMP's default) takes cores that other processes may be using. The count is
    # per calling thread. It is read by numba's own getter, which its threads' start (above)
    # defines, without numba.get_num_threads's initialisation lock (a multiprocessing lock): the
    # kernels ask every layer and step, and setting an unchanged size through that lock cost
    # more than some of the kernels' own work at one sequence.
    if parallel._get_num_threads() != parts:
        numba.set_num_threads(parts)
    return parts
