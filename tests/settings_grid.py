"""The configs whose resolved settings are pinned in ``fixtures/settings_golden.json``.

The golden file was written by the resolution code before ``alisa.settings`` existed
(``policy_for_layer``, ``host_history_share``, ``selects_per_head`` of that release), so
``test_settings.py`` checks that one resolver changed no policy object any config runs.
"""

from __future__ import annotations

import itertools

from alisa.policies import POLICIES

NUM_LAYERS = 4
VARIANTS: tuple[dict, ...] = (
    {},
    {"caching_ratio": 0.2},
    {"budget_tokens": 100, "recent_fraction": 0.25},
    {"caching_ratio": 0.3, "layer_schedule": "pyramid", "dense_layers": 1},
    {"caching_ratio": 0.5, "sink_tokens": 2, "min_budget_tokens": 0, "observation_window": 3},
    {"caching_ratio": 0.5, "head_max": False, "score_decay": True, "score_window": 7},
    {"caching_ratio": 0.5, "stride": 3, "per_head": False},
    {"caching_ratio": 0.5, "per_head": True},
    {"caching_ratio": 0.5, "gpu_memory": "2GiB"},
    {"caching_ratio": 0.5, "history_share": 0.25},
    {"caching_ratio": 0.5, "history_share": 0.0},
)


def grid() -> list[dict]:
    """Keyword arguments of every valid config of the table (invalid combinations left out)."""
    from alisa.config import AlisaConfig

    result = []
    for policy, preset, retention, variant in itertools.product(
        sorted(POLICIES), ("default", "paper"), ("drop", "host"), VARIANTS
    ):
        kwargs = {"policy": policy, "preset": preset, "retention": retention, **variant}
        try:
            AlisaConfig(**kwargs)
        except ValueError:
            continue
        result.append(kwargs)
    return result


def key(kwargs: dict) -> str:
    """A stable name of one config of the grid."""
    return ",".join(f"{name}={kwargs[name]}" for name in sorted(kwargs))
