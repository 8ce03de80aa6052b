"""What one ``alisa serve`` server is: its model's name, cache settings, budgets and limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from alisa.checks import check_int, check_text
from alisa.config import AlisaConfig
from alisa.runtime.compiled import check_compile
from alisa.runtime.requests import PREFILL_TOKENS
from alisa.settings import check_host_admission, check_untiered


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """Settings of one server.

    Parameters
    ----------
    model_name
        The name clients give as ``model`` (``/v1/models`` lists it).
    config
        The cache settings of requests that do not choose their own (its ``gpu_memory`` must be
        None: the device budget is ``device_bytes``, which admission sizes rows against). Its
        ``host_memory`` is the budget of the host regions of ``retention="host"``, which
        admission counts over the running rows (:class:`~alisa.jobs.stream.ByteBudget`).
    kv_bytes, device_bytes
        Admission budgets (:class:`~alisa.jobs.stream.ByteBudget`): the KV alone, and weights
        + KV + activations; None: no limit.
    max_rows
        Rows running together at most.
    max_queue
        Requests accepted but not started at most; one more is answered 503 at once.
    max_tokens
        Tokens a request generates when it does not say (clipped to the model's context).
    reserve_tokens
        None: a row is admitted with room for all its ``max_tokens``. A count: with room for
        that many more only; rows that outgrow it are paused to host memory and resumed.
    prefill_tokens
        Padded prompt tokens of one prefill forward at most (None: no bound).
    packing
        Prefill a newcomer inside the running rows' decode step where the model allows it.
    compile
        Decode steps through ``torch.compile`` (``"auto"``: where that pays on the model's
        device, CUDA, and the mode has a static step; ``"on"``, ``"off"``): one graph per
        bucket of rows, rows joining and leaving static caches (:mod:`alisa.runtime.
        continuous`), compiled once for the server's life. The tokens are the same.
    max_cache_len
        Tokens per row (prompt and new tokens) of those static caches, rounded up to a
        capacity bucket; a request that needs more ends ``"context_exceeded"``. None: the
        model's context.
    """

    model_name: str
    config: AlisaConfig = field(default_factory=AlisaConfig)
    kv_bytes: int | None = None
    device_bytes: int | None = None
    max_rows: int = 64
    max_queue: int = 256
    max_tokens: int = 64
    reserve_tokens: int | None = None
    prefill_tokens: int | None = PREFILL_TOKENS
    packing: bool = True
    compile: str = "auto"
    max_cache_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"model_name={self.model_name!r} must be a non-empty name")
        # Every response carries the name, in UTF-8 (a command line's undecodable byte is not).
        check_text(self.model_name, f"model_name={self.model_name!r}")
        if not isinstance(self.config, AlisaConfig):
            raise ValueError(f"config={self.config!r} must be an AlisaConfig")
        check_untiered(self.config, "a server", "device_bytes (--gpu-memory)")
        check_host_admission(self.config, self.reserve_tokens)
        for name in ("max_rows", "max_queue", "max_tokens"):
            check_int(name, getattr(self, name), minimum=1)
        for name, minimum in (
            ("kv_bytes", 1),
            ("device_bytes", 1),
            ("reserve_tokens", 0),
            ("prefill_tokens", 1),
        ):
            if getattr(self, name) is not None:  # past 2**62: refused, as the CLI's flags
                check_int(name, getattr(self, name), minimum=minimum)
        check_compile(self.compile)
        if self.max_cache_len is not None:
            check_int("max_cache_len", self.max_cache_len, minimum=1)
        if not isinstance(self.packing, bool):
            raise ValueError(f"packing={self.packing!r} must be True or False")

    @property
    def budgets(self) -> dict[str, int | None]:
        """``{"kv": ..., "device": ..., "host": ...}`` bytes (None: no limit); ``host`` is the
        host regions' (``config.host_memory``, under ``retention="host"``)."""
        host = self.config.host_memory_bytes
        return {"kv": self.kv_bytes, "device": self.device_bytes, "host": host}
