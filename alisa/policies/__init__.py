"""Registry of KV policies: adding one is a short file, an entry here and a test-matrix entry.

Policies import nothing from ``alisa.config``: the config builds each layer's policy
(:func:`alisa.config.policy_for_layer`) from this registry.
"""

from __future__ import annotations

from alisa.policies.base import KVPolicy
from alisa.policies.dense import DensePolicy
from alisa.policies.h2o import H2OPolicy
from alisa.policies.local import LocalPolicy
from alisa.policies.streaming import StreamingPolicy
from alisa.policies.strided import StridedPolicy
from alisa.policies.swa import SWAPolicy
from alisa.policies.tova import TOVAPolicy

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


__all__ = ["POLICIES", "DensePolicy", "KVPolicy", "get_policy", "layer_budget_scale"]
