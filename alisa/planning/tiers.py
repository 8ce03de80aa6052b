"""Tier sizes at run time: the scheduler's plan turned into device / host / recompute regions.

ALISA's phases II and III (https://arxiv.org/abs/2403.17312, §V): the LP over the calibrated cost
model decides how much of each layer's kept KV stays on the device, goes to the host, or is
recomputed; :class:`TierPlanner` sizes the regions from it, splits each layer's prefill, and
starts copying the next layer's host tier while a layer finishes its decode step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import psutil
import torch

from alisa.config import AlisaConfig
from alisa.planning.hardware import machine_profile
from alisa.planning.spec import config_workload, model_spec
from alisa.sizes import parse_bytes
from alisa.storage.regions import RegionContext, TierStats
from alisa.storage.store import KVStore, TokenInputs
from alisa.storage.tiers import TieredStore, TierLayout, split_prefill
from scheduler import (
    HardwareProfile,
    Options,
    Plan,
    activation_bytes,
    gathered_layers,
    solve,
)

# Prompt tokens recomputed per layer to check the recomputer against the model's own K/V, and the
# largest difference allowed, relative to the largest stored value (INT4 rounds to 1/30 of it).
RECOMPUTE_CHECK_TOKENS = 8
RECOMPUTE_TOLERANCE = 0.05


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
        self,
        model,
        shape,
        config: AlisaConfig,
        region_factory,
        recompute,
        max_new_tokens: int,
        *,
        pinned: bool = False,
    ):
        self.spec = model_spec(model, shape)
        self.shape, self.config = shape, config
        self.region_factory, self.recomputer = region_factory, recompute
        self.max_new_tokens = max_new_tokens
        self.device = next(model.parameters()).device
        self.host_device = torch.device("cpu")
        self.pinned = pinned  # host regions page-locked (alisa.ops.backends.Ops.pinned)
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
        host_bytes = config.host_memory_bytes
        if host_bytes is None:
            host_bytes = psutil.virtual_memory().available
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
        try:
            self.plan = solve(
                profile,
                self.spec,
                workload,
                Options(allow_recompute=self.recompute_enabled, allow_weight_offload=False),
            )
        except ValueError as error:
            raise ValueError(in_config_terms(str(error), config)) from None
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
        new width. ``slots`` is the layer's :class:`~alisa.kv.slots.SlotMap`; ``inputs`` gives the
        attention inputs of a span of its first slots (for the recompute region).
        """
        keys, values = store.read(slots.positions)
        checked = self.layout is None and self.recompute_enabled and inputs is not None
        if checked:
            # Before the plan: an architecture whose K/V the recomputer cannot rebuild is
            # refused ("always") or planned without the recompute tier ("auto").
            error = self._recompute_error(layer_idx, keys, values, slots, inputs)
            if error is not None and self.config.recompute == "always":
                raise ValueError(error)
            self.recompute_enabled = error is None
        layout = self.decide(len(slots.kept), slots.seen)
        if layout.recompute and not checked:  # every layer the plan recomputes is checked
            error = self._recompute_error(layer_idx, keys, values, slots, inputs)
            if error is not None:
                raise ValueError(error)
        context = RegionContext(
            factory=self.region_factory,
            model_device=self.device,
            host_device=self.host_device,
            recompute=partial(self.recomputer, layer_idx) if layout.recompute else None,
            stats=TierStats(),
            pinned=self.pinned,
        )
        width = slots.width
        tiered, counts = split_prefill(
            keys[:, :, :width], values[:, :, :width], inputs, layout, context
        )
        self.stores[layer_idx] = tiered
        return (tiered, *_mapping(tiered, counts))

    def _recompute_error(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, slots, inputs
    ) -> str | None:
        """Why this layer's K/V cannot be rebuilt from its attention inputs, or None.

        The first stored prompt tokens are recomputed and compared with what the model itself
        produced ((B, H_kv, S, D) ``keys``/``values`` in slot order): a key path the recomputer
        does not replay (a key norm, partial or per-layer rotary, multi-query fused projections)
        shows as a mismatch or an error here, never as different tokens later.
        """
        count = min(RECOMPUTE_CHECK_TOKENS, slots.width)
        try:
            span = inputs(slice(0, count))
            rebuilt = self.recomputer(layer_idx, span.hidden, span.rope)
        except (RuntimeError, TypeError, ValueError, AttributeError) as error:
            return self._cannot_recompute(layer_idx, f"{type(error).__name__}: {error}")
        held = (slots.positions[:, 0, :count] >= 0).view(-1, 1, count, 1)
        for name, made, stored in zip(("keys", "values"), rebuilt, (keys, values), strict=True):
            stored = stored[:, :, :count].to(made.dtype)
            if made.shape != stored.shape:
                return self._cannot_recompute(layer_idx, f"{name} of shape {tuple(made.shape)}")
            error = ((made - stored) * held).abs().max()
            # Quantized stores hold values to within half a step: a few per cent of the range.
            if error > RECOMPUTE_TOLERANCE * stored.abs().max() + 1e-5:
                return self._cannot_recompute(layer_idx, f"{name} off by {float(error):.3g}")
        return None

    def _cannot_recompute(self, layer_idx: int, detail: str) -> str:
        return (
            f"{self.spec.name}: layer {layer_idx}'s keys and values cannot be recomputed exactly "
            f"from its attention inputs ({detail}); use recompute='never' (host offload only)"
        )

    # ---- after each decode step: prefetch a layer ahead -----------------------------------

    def after_step(self, layer_idx: int) -> None:
        """Start the next layer's host copy while this layer's step completes."""
        if self.shape.num_layers <= 2:  # the next layer would be the one running next anyway
            return
        following = self.stores.get((layer_idx + 1) % self.shape.num_layers)
        if following is not None:
            following.prefetch()


# The scheduler names the profile's budgets; the user set them as these config fields.
BUDGET_FIELDS = {"device_bytes": "gpu_memory", "host_bytes": "host_memory"}


def in_config_terms(message: str, config: AlisaConfig) -> str:
    """A scheduler message that starts ``device_bytes=N`` / ``host_bytes=N``, restated with the
    config field (and flag) that set that budget, so the user sees what to change."""
    name, _, rest = message.partition("=")
    field = BUDGET_FIELDS.get(name)
    if field is None:
        return message
    count, _, rest = rest.partition(" ")
    value = getattr(config, field)
    flag = "--" + field.replace("_", "-")
    if value is None:  # the budget came from the hardware profile (or psutil's available)
        return f"{field} unset ({flag}; {count} bytes from the hardware profile) {rest}"
    return f"{field}={value!r} ({flag}, {count} bytes) {rest}"


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
