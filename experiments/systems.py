"""Named KV-cache systems for benchmarks: HF's caches and ALISA configurations.

``alisa`` names take ``AlisaConfig`` fields after a colon: ``alisa:policy=swa,caching_ratio=0.2,
kv_bits=8``; ``alisa-compiled:...`` is the same cache made static (``max_cache_len``), its decode
steps through ``torch.compile``. HF names: ``hf-dynamic``; ``hf-static`` and
``hf-static-compiled`` (``StaticCache`` sized for the run, its decode steps eager or through
``torch.compile``); ``hf-offloaded``
(``DynamicCache(offloading=True)``: each layer's KV waits in CPU memory between its uses, the next
layer's copied ahead); ``hf-hqq8``, ``hf-quanto4``, ``hf-fp8`` (HQQ and quanto need the ``peers``
extra).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace

from alisa import AlisaConfig
from alisa.assignments import parse_assignments
from alisa.settings import IgnoredSettingWarning

HF_QUANTIZED = {
    "hf-hqq8": {"backend": "hqq", "nbits": 8},
    "hf-quanto4": {"backend": "quanto", "nbits": 4},
    "hf-fp8": {"backend": "fp8"},
}
# HF's StaticCache, and whether its decode steps run compiled (alisa.generate's ``compile``).
HF_STATIC = {"hf-static": "off", "hf-static-compiled": "on"}


# An alisa system whose decode steps run compiled: ``alisa-compiled:<fields>``, a static
# AlisaCache (max_cache_len: the run's longest prompt and new tokens, as a StaticCache).
ALISA_COMPILED = "alisa-compiled"


def compile_setting(name: str) -> str:
    """``"on"`` for a system whose decode steps run compiled, else ``"off"``."""
    if name.split(":")[0] == ALISA_COMPILED:
        return "on"
    return HF_STATIC.get(name, "off")


def parse_alisa(name: str) -> AlisaConfig:
    """``alisa:key=value,...`` -> AlisaConfig; values are typed by the field
    (:func:`alisa.assignments.parse_field`: ``gpu_memory=2GiB``, ``per_head=false``,
    ``sink_tokens=none``); unknown keys and bad values raise ``ValueError`` naming the system."""
    _, _, options = name.partition(":")
    try:
        items = [item for item in options.split(",") if item]
        return AlisaConfig(**parse_assignments(AlisaConfig, items))
    except ValueError as error:
        raise ValueError(f"system {name!r}: {error}") from None


def point_overrides(point: dict) -> dict:
    """A sweep point's ``AlisaConfig`` fields (applied over its ``system``'s configuration)."""
    names = {f.name for f in fields(AlisaConfig)}
    return {key: value for key, value in point.items() if key in names}


def changed_settings(config: AlisaConfig) -> list[str]:
    """``name=value`` of each field of ``config`` that differs from the defaults, in field order."""
    default = AlisaConfig()
    return [
        f"{f.name}={getattr(config, f.name)}"
        for f in fields(AlisaConfig)
        if getattr(config, f.name) != getattr(default, f.name)
    ]


def system_name(config: AlisaConfig) -> str:
    """The ``alisa:...`` name of a config (its fields that differ from the defaults), which
    :func:`parse_alisa` reads back to an equal config."""
    changed = changed_settings(config)
    return "alisa:" + ",".join(changed) if changed else "alisa"


@dataclass(frozen=True, kw_only=True)
class HostPair:
    """A host-retention system, its drop partner at the same r, and the r = 1 drop system."""

    host: str
    drop: str
    full: str | None
    caching_ratio: float


def host_pairs(systems: list[str]) -> list[HostPair]:
    """The :class:`HostPair` of every ``retention=host`` system whose drop partner is listed."""
    configs = {name: parse_alisa(name) for name in systems if name.split(":")[0] == "alisa"}
    named = {config: name for name, config in configs.items()}
    pairs = []
    for name, config in configs.items():
        if config.retention != "host":
            continue
        # Fields only host retention reads go back to their defaults in the drop partner.
        drop = replace(
            config,
            retention="drop",
            history_share=None,
            estimate_rest=None,
            host_bits=AlisaConfig.host_bits,
        )
        if drop in named:
            with warnings.catch_warnings():  # a lookup key, never run: its notes are not the user's
                warnings.simplefilter("ignore", IgnoredSettingWarning)
                full = named.get(replace(drop, caching_ratio=1.0))
            ratio = config.caching_ratio
            pairs.append(HostPair(host=name, drop=named[drop], full=full, caching_ratio=ratio))
    return pairs


def make_cache(name: str, model, *, max_cache_len: int | None = None):
    """(cache or None, AlisaConfig or None) for a system name; None cache means a new AlisaCache.
    ``max_cache_len``: the longest prompt plus the new tokens, which a StaticCache is sized for."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    from alisa import AlisaCache  # here: the CLI reads system names without loading torch

    if name == "hf-dynamic":
        # With the model's config, sliding-window layers (Gemma 3, ...) keep only their window,
        # as HF's own generate() builds the cache.
        return DynamicCache(config=model.config), None
    if name in HF_STATIC:
        if max_cache_len is None:
            raise ValueError(f"system {name!r} is sized per run: decode and context modes only")
        return StaticCache(config=model.config, max_cache_len=max_cache_len), None
    if name == "hf-offloaded":
        if model.device.type != "cuda":
            raise ValueError("system 'hf-offloaded' needs a model on CUDA (HF copies on streams)")
        return DynamicCache(config=model.config, offloading=True), None
    if name in HF_QUANTIZED:
        return QuantizedCache(config=model.config, **HF_QUANTIZED[name]), None
    if name == "alisa" or name.startswith("alisa:"):
        return None, parse_alisa(name)
    if name.split(":")[0] == ALISA_COMPILED:
        if max_cache_len is None:
            raise ValueError(f"system {name!r} is sized per run: decode and context modes only")
        return AlisaCache(model, parse_alisa(name), max_cache_len=max_cache_len), None
    raise ValueError(
        f"unknown system {name!r}; use hf-dynamic, {', '.join(HF_STATIC)}, hf-offloaded, "
        f"{', '.join(HF_QUANTIZED)}, alisa:... or {ALISA_COMPILED}:..."
    )
