from dataclasses import fields

import pytest

from alisa import AlisaConfig
from alisa.config import policy_for_layer
from alisa.policies import POLICIES


def test_defaults_are_dense_and_keep_everything():
    config = AlisaConfig()
    assert config.policy == "dense"
    assert config.keeps_everything


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("caching_ratio", 0.0),
        ("caching_ratio", 1.5),
        ("caching_ratio", -0.2),
        ("caching_ratio", float("nan")),
        ("budget_tokens", 0),
        ("budget_tokens", 2.5),
        ("recent_fraction", 1.2),
        ("sink_tokens", -1),
        ("score_window", 0),
        ("stride", 0),
        ("dense_layers", -1),
        ("layer_schedule", "triangle"),
        ("kv_bits", 3),
        ("kv_bits", True),
        ("per_head", "yes"),
    ],
)
def test_bad_values_name_the_field_and_value(field, value):
    with pytest.raises(ValueError) as error:
        AlisaConfig(**{field: value})
    assert field in str(error.value)
    assert repr(value) in str(error.value)


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError) as error:
        AlisaConfig(policy="magic")
    message = str(error.value)
    assert "'magic'" in message
    for name in POLICIES:
        assert name in message


def test_config_is_frozen_and_keyword_only():
    config = AlisaConfig(policy="swa", caching_ratio=0.2)
    with pytest.raises(AttributeError):
        config.policy = "h2o"  # type: ignore[misc]
    with pytest.raises(TypeError):
        AlisaConfig("swa")  # type: ignore[misc]


def test_with_overrides_validates_and_rejects_unknown_fields():
    config = AlisaConfig(policy="swa", caching_ratio=0.2)
    assert config.with_overrides(caching_ratio=0.5).caching_ratio == 0.5
    with pytest.raises(ValueError, match="unknown AlisaConfig field"):
        config.with_overrides(ratio=0.5)
    with pytest.raises(ValueError, match="caching_ratio"):
        config.with_overrides(caching_ratio=2.0)


# One value of the wrong type per field: every field is covered (a test below checks).
WRONG_TYPES = {
    "policy": 1,
    "caching_ratio": "0.5",
    "budget_tokens": 8.0,
    "recent_fraction": "half",
    "sink_tokens": 4.0,
    "score_window": 2.0,
    "score_decay": 1,
    "head_max": "max",
    "stride": True,
    "dense_layers": 1.0,
    "layer_schedule": 3,
    "per_head": 1,
    "kv_bits": 8.0,
    "quant_group_size": 32.0,
    "residual_tokens": 64.0,
    "gpu_memory": 1.5e9,
    "host_memory": [1],
    "recompute": False,
    "profile": 3,
    "retention": 1,
    "host_bits": 8.0,
    "history_share": "half",
    "reselect_every": 2.5,
    "estimate_rest": 1,
    "min_budget_tokens": 64.0,
    "observation_window": 32.0,
    "preset": 1,
    "kernels": 2,
}


def test_presets_resolve_the_fields_left_unset():
    def first_layer(config):
        return policy_for_layer(config, 0, 2)

    default = first_layer(AlisaConfig(policy="swa", caching_ratio=0.2))
    assert (default.min_budget_tokens, default.sink_tokens, default.observation_window) == (
        64,
        4,
        8,
    )
    assert AlisaConfig(policy="swa").selects_per_head and AlisaConfig(policy="h2o").selects_per_head
    assert not AlisaConfig(policy="tova").selects_per_head
    paper = first_layer(AlisaConfig(policy="swa", caching_ratio=0.2, preset="paper"))
    assert (paper.min_budget_tokens, paper.sink_tokens, paper.observation_window) == (0, 0, 0)
    assert not AlisaConfig(policy="swa", preset="paper").selects_per_head
    # StreamingLLM's own 4 sinks are its paper setting; set fields beat either preset.
    assert first_layer(AlisaConfig(policy="streaming", preset="paper")).sink_tokens == 4
    local = first_layer(AlisaConfig(policy="local", caching_ratio=0.2))
    assert (local.sink_tokens, local.observation_window, local.min_budget_tokens) == (0, 0, 64)
    strided = first_layer(AlisaConfig(policy="strided", caching_ratio=0.2))
    assert (strided.sink_tokens, strided.observation_window) == (4, 0)
    host_local = first_layer(AlisaConfig(policy="local", caching_ratio=0.2, retention="host"))
    assert host_local.sink_tokens == 4
    mixed = AlisaConfig(policy="swa", preset="paper", min_budget_tokens=16, per_head=True)
    assert first_layer(mixed).min_budget_tokens == 16 and mixed.selects_per_head
    assert not AlisaConfig(policy="swa", gpu_memory="1GiB").selects_per_head
    with pytest.raises(ValueError, match="preset='papers'"):
        AlisaConfig(preset="papers")


def test_the_default_preset_scores_swa_by_decayed_sums_of_the_query_head_max():
    def scoring(**options):
        policy = policy_for_layer(AlisaConfig(caching_ratio=0.2, **options), 0, 2)
        return policy.head_max, policy.score_decay

    assert scoring(policy="swa") == (True, True)
    # Only SWA: the other policies and ALISA's own setting keep exact sums over the heads.
    for name in ("h2o", "tova", "streaming"):
        assert scoring(policy=name) == (False, False)
    assert scoring(policy="swa", preset="paper") == (False, False)
    # Set fields beat either preset.
    assert scoring(policy="swa", head_max=False, score_decay=False) == (False, False)
    assert scoring(policy="swa", preset="paper", head_max=True, score_decay=True) == (True, True)
    assert scoring(policy="h2o", head_max=True) == (True, False)
    with pytest.raises(ValueError, match="score_decay=1"):
        AlisaConfig(score_decay=1)


def test_every_field_has_a_wrong_type_case():
    assert set(WRONG_TYPES) == {f.name for f in fields(AlisaConfig)}


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES.items(), ids=list(WRONG_TYPES))
def test_a_value_of_the_wrong_type_names_the_field_and_value(field, value):
    with pytest.raises(ValueError) as error:
        AlisaConfig(**{field: value})
    assert f"{field}={value!r}" in str(error.value)


def test_numbers_accept_ints_and_byte_sizes_accept_strings():
    config = AlisaConfig(caching_ratio=1, recent_fraction=0, gpu_memory="2GiB", host_memory=2**30)
    assert config.caching_ratio == 1 and config.gpu_memory == "2GiB"


def test_pyramid_and_policies_that_never_evict():
    assert AlisaConfig(policy="dense").keeps_everything
    assert not AlisaConfig(policy="swa", layer_schedule="pyramid").keeps_everything
    assert not AlisaConfig(policy="swa", caching_ratio=0.5).keeps_everything


@pytest.mark.parametrize(("field", "value"), [("caching_ratio", 0.2), ("budget_tokens", 9)])
def test_a_budget_for_a_policy_that_keeps_everything_is_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} has no effect with policy='dense'"):
        AlisaConfig(policy="dense", **{field: value})
