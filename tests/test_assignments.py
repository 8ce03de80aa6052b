from pathlib import Path

import pytest

from alisa import AlisaConfig
from alisa.assignments import parse_assignment, parse_field
from experiments.runconfig import load_config
from experiments.systems import parse_alisa

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "smoke.toml"
GIB = 1024**3


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("gpu_memory", "2GiB", 2 * GIB),
        ("host_memory", " 512MB ", 512 * 1000**2),
        ("gpu_memory", "123456789", 123456789),
        ("gpu_memory", "None", None),
        ("per_head", "FALSE", False),
        ("per_head", "true", True),
        ("per_head", "null", None),
        ("sink_tokens", "none", None),
        ("sink_tokens", "8", 8),
        ("caching_ratio", "0.2", 0.2),
        ("history_share", "NULL", None),
        ("policy", "swa", "swa"),
        ("policy", "'swa'", "swa"),
        ("profile", "path/to/profile.json", "path/to/profile.json"),
    ],
)
def test_values_are_typed_by_the_field(key, text, value):
    parsed = parse_field(AlisaConfig, key, text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        ("gpu_memory=lots", "gpu_memory='lots'"),
        ("kv_bits=eight", "kv_bits='eight'"),
        ("kv_bits=none", "kv_bits='none'"),  # not optional: None is no integer
        ("per_head=maybe", "per_head='maybe'"),
        ("caching_ratio=half", "caching_ratio='half'"),
        ("no_such_field=1", "'no_such_field'"),
        ("policy", "must be key=value"),
        ("=3", "must be key=value"),
    ],
)
def test_bad_input_names_the_key_and_value(item, needle):
    with pytest.raises(ValueError) as error:
        parse_assignment(AlisaConfig, item)
    assert needle in str(error.value)


def test_an_unknown_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: policy, caching_ratio"):
        parse_field(AlisaConfig, "ratio", "0.2")


def test_a_size_parses_in_a_system_name():
    config = parse_alisa("alisa:policy=swa,caching_ratio=0.2,gpu_memory=2GiB,per_head=false,")
    assert config.gpu_memory == 2 * GIB and config.per_head is False
    with pytest.raises(ValueError, match="alisa:gpu_memory=2XB.*gpu_memory='2XB'"):
        parse_alisa("alisa:gpu_memory=2XB")


def test_a_size_parses_in_a_run_config_override():
    config = load_config(SMOKE, ["sweep.gpu_memory=2GiB,512MB", "sweep.sink_tokens=none"])
    assert config.sweep["gpu_memory"] == [2 * GIB, 512 * 1000**2]
    assert config.sweep["sink_tokens"] == [None]
    # Keys that are not AlisaConfig fields keep their TOML reading.
    assert load_config(SMOKE, ["runtime.threads=1"]).runtime["threads"] == 1
    with pytest.raises(ValueError, match="kv_bits='eight'"):
        load_config(SMOKE, ["sweep.kv_bits=eight"])


def test_a_size_parses_in_the_fidelity_configs_field_overrides():
    # What experiments.fidelity's --set FIELD=VALUE did: any AlisaConfig field, typed by it.
    fidelity = SMOKE.parent / "fidelity.toml"
    config = load_config(fidelity, ["sweep.gpu_memory=2GiB", "sweep.per_head=False"])
    assert config.sweep["gpu_memory"] == [2 * GIB] and config.sweep["per_head"] == [False]
    with pytest.raises(ValueError, match="gpu_memory='much'"):
        load_config(fidelity, ["sweep.gpu_memory=much"])
