"""The fifteenth bad-input tour's findings (an independent tester's tour 86: S2, S3/T1/T2, U1,
U2), each a test."""

from __future__ import annotations

import pytest
from conftest import run_main, saved_tiny_llama

from alisa import AlisaConfig
from alisa.serve import ServeSettings

HOST = AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", host_memory="60KB")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(saved_tiny_llama(tmp_path_factory.mktemp("tour15")))


def test_serve_refuses_a_host_budget_its_admission_does_not_count(model_dir, capsys):
    """S3, T1, T2: ``alisa serve --retention host --host-memory N`` started, and a request
    outgrowing N (or one that fit, sized for 256 new tokens) failed mid-batch as an HTTP 500;
    the server's admission does not count the host region, so the budget is refused at start,
    before the model loads or the port is taken."""
    argv = ["serve", "--model", model_dir, "--policy", "swa", "--caching-ratio", "0.5"]
    code, err = run_main([*argv, "--retention", "host", "--host-memory", "1KB"], capsys)
    assert code == 1 and "Traceback" not in err
    assert "--host-memory 1KB: a server does not count the host region of retention='host'" in err
    with pytest.raises(ValueError, match="config.host_memory='60KB': a server does not count"):
        ServeSettings(model_name="m", config=HOST)
    ServeSettings(model_name="m", config=AlisaConfig(**{**vars(HOST), "host_memory": None}))


@pytest.mark.parametrize("name", ["kv_bytes", "device_bytes", "max_rows", "prefill_tokens"])
def test_server_settings_past_2_62_are_refused_as_the_flags_are(name):
    """S2: ``ServeSettings(kv_bytes=10**30)`` was accepted; ``BatchJob`` and the CLI refuse
    anything past 2**62."""
    with pytest.raises(ValueError, match=rf"{name}=10{{30}} is too large: give at most 2\*\*62"):
        ServeSettings(model_name="m", **{name: 10**30})


def test_an_abbreviated_flag_is_not_taken_for_another(model_dir, capsys):
    """U1: ``alisa generate --prompt hello`` was read as ``--prompt-file hello`` (argparse's
    abbreviations), a file the user never named; flags are whole words now."""
    code, err = run_main(["generate", "--prompt", "hello", "--model", model_dir], capsys)
    assert code == 2 and "unrecognized arguments: --prompt" in err and "prompt-file" not in err
