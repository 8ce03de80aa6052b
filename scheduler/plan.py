"""The scheduler's answer: where KV and weights live over the generation, and what it costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scheduler.workload import Workload, fetch_growth

EPSILON = 1e-6


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """Placement of the kept KV during decode steps [start, stop)."""

    start: int
    stop: int
    kept_tokens: int
    device_fraction: float
    host_fraction: float  # alpha, the offload ratio
    recompute_fraction: float  # beta, the recompute ratio
    step_time_s: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A three-phase schedule: phase I (all on device) until p1, II (offload) until p2, then III.

    Attributes
    ----------
    p1, p2
        First decode step with KV on the host / with recomputed KV; ``None`` if never.
    weight_host_fraction
        Share of the weights kept on the host and streamed every step.
    peak_device_bytes, peak_host_bytes
        Largest predicted use of each tier (weights, KV, hidden states, working buffers).
    prefill_s, decode_s, tokens_per_s
        Predicted times and generated tokens per second (prefill included).
    simulated
        True when the hardware figures are published ones, not measured here.
    fetch_bytes_per_step
        retention="host": most bytes fetched from the host region per decode step, a bucket's
        mean (with ``reselect_every`` = s, a selecting step fetches s times that, the others
        nothing).
    """

    hardware: str
    model: str
    workload: Workload
    buckets: tuple[BucketPlan, ...]
    weight_host_fraction: float
    peak_device_bytes: float
    peak_host_bytes: float
    prefill_s: float
    decode_s: float
    simulated: bool
    fetch_bytes_per_step: float = 0.0

    @property
    def p1(self) -> int | None:
        return next((b.start for b in self.buckets if b.host_fraction > EPSILON), None)

    @property
    def p2(self) -> int | None:
        return next((b.start for b in self.buckets if b.recompute_fraction > EPSILON), None)

    @property
    def tokens_per_s(self) -> float:
        generated = self.workload.batch * self.workload.gen_len
        return generated / (self.prefill_s + self.decode_s)

    def tier_tokens(self) -> dict[str, int]:
        """Most tokens (whole batch) each tier holds at once over the generation."""
        return {
            "device": max(round(b.device_fraction * b.kept_tokens) for b in self.buckets),
            "host": max(round(b.host_fraction * b.kept_tokens) for b in self.buckets),
            "recompute": max(round(b.recompute_fraction * b.kept_tokens) for b in self.buckets),
        }

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            p1=self.p1, p2=self.p2, tokens_per_s=self.tokens_per_s, tier_tokens=self.tier_tokens()
        )
        return data

    def _retention_lines(self) -> list[str]:
        if self.workload.retention != "host":
            return []
        workload = self.workload
        every = workload.reselect_every
        interval = "every step" if every == 1 else f"every {every} steps"
        share = workload.fetch_share * fetch_growth(every)
        return [
            f"  retention host: every token kept on the host at {workload.host_bits} bits; "
            f"fetched per step {self.fetch_bytes_per_step / 2**20:.2f} MiB (a selection "
            f"{interval} fetches {share:.2g} of the budget); the device holds the budget and "
            "a sketch of every key (half its channels, bfloat16)"
        ]

    def describe(self) -> str:
        """A few lines for people: phases, ratios, memory, speed."""
        label = " (SIMULATION: published hardware figures)" if self.simulated else ""
        lines = [
            f"plan for {self.model} on {self.hardware}{label}",
            f"  workload: batch {self.workload.batch}, prompt {self.workload.prompt_len}, "
            f"generate {self.workload.gen_len}, caching ratio {self.workload.caching_ratio:g}, "
            f"KV {self.workload.kv_bits}-bit",
            f"  weights: {100 * (1 - self.weight_host_fraction):.0f} % on device, "
            f"{100 * self.weight_host_fraction:.0f} % on host",
            f"  phase switches: p1 = {self.p1 if self.p1 is not None else 'never'}, "
            f"p2 = {self.p2 if self.p2 is not None else 'never'}",
            f"  peak memory: device {self.peak_device_bytes / 2**30:.2f} GiB, "
            f"host {self.peak_host_bytes / 2**30:.2f} GiB",
            *self._retention_lines(),
            f"  predicted: prefill {self.prefill_s:.2f} s, decode {self.decode_s:.2f} s, "
            f"{self.tokens_per_s:.1f} tokens/s",
            "  steps        kept  device  host(alpha)  recompute(beta)  step ms",
        ]
        for b in self.buckets:
            lines.append(
                f"  {b.start:>5}-{b.stop:<5} {b.kept_tokens:>6}  {b.device_fraction:6.2f}  "
                f"{b.host_fraction:11.2f}  {b.recompute_fraction:15.2f}  "
                f"{1000 * b.step_time_s:7.2f}"
            )
        return "\n".join(lines)
