"""Cost model of one decode step and the memory it needs, per step bucket and placement.

Notation (ALISA Table II, https://arxiv.org/abs/2403.17312): per bucket b of decode steps, the
kept KV is split into fractions g (device), c (host, offload ratio alpha) and x (deleted and
recomputed from stored attention inputs, recompute ratio beta); w is the share of weights kept on
the host. Every quantity below is linear in (g, c, x, w), so the same terms serve the LP and the
evaluation of a fixed plan.

Step time: compute = overhead + max(weights / mem_bw, FLOPs / flops) + kept KV / mem_bw;
recompute = x * kept * FLOPs_per_token / flops; transfer = (c * kept * kv + x * kept * hidden
+ w * weights) / h2d + newly offloaded bytes / d2h. With copy/compute overlap (CUDA streams) a
step takes max(compute + recompute, transfer), else their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.hardware import HardwareProfile
from scheduler.model import ModelSpec
from scheduler.workload import Workload, fetch_growth

VARIABLES = ("g", "c", "x", "w", "moved_kv", "moved_hidden")


@dataclass(frozen=True)
class Linear:
    """constant + sum(coefficient[v] * v) over the placement variables."""

    constant: float
    coefficients: dict[str, float]

    def value(self, values: dict[str, float]) -> float:
        return self.constant + sum(k * values.get(v, 0.0) for v, k in self.coefficients.items())


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Decode steps [start, stop): their count, mean and largest kept and seen tokens (whole
    batch; seen tokens matter with retention="host", which keeps all of them somewhere)."""

    start: int
    stop: int
    mean_kept: float
    max_kept: int
    mean_seen: float = 0.0
    max_seen: int = 0

    @property
    def steps(self) -> int:
        return self.stop - self.start


def make_buckets(workload: Workload, count: int = 16) -> list[Bucket]:
    """Split the decode steps into up to ``count`` equal buckets."""
    count = max(1, min(count, workload.gen_len))
    edges = [round(i * workload.gen_len / count) for i in range(count + 1)]
    result = []
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        kept = workload.kept_per_step(start, stop).tolist()
        seen = workload.seen_per_step(start, stop).tolist()
        result.append(
            Bucket(
                start=start,
                stop=stop,
                mean_kept=sum(kept) / len(kept),
                max_kept=max(kept),
                mean_seen=sum(seen) / len(seen),
                max_seen=max(seen),
            )
        )
    return result


def gathered_layers(num_layers: int) -> int:
    """Layers whose off-device KV sits on the device at once: the attending one and, with more
    than two layers, the next one (prefetched a layer ahead)."""
    return 2 if num_layers > 2 else 1


def activation_bytes(model: ModelSpec, batch: int) -> float:
    """Working activations of one decode step: hidden states, MLP, float32 logits."""
    per_token = (4 * model.hidden_size + 2 * model.intermediate_size) * model.bytes_per_element
    return batch * (per_token + 4 * model.vocab_size)


@dataclass(frozen=True)
class CostModel:
    """Step time and memory terms for one (hardware, model, workload)."""

    hardware: HardwareProfile
    model: ModelSpec
    workload: Workload

    @property
    def kv_token(self) -> float:
        return self.model.kv_bytes_per_token(self.workload.kv_bits)

    @property
    def hidden_token(self) -> float:
        return self.model.hidden_bytes_per_token(self.workload.hidden_bits)

    @property
    def activation_bytes(self) -> float:
        return activation_bytes(self.model, self.workload.batch)

    @property
    def host_retention(self) -> bool:
        return self.workload.retention == "host"

    def retention_terms(self, bucket: Bucket) -> dict[str, float]:
        """retention="host", per decode step: the selection over every token's key sketch
        (``scoring_s``), the fetch of the tokens it newly chose from the host (``fetch_bytes``,
        theta^g) and the tokens attended beyond the budget (``extra_kept``, whole batch); held,
        the sketch (device bytes) and the host region of every token (host bytes). Zeros with
        retention="drop".

        A selection (scoring, top-k, slot swaps) runs at the profile's calibrated
        ``select_bytes_per_s`` plus ``select_overhead_s``; a profile without them (presets,
        older profiles) costs it as reading the sketch at the KV read rate. It fetches
        ``fetch_share`` of the budget, times :func:`~scheduler.workload.fetch_growth` when it
        comes ``reselect_every`` steps after the last. Both are paid once per ``reselect_every``
        steps and charged here as their mean per step: exact when copies add to the compute
        (a CPU); with overlapping copies, optimistic when one selection's fetch outlasts a
        step's compute. Between selections a layer attends to its last choice plus the tokens
        written since: on average (s - 1) / 2 tokens per sequence (in every layer and KV head)
        beyond the budget, an upper bound (the budget itself grows r a step, and layers that
        keep everything never select). None at the default s = 1 and small at s = 4 (1.5 tokens
        against a budget of at least 64, under 1 % of the attention read at 1024 tokens and
        r = 0.2) but not for long intervals on small budgets, so the read is charged; the few
        slots it holds are left out of the memory.
        """
        if not self.host_retention:
            return dict.fromkeys(
                ("scoring_s", "fetch_bytes", "extra_kept", "sketch_bytes", "region_bytes"), 0.0
            )
        wl, model, hw = self.workload, self.model, self.hardware
        sketch = model.sketch_bytes_per_token()
        rate = hw.select_bytes_per_s or hw.kv_bytes_per_s or hw.device_bytes_per_s
        every = wl.reselect_every
        fetched = wl.fetch_share * fetch_growth(every) * bucket.mean_kept
        return {
            "scoring_s": (hw.select_overhead_s + bucket.mean_seen * sketch / rate) / every,
            "fetch_bytes": fetched * model.kv_bytes_per_token(wl.host_bits) / every,
            "extra_kept": wl.batch * (every - 1) / 2,
            "sketch_bytes": bucket.max_seen * sketch,
            "region_bytes": bucket.max_seen * model.kv_bytes_per_token(wl.host_bits),
        }

    def compute(self, bucket: Bucket) -> Linear:
        hw, model = self.hardware, self.model
        weights = max(
            model.total_weight_bytes / hw.device_bytes_per_s,
            self.workload.batch * model.decode_flops_per_token() / hw.device_flops,
        )
        retention = self.retention_terms(bucket)
        attended = bucket.mean_kept + retention["extra_kept"]
        attention = attended * self.kv_token / (hw.kv_bytes_per_s or hw.device_bytes_per_s)
        return Linear(hw.step_overhead_s + weights + attention + retention["scoring_s"], {})

    def recompute(self, bucket: Bucket) -> Linear:
        rate = self.hardware.recompute_flops or self.hardware.device_flops
        per_token = self.model.recompute_flops_per_token() / rate
        return Linear(0.0, {"x": bucket.mean_kept * per_token})

    def transfer(self, bucket: Bucket) -> Linear:
        hw = self.hardware
        fetched = self.retention_terms(bucket)["fetch_bytes"]
        return Linear(
            fetched / hw.h2d_bytes_per_s,
            {
                "c": bucket.mean_kept * self.kv_token / hw.h2d_bytes_per_s,
                "x": bucket.mean_kept * self.hidden_token / hw.h2d_bytes_per_s,
                "w": self.model.total_weight_bytes / hw.h2d_bytes_per_s,
                # tokens newly moved out during the bucket, spread over its steps
                "moved_kv": self.kv_token / (hw.d2h_bytes_per_s * bucket.steps),
                "moved_hidden": self.hidden_token / (hw.d2h_bytes_per_s * bucket.steps),
            },
        )

    def device_bytes(self, bucket: Bucket) -> Linear:
        """Resident KV and weights, the gathered off-device KV of the attending layer (and of the
        prefetched next one, for host KV), and activations."""
        layer_share = bucket.max_kept * self.kv_token / self.model.num_layers
        weights = self.model.total_weight_bytes
        sketch = self.retention_terms(bucket)["sketch_bytes"]
        return Linear(
            weights + self.activation_bytes + sketch,
            {
                "g": bucket.max_kept * self.kv_token,
                "c": gathered_layers(self.model.num_layers) * layer_share,
                "x": layer_share,
                "w": -weights
                + weights / self.model.num_layers,  # one streamed layer stays resident
            },
        )

    def host_bytes(self, bucket: Bucket) -> Linear:
        return Linear(
            self.retention_terms(bucket)["region_bytes"],
            {
                "c": bucket.max_kept * self.kv_token,
                "x": bucket.max_kept * self.hidden_token,
                "w": self.model.total_weight_bytes,
            },
        )

    def step_time(self, bucket: Bucket, values: dict[str, float]) -> float:
        """Predicted time of one step of the bucket under a placement."""
        busy = self.compute(bucket).value(values) + self.recompute(bucket).value(values)
        moving = self.transfer(bucket).value(values)
        return max(busy, moving) if self.hardware.overlap else busy + moving

    def prefill_time(self) -> float:
        """Prompt processing: matmul FLOPs (compute-bound) plus reading the weights once."""
        hw, model, wl = self.hardware, self.model, self.workload
        tokens = wl.batch * wl.prompt_len
        flops = tokens * model.decode_flops_per_token()
        attention = (
            4.0
            * wl.batch
            * wl.prompt_len**2
            * model.num_heads
            * model.head_dim
            * model.num_layers
            / 2
        )
        return (
            flops + attention
        ) / hw.device_flops + model.total_weight_bytes / hw.device_bytes_per_s
