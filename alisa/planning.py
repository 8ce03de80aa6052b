"""Glue between the runtime and the scheduler: model shape, this machine's profile, tier sizes."""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import psutil
import torch
from torch import nn

from alisa.architecture import ModelShape
from alisa.config import AlisaConfig
from alisa.memory import parse_bytes
from alisa.models import cache_root
from alisa.storage.regions import RegionContext, TierStats
from alisa.storage.store import KVStore, TokenInputs
from alisa.storage.tiers import TieredStore, TierLayout, split_prefill
from scheduler import (
    HardwareProfile,
    ModelSpec,
    Options,
    Plan,
    Workload,
    activation_bytes,
    gathered_layers,
    load_profile,
    solve,
)


def config_workload(
    config: AlisaConfig, num_layers: int, *, batch: int, prompt_len: int, gen_len: int
) -> Workload:
    """The scheduler's :class:`~scheduler.Workload` of generating with ``config``.

    Every layer's budget rule is the cache's own (:meth:`AlisaConfig.keep_rules`: sinks, floor,
    token budget, pyramid scales, dense layers), r is 1 when nothing can be evicted, and no
    recent window is pinned to the device (the runtime places kept tokens by slot, not by age).

    Raises
    ------
    ValueError
        A ``batch``, ``prompt_len`` or ``gen_len`` below 1 (named by ``Workload``).
    """
    return Workload(
        batch=batch,
        prompt_len=prompt_len,
        gen_len=gen_len,
        caching_ratio=1.0 if config.keeps_everything else config.caching_ratio,
        keep=config.keep_rules(num_layers),
        kv_bits=config.kv_bits,
        recent_fraction=0.0,
        retention=config.retention,
        host_bits=config.host_bits,
    )


def model_spec(model: nn.Module, shape: ModelShape, name: str | None = None) -> ModelSpec:
    """The scheduler's view of a loaded (or empty-weights) model."""
    config = model.config
    parameters = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    element = parameters[0].element_size() if parameters else 2
    return ModelSpec(
        name=name or getattr(config, "_name_or_path", None) or type(model).__name__,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * shape.hidden_size,
        vocab_size=config.vocab_size,
        bytes_per_element=element,
        weight_bytes=sum(p.numel() * p.element_size() for p in parameters),
    )


def empty_model_spec(spec: str, dtype: str = "bfloat16") -> tuple[ModelSpec, bool]:
    """(ModelSpec, recomputable) of a preset or a model spec, without loading any weights.

    Presets (``opt-13b``, ...) come from ``scheduler.MODEL_PRESETS``; anything else is resolved
    like ``load_model`` and instantiated on the meta device with accelerate's
    ``init_empty_weights``, so only the config is read.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from alisa.architecture import model_shape
    from alisa.models import resolve_dtype, resolve_model_path
    from alisa.storage.recompute import KVRecomputer
    from scheduler import MODEL_PRESETS

    if spec.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[spec.lower()], True
    config = AutoConfig.from_pretrained(resolve_model_path(spec))
    torch_dtype = resolve_dtype(dtype) or torch.bfloat16
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.tie_weights()
    shape = model_shape(model)
    try:
        KVRecomputer(model)
        recomputable = True
    except ValueError:
        recomputable = False
    unique = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in unique)
    return replace(model_spec(model, shape, name=spec), weight_bytes=weight_bytes), recomputable


def default_profile_path(device: torch.device) -> Path:
    """Where ``alisa profile`` saves this machine's profile for a device type."""
    return cache_root() / f"profile-{platform.node() or 'host'}-{device.type}.json"


def cpu_model() -> str:
    """This machine's CPU model name (recorded in a measured profile, checked by the plan)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: platform.processor() is often empty or just "x86_64"
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def machine_profile(device: torch.device, path: str | None = None) -> HardwareProfile:
    """The measured profile if there is one (``alisa profile``), else rough defaults.

    The defaults (noted in the name) only steer the host-versus-recompute choice; byte budgets
    are always exact.
    """
    chosen = Path(path).expanduser() if path else default_profile_path(device)
    if path or chosen.is_file():
        return load_profile(chosen)
    memory = psutil.virtual_memory()
    return HardwareProfile(
        name=f"{device.type} (defaults, not measured: run `alisa profile`)",
        device_bytes=memory.total,
        host_bytes=memory.available,
        h2d_bytes_per_s=5e9,
        d2h_bytes_per_s=5e9,
        device_flops=5e10,
        device_bytes_per_s=1e10,
        overlap=device.type == "cuda",
        device_type=device.type,
        cpu_model=cpu_model(),
    )


class TierPlanner:
    """Sizes the device/host/recompute regions from byte budgets and the scheduler's plan.

    It also splits each layer's prefill into a tiered store (:meth:`split`) and, after each
    layer's decode step, starts copying the next layer's host tier (:meth:`after_step`).

    Parameters
    ----------
    model, shape, config
        The model and the cache's configuration (``gpu_memory``, ``host_memory``, ``kv_bits``).
    region_factory
        Builds a (dense or quantized) store for one region.
    recompute
        ``KVRecomputer`` of the model, or None when its architecture cannot be recomputed.
    max_new_tokens
        Generation length the plan assumes.
    """

    def __init__(
        self, model, shape, config: AlisaConfig, region_factory, recompute, max_new_tokens: int
    ):
        self.spec = model_spec(model, shape)
        self.shape, self.config = shape, config
        self.region_factory, self.recomputer = region_factory, recompute
        self.max_new_tokens = max_new_tokens
        self.device = next(model.parameters()).device
        self.host_device = torch.device("cpu")
        self.layout: TierLayout | None = None
        self.plan: Plan | None = None
        self.recompute_enabled = recompute is not None and config.recompute != "never"
        self.keeps_inputs = self.recompute_enabled  # layers keep attention inputs to recompute
        self.stores: dict[int, TieredStore] = {}  # by layer, for prefetching a layer ahead

    def decide(self, batch: int, prompt_len: int) -> TierLayout:
        """Tier sizes per sequence and layer, decided once (first layer's prefill)."""
        if self.layout is not None:
            return self.layout
        config = self.config
        device_bytes = parse_bytes(config.gpu_memory, field="gpu_memory")
        profile = machine_profile(self.device, config.profile)
        host_bytes = (
            parse_bytes(config.host_memory, field="host_memory")
            if config.host_memory is not None
            else psutil.virtual_memory().available
        )
        profile = HardwareProfile(
            **{**profile.__dict__, "device_bytes": device_bytes, "host_bytes": host_bytes}
        )
        workload = config_workload(
            config,
            self.spec.num_layers,
            batch=batch,
            prompt_len=prompt_len,
            gen_len=max(1, self.max_new_tokens),
        )
        self.plan = solve(
            profile,
            self.spec,
            workload,
            Options(allow_recompute=self.recompute_enabled, allow_weight_offload=False),
        )
        slot_bytes = self.spec.kv_bytes_per_token(config.kv_bits) * batch  # all layers
        resident = device_bytes - self.spec.total_weight_bytes - activation_bytes(self.spec, batch)
        # Besides the resident slots, the device briefly holds the off-device KV of two layers
        # (the one attending and the one prefetched): D*S + 2*(K - D)*S/L <= resident.
        kept = workload.kept_tokens(workload.gen_len - 1) // batch
        share = gathered_layers(self.spec.num_layers) / self.spec.num_layers
        room = resident - share * kept * slot_bytes
        device_slots = max(0, math.floor(room / (slot_bytes * max(1e-9, 1 - share))))
        device_slots = min(device_slots, kept + 1)
        tiers = self.plan.tier_tokens()
        recompute = self.recompute_enabled and (
            config.recompute == "always" or tiers["recompute"] > 0
        )
        host_slots = math.ceil(tiers["host"] / batch) if recompute else 0
        if config.recompute == "always":
            host_slots = 0
        self.layout = TierLayout(
            device_slots=device_slots, host_slots=host_slots, recompute=recompute
        )
        return self.layout

    def split(
        self,
        layer_idx: int,
        store: KVStore,
        slots,
        inputs: Callable[[slice], TokenInputs] | None,
    ) -> tuple[TieredStore, torch.Tensor, int]:
        """Convert a layer's compacted prefill store to tiers.

        Returns the tiered store, for each new slot the old slot it holds (-1: none), and the
        new width. ``slots`` is the layer's :class:`~alisa.slots.SlotMap`; ``inputs`` gives the
        attention inputs of a span of its first slots (for the recompute region).
        """
        layout = self.decide(len(slots.kept), slots.seen)
        context = RegionContext(
            factory=self.region_factory,
            model_device=self.device,
            host_device=self.host_device,
            recompute=partial(self.recomputer, layer_idx) if layout.recompute else None,
            stats=TierStats(),
        )
        keys, values = store.read(slots.positions)
        width = slots.width
        tiered, counts = split_prefill(
            keys[:, :, :width], values[:, :, :width], inputs, layout, context
        )
        self.stores[layer_idx] = tiered
        return (tiered, *_mapping(tiered, counts))

    # ---- after each decode step: prefetch a layer ahead -----------------------------------

    def after_step(self, layer_idx: int) -> None:
        """Start the next layer's host copy while this layer's step completes."""
        if self.shape.num_layers <= 2:  # the next layer would be the one running next anyway
            return
        following = self.stores.get((layer_idx + 1) % self.shape.num_layers)
        if following is not None:
            following.prefetch()


def _mapping(store: TieredStore, counts: list[int]) -> tuple[torch.Tensor, int]:
    """For each new slot, the old slot it holds (-1 for none), and the new width.

    Region i took the next ``counts[i]`` old slots, at its own start.
    """
    mapping = torch.full((store.capacity,), -1, dtype=torch.long)
    old, new_width, offset = 0, 0, 0
    for (_, slots), count in zip(store.regions, counts, strict=True):
        if count > 0:
            mapping[offset : offset + count] = torch.arange(old, old + count)
            new_width = offset + count
        old += count
        offset += slots
    return mapping.to(store.model_device), new_width
