"""Scale-out on torch.distributed: KV-Runahead prefill, TSP baseline, sharded decode.

Loaded on first use (``lazy_loader``), so that :mod:`.config` (the choices the CLI lists) is
importable without torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "config": ["ParallelConfig"],
        "generate": ["parallel_generate", "prefill"],
        "partition": ["PartitionTable", "even_split", "grid_search"],
    },
)
