"""Named KV-cache systems for benchmarks: HF's caches and ALISA configurations.

``alisa`` names take ``AlisaConfig`` fields after a colon: ``alisa:policy=swa,caching_ratio=0.2,
kv_bits=8``. HF names: ``hf-dynamic``, ``hf-hqq8``, ``hf-quanto4``, ``hf-fp8`` (HQQ and quanto
need the ``peers`` extra).
"""

from __future__ import annotations

from dataclasses import fields

from alisa import AlisaConfig

HF_QUANTIZED = {
    "hf-hqq8": {"backend": "hqq", "nbits": 8},
    "hf-quanto4": {"backend": "quanto", "nbits": 4},
    "hf-fp8": {"backend": "fp8"},
}


def parse_alisa(name: str) -> AlisaConfig:
    """``alisa:key=value,...`` -> AlisaConfig; unknown keys and bad values raise ``ValueError``."""
    _, _, options = name.partition(":")
    types = {f.name: f.type for f in fields(AlisaConfig)}
    values = {}
    for item in filter(None, options.split(",")):
        key, _, raw = item.partition("=")
        if key not in types:
            raise ValueError(f"system {name!r}: unknown AlisaConfig field {key!r}")
        values[key] = _convert(raw, str(types[key]))
    return AlisaConfig(**values)


def system_name(config: AlisaConfig) -> str:
    """The ``alisa:...`` name of a config (its fields that differ from the defaults), which
    :func:`parse_alisa` reads back to an equal config."""
    default = AlisaConfig()
    changed = [
        f"{f.name}={getattr(config, f.name)}"
        for f in fields(AlisaConfig)
        if getattr(config, f.name) != getattr(default, f.name)
    ]
    return "alisa:" + ",".join(changed) if changed else "alisa"


def _convert(raw: str, annotation: str):
    if raw.lower() in ("none", "null"):
        return None
    if "bool" in annotation:
        return raw.lower() in ("1", "true", "yes")
    if "float" in annotation:
        return float(raw)
    if "int" in annotation:
        return int(raw)
    return raw


def make_cache(name: str, model):
    """(cache or None, AlisaConfig or None) for a system name; None cache means a new AlisaCache."""
    from transformers import DynamicCache, QuantizedCache

    if name == "hf-dynamic":
        return DynamicCache(), None
    if name in HF_QUANTIZED:
        return QuantizedCache(config=model.config, **HF_QUANTIZED[name]), None
    if name == "alisa" or name.startswith("alisa:"):
        return None, parse_alisa(name)
    raise ValueError(
        f"unknown system {name!r}; use hf-dynamic, {', '.join(HF_QUANTIZED)} or alisa:..."
    )
