"""The fifteenth bad-input tour's findings (an independent tester's tour 86: S1, S2, S3/T1/T2, U1,
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


def test_serve_refuses_a_host_budget_that_holds_no_request(model_dir, capsys):
    """S3, T1, T2: ``alisa serve --retention host --host-memory N`` started, and a request
    outgrowing N (or one that fit, sized for 256 new tokens) failed mid-batch as an HTTP 500.
    Admission counts the host regions now (tests/test_host_admission.py), and a budget that
    holds not even a one-token request is refused at start, as ``--kv-memory`` is."""
    argv = ["serve", "--model", model_dir, "--policy", "swa", "--caching-ratio", "0.5"]
    code, err = run_main([*argv, "--retention", "host", "--host-memory", "1KB"], capsys)
    assert code == 1 and "Traceback" not in err
    assert "--host-memory 1KB cannot hold even a one-token request: its host region" in err
    ServeSettings(model_name="m", config=HOST)


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


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ttft_s", -1.0, r"ttft_s=-1.0 must be >= 0"),
        ("texts", ["a", "b"], r"texts has 2 rows but token_ids has 1: one per prompt"),
        ("finish_reasons", ["bogus"], r"finish_reasons\[0\]='bogus' must be one of"),
        ("texts", "a", r"texts='a' must be a list"),
        ("ttft_s", float("nan"), r"ttft_s=nan must be a finite number"),
        ("kv_bytes", -5, r"kv_bytes=-5 must be >= 0"),
        ("prompt_tokens", [-1], r"prompt_tokens\[0\]=-1 must be an integer >= 0"),
        ("step_times_s", [-1.0], r"step_times_s\[0\]=-1.0 must be >= 0"),
        ("compile", "on", r"compile='on' must be a CompileChoice or None"),
        ("compile_s", -3.0, r"compile_s=-3.0 must be >= 0"),
        ("ttft_s", "0.1", r"ttft_s='0.1' must be a finite number"),
        ("kv_tier_bytes", {"gpu": 1}, r"kv_tier_bytes has tier 'gpu'; the tiers are"),
        ("kv_tier_bytes", {"host": -1}, r"kv_tier_bytes\['host'\]=-1 must be >= 0"),
        ("token_ids", [[1.5]], r"token_ids\[0\]\[0\]=1.5 must be an integer >= 0"),
    ],
)
def test_a_generation_output_built_by_hand_is_checked(field, value, message):
    """S1 (twelve inputs): ``GenerationOutput``, exported, took any value, and a string time
    surfaced later as a TypeError in ``total_s``."""
    from alisa import GenerationOutput

    base = dict(
        texts=["a"], token_ids=[[1]], prompt_tokens=[1], finish_reasons=["length"], ttft_s=0.1
    )
    assert GenerationOutput(**base).total_s == 0.1
    with pytest.raises(ValueError, match=message):
        GenerationOutput(**{**base, field: value})
