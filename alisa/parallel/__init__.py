"""Scale-out on torch.distributed: KV-Runahead prefill, TSP baseline, sharded decode."""

from alisa.parallel.generate import ParallelConfig, parallel_generate, prefill
from alisa.parallel.partition import PartitionTable, even_split, grid_search

__all__ = [
    "ParallelConfig",
    "PartitionTable",
    "even_split",
    "grid_search",
    "parallel_generate",
    "prefill",
]
