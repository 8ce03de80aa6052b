import json
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa import AlisaConfig
from alisa.cli import main
from alisa.config import policy_for_layer
from alisa.settings import describe_settings, effective_values, resolve_settings
from tests.settings_grid import NUM_LAYERS, grid, key

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "settings_golden.json").read_text())


def test_the_grid_covers_every_golden_config():
    configs = {key(kwargs) for kwargs in grid()}
    assert configs <= set(GOLDEN["configs"])
    # The golden configs left out are those refused since: a budget or host retention for a
    # policy that keeps every token (dense with a caching ratio, a token budget or
    # retention=host would have meant nothing).
    # And history_share=0 where nothing reads it (no host retention, or a policy keeping no
    # attention history), refused as any other share there since the nineteenth tour.
    for name in set(GOLDEN["configs"]) - configs:
        if "history_share=0.0" in name:
            unscored = ("policy=local,", "policy=streaming,", "policy=strided,", "policy=dense,")
            assert "retention=drop" in name or any(part in name for part in unscored), name
            continue
        assert "policy=dense" in name, name
        assert any(
            part in name for part in ("caching_ratio=", "budget_tokens=", "retention=host")
        ), name


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


def test_layer_values_show_dense_layers_and_the_pyramid_per_layer():
    config = AlisaConfig(
        policy="swa", caching_ratio=0.2, layer_schedule="pyramid", dense_layers=1, preset="paper"
    )
    values = effective_values(config, 4)
    assert values["layer_policy"] == "0: dense, 1-3: swa"
    assert values["budget_scale"].startswith("0: 1, 1: 1.95, 2: 1, 3: 0.05")
    assert values["sink_tokens"] == "0"  # paper preset: SWA's own sinks, none
    assert values["per_head"] == "False"
    assert values["stride"] == "None (unused by this policy)"


def test_every_setting_is_described_and_unset_ones_are_marked():
    config = AlisaConfig(policy="h2o", caching_ratio=0.3, gpu_memory="2GiB")
    text = describe_settings(config, 2)
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert set(lines) == {f.name for f in fields(AlisaConfig)} | {"layer_policy", "budget_scale"}
    assert lines["sink_tokens"].endswith("4 *")
    assert lines["gpu_memory"].endswith("2147483648 (2.0 GiB)")
    assert lines["per_head"].endswith("False *")  # tiers are per layer


def test_num_layers_is_checked():
    with pytest.raises(ValueError, match="num_layers=0"):
        resolve_settings(AlisaConfig(), 0)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("model")
    tiny_llama().save_pretrained(root)
    byte_tokenizer().save_pretrained(root)
    return str(root)


def test_generate_shows_the_config_and_the_summary_names_changed_settings(tiny_model_dir, capsys):
    argv = ["generate", "hello", "--model", tiny_model_dir, "--max-new-tokens", "2"]
    assert main([*argv, "--policy", "swa", "--caching-ratio", "0.5", "--show-config"]) == 0
    err = capsys.readouterr().err
    shown = err.split("[alisa]")[0]
    for name in [f.name for f in fields(AlisaConfig)] + ["layer_policy", "budget_scale"]:
        assert f"\n  {name} " in shown
    summary = [line for line in err.splitlines() if line.startswith("[alisa]")]
    assert len(summary) == 1
    assert "per_head=True" in summary[0] and "observation_window=8" in summary[0]
    assert main(argv) == 0  # the defaults: no settings part, no table
    err = capsys.readouterr().err
    assert "alisa settings" not in err
    assert "| settings" not in err


def test_the_workload_keeps_what_the_cache_keeps():
    from alisa.planning.spec import config_workload

    config = AlisaConfig(policy="swa", budget_tokens=100, retention="host", host_bits=4)
    workload = config_workload(config, 3, batch=2, prompt_len=1000, gen_len=5)
    assert workload.keep == config.keep_rules(3)
    assert (workload.retention, workload.host_bits, workload.recent_fraction) == ("host", 4, 0.0)
    assert workload.kept_tokens(0) == 2 * 100  # the token budget, which r alone would miss
    dense = config_workload(AlisaConfig(), 3, batch=1, prompt_len=8, gen_len=1)
    assert dense.caching_ratio == 1.0 and dense.kept_tokens(0) == 8


def test_the_workload_selects_as_often_as_the_cache():
    from alisa.calibration.steps import SELECTION_CONFIG
    from alisa.planning.spec import config_workload
    from alisa.settings import RESELECT_EVERY

    def interval(config):
        return config_workload(config, 3, batch=1, prompt_len=8, gen_len=1).reselect_every

    host = AlisaConfig(policy="swa", caching_ratio=0.2, retention="host")
    assert interval(host) == RESELECT_EVERY == 1
    assert interval(AlisaConfig(policy="swa", retention="host", reselect_every=2)) == 2
    assert interval(AlisaConfig(policy="swa")) == 1
    # The calibration times steps that each select: its fit is per selection.
    assert SELECTION_CONFIG.host_reselect_every == interval(SELECTION_CONFIG) == 1


def test_the_selection_calibration_workload_is_unchanged():
    from dataclasses import replace

    from alisa.calibration.steps import SELECTION_CONFIG
    from alisa.planning.spec import config_workload
    from scheduler import Workload

    built = config_workload(SELECTION_CONFIG, 4, batch=2, prompt_len=512, gen_len=1)
    assert replace(built, retention="drop") == Workload(
        batch=2,
        prompt_len=512,
        gen_len=1,
        caching_ratio=SELECTION_CONFIG.caching_ratio,
        recent_fraction=0.0,
        keep=SELECTION_CONFIG.keep_rules(4),
    )


def test_the_cli_shows_library_log_records_on_stderr(capsys):
    import logging

    from alisa.logs import log_to_stderr

    log_to_stderr()
    log_to_stderr()  # once: no second handler
    logging.getLogger("alisa.model.loading").info("converting x.gguf to safetensors once")
    assert capsys.readouterr().err == "alisa: converting x.gguf to safetensors once\n"
