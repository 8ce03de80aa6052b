"""``GET /metrics``: the server's Prometheus metrics, in a registry of its own.

The engine thread sets the gauges after every scheduler step and counts tokens as it hands them
out; the HTTP side counts refusals. ``prometheus_client`` metrics are thread-safe, and a
registry per server (not the library's global one) lets tests and one process run several.
"""

from __future__ import annotations

import math
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from alisa.config import AlisaConfig

PREFIX = "alisa"
# Seconds: a CPU prefill of a long prompt takes seconds, a GPU decode step milliseconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, math.inf)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, math.inf)
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class ServeMetrics:
    """Every metric of one server.

    Parameters
    ----------
    config
        The server's cache settings (an info metric; requests may choose their own).
    budgets
        ``{"kv": bytes, "device": bytes}`` of the admission rule, None for no limit
        (exported as +Inf).
    model
        The served model's name.
    kernels
        The kernels its cache runs on this machine (:meth:`alisa.ops.backends.Ops.describe`;
        ``config.kernels`` is only the setting, ``"auto"`` by default).
    """

    def __init__(
        self,
        config: AlisaConfig,
        budgets: dict[str, int | None],
        model: str = "",
        kernels: str = "",
    ) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.running = Gauge(
            f"{PREFIX}_requests_running", "Rows in the running batch", registry=registry
        )
        self.waiting = Gauge(
            f"{PREFIX}_requests_waiting", "Requests accepted, not started", registry=registry
        )
        self.paused = Gauge(
            f"{PREFIX}_requests_paused",
            "Rows preempted: their KV swapped to host memory",
            registry=registry,
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "Requests finished, by reason: stop (EOS or a stop string), length (max_tokens), "
            "cancelled (the client left), error",
            ["reason"],
            registry=registry,
        )
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected",
            "Requests refused before they ran, by HTTP status",
            ["status"],
            registry=registry,
        )
        self.preemptions = Counter(
            f"{PREFIX}_preemptions", "Rows paused to host memory to make room", registry=registry
        )
        self.kv_bytes = Gauge(
            f"{PREFIX}_kv_bytes",
            "KV bytes held now, by tier: device (running rows), host (host retention's region "
            "and paused rows)",
            ["tier"],
            registry=registry,
        )
        self.kv_budget = Gauge(
            f"{PREFIX}_kv_budget_bytes",
            "Admission budgets: kv (the KV alone, --kv-memory), device (weights + KV + "
            "activations, --gpu-memory), host (the host regions of --retention host, "
            "--host-memory); +Inf: no limit",
            ["budget"],
            registry=registry,
        )
        self.steps = Counter(f"{PREFIX}_scheduler_steps", "Scheduler iterations", registry=registry)
        self.step_seconds = Histogram(
            f"{PREFIX}_scheduler_step_seconds",
            "Wall time of each scheduler iteration: one decode step of the running rows, with "
            "the prefills it carries (against the inter-token latency: what the engine spent, "
            "apart from what reached the clients)",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between a request's successive tokens",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "From a request's arrival to its last token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of the requests started", registry=registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated", registry=registry
        )
        self.cache = Info(
            f"{PREFIX}_cache",
            "The server's cache settings (a request may choose its own)",
            registry=registry,
        )
        self._initialise(config, budgets, model, kernels)

    def _initialise(
        self, config: AlisaConfig, budgets: dict[str, int | None], model: str, kernels: str
    ) -> None:
        """Every labelled series exists from the start (a scrape before any request sees 0)."""
        for reason in FINISH_REASONS:
            self.finished.labels(reason=reason)
        for status in ("400", "404", "503"):
            self.rejected.labels(status=status)
        for tier in ("device", "host"):
            self.kv_bytes.labels(tier=tier).set(0)
        for name, value in budgets.items():
            self.kv_budget.labels(budget=name).set(math.inf if value is None else value)
        settings = {item.name: str(getattr(config, item.name)) for item in fields(config)}
        settings.update({f"{name}_budget": str(value) for name, value in budgets.items()})
        self.cache.info({"model": model, **settings, "kernels_run": kernels})

    def exposition(self) -> bytes:
        """The text format a Prometheus scrape reads."""
        return generate_latest(self.registry)
