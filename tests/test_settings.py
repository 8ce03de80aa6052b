import json
from pathlib import Path

import pytest

from alisa import AlisaConfig
from alisa.config import policy_for_layer
from alisa.settings import resolve_settings
from tests.settings_grid import NUM_LAYERS, grid, key

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "settings_golden.json").read_text())


def test_the_grid_covers_every_golden_config():
    assert sorted(key(kwargs) for kwargs in grid()) == sorted(GOLDEN["configs"])


@pytest.mark.parametrize("kwargs", grid(), ids=key)
def test_resolution_matches_the_release_before_the_resolver(kwargs):
    # Every policy object, per-head choice and history share as the code before alisa.settings.
    config = AlisaConfig(**kwargs)
    expected = GOLDEN["configs"][key(kwargs)]
    settings = resolve_settings(config, NUM_LAYERS)
    policies = [GOLDEN["policies"][index] for index in expected["layers"]]
    assert [repr(layer.build()) for layer in settings.layers] == policies
    assert [repr(policy_for_layer(config, i, NUM_LAYERS)) for i in range(NUM_LAYERS)] == policies
    assert settings.per_head == config.selects_per_head == expected["selects_per_head"]
    assert settings.history_share == config.host_history_share == expected["host_history_share"]
