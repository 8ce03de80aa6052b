"""Registry of KV policies: adding one is a short file, an entry here (and in the package's
lazy exports) and a test-matrix entry.

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


def get_policy(name: str, **options) -> KVPolicy:
    """Build a policy by name; the error lists the valid names."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is unknown; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[name](**options)


__all__ = ["POLICIES", "get_policy"]
