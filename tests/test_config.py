import pytest

from alisa import AlisaConfig
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
