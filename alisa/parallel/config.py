"""How prefill and decode are spread over ranks: :class:`ParallelConfig` and its choices (no torch
here, so the CLI lists them quickly)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("kvr", "tsp")
PARTITIONS = ("even", "search", "table")
DECODES = ("local", "sharded")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How prefill and decode are spread over the ranks.

    Parameters
    ----------
    mode
        ``kvr`` (KV-Runahead chain) or ``tsp`` (even split, K/V all-gathered: the baseline).
    partition
        ``even`` (KVR-E), ``search`` (KVR-S: grid search on measured TTFT) or ``table``
        (KVR-P: interpolated from ``table_path``, entry ``table_key``).
    decode
        ``local``: the last rank decodes alone with the ALISA cache it received (exact).
        ``sharded``: K/V stay spread over ranks (exact for dense; per-shard top-k for sparse
        policies is an approximation).
    """

    mode: str = "kvr"
    partition: str = "even"
    decode: str = "local"
    table_path: str | None = None
    table_key: str | None = None

    def __post_init__(self) -> None:
        for name, valid in (("mode", MODES), ("partition", PARTITIONS), ("decode", DECODES)):
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is unknown; valid: {', '.join(valid)}"
                )
        if self.partition == "table" and not (self.table_path and self.table_key):
            raise ValueError("partition='table' needs table_path and table_key")
        if self.mode == "tsp" and (self.partition != "even" or self.decode != "local"):
            raise ValueError(
                "mode='tsp' is the even all-gather baseline: partition even, decode local"
            )
