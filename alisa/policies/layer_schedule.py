"""How the budget varies across layers (``AlisaConfig.layer_schedule``): uniform or pyramid."""

from __future__ import annotations

# PyramidKV's beta: the top layer keeps 1/beta of the mean budget, the bottom 2 - 1/beta.
PYRAMID_BETA = 20.0


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
