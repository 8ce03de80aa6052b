"""Registry of KV policies: adding one is a short file, an entry here and a test-matrix entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alisa.policies.base import KVPolicy
from alisa.policies.dense import DensePolicy
from alisa.policies.h2o import H2OPolicy
from alisa.policies.local import LocalPolicy
from alisa.policies.streaming import StreamingPolicy
from alisa.policies.strided import StridedPolicy
from alisa.policies.swa import SWAPolicy
from alisa.policies.tova import TOVAPolicy

if TYPE_CHECKING:
    from alisa.config import AlisaConfig

POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls
    for cls in (
        DensePolicy,
        SWAPolicy,
        H2OPolicy,
        TOVAPolicy,
        StreamingPolicy,
        LocalPolicy,
        StridedPolicy,
    )
}

# PyramidKV's beta: the top layer keeps 1/beta of the mean budget, the bottom 2 - 1/beta.
PYRAMID_BETA = 20.0


def get_policy(name: str, **options) -> KVPolicy:
    """Build a policy by name; the error lists the valid names."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is unknown; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[name](**options)


def layer_budget_scale(layer_idx: int, num_layers: int, schedule: str, dense_layers: int) -> float:
    """Budget multiplier of one layer: 1 for ``uniform``; a linear ramp with mean 1 for ``pyramid``.

    PyramidKV (Cai et al., https://arxiv.org/abs/2406.02069) gives lower layers more tokens:
    cap_l = max - l * (max - min) / (L - 1) with min = mean / beta, max = 2 * mean - min.
    """
    sparse_layers = num_layers - dense_layers
    if schedule == "uniform" or sparse_layers <= 1:
        return 1.0
    low = 1.0 / PYRAMID_BETA
    high = 2.0 - low
    step = layer_idx - dense_layers
    return high - step * (high - low) / (sparse_layers - 1)


def policy_for_layer(config: AlisaConfig, layer_idx: int, num_layers: int) -> KVPolicy:
    """The policy instance one layer runs, with the config's options and its budget scale."""
    if layer_idx < config.dense_layers or config.policy == "dense":
        return DensePolicy()
    cls = POLICIES[config.policy]
    options: dict = {
        "caching_ratio": config.caching_ratio,
        "budget_tokens": config.budget_tokens,
        "recent_fraction": (
            cls.default_recent_fraction
            if config.recent_fraction is None
            else config.recent_fraction
        ),
        "sink_tokens": cls.default_sink_tokens
        if config.sink_tokens is None
        else config.sink_tokens,
        "budget_scale": layer_budget_scale(
            layer_idx, num_layers, config.layer_schedule, config.dense_layers
        ),
    }
    return cls(**options, **cls.config_options(config))


__all__ = ["POLICIES", "KVPolicy", "get_policy", "layer_budget_scale", "policy_for_layer"]
