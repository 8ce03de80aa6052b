"""The twentieth bad-input tour's findings (an independent tester's tour 96: T1-T4), each a
test."""

from __future__ import annotations

import json

import pytest
from conftest import saved_tiny_llama

from alisa import load_model
from alisa.cli import main

REASON = "The hidden size (64) is not a multiple of the number of attention heads (3)."


@pytest.fixture
def invalid_config(tmp_path):
    """A saved tiny Llama whose config.json transformers' own checks refuse."""
    folder = saved_tiny_llama(tmp_path / "oddcfg")
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["num_attention_heads"] = 3
    path.write_text(json.dumps(config))
    return folder


def test_a_config_transformers_refuses_is_a_value_error_naming_the_model(invalid_config):
    """T3, T4: ``load_model`` raised huggingface_hub's ``StrictDataclassClassValidationError``
    (not a ``ValueError``)."""
    with pytest.raises(ValueError, match="the config.json in .* is invalid: The hidden size"):
        load_model(str(invalid_config))


@pytest.mark.parametrize("command", ["generate --max-new-tokens 3 hi", "plan"])
def test_the_cli_says_an_invalid_config_in_one_line(invalid_config, command, capsys):
    """T1, T2: ``alisa generate`` and ``alisa plan`` printed a 12-frame traceback (exit 1)."""
    name, *rest = command.split()
    assert main([name, "--model", str(invalid_config), *rest]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"alisa {name}: error: model=" in err and REASON in err
