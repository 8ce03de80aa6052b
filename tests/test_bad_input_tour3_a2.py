"""Issue 67's third tour, helper A2: settings that change nothing are said (the CLI's warning
lines and, from Python, an ``IgnoredSettingWarning``, by one rule), numpy bools are bools, and a
request id must be able to tell results apart (not NaN).

The CLI rows use ``tests/test_bad_input.py``'s table machinery (:class:`Case`,
:func:`check_case`); the Python API's are plain tests.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict

import numpy as np
import pytest
from conftest import byte_tokenizer, tiny_llama
from test_bad_input import OK, Case, check_case, models, run_cli  # noqa: F401

from alisa import AlisaConfig, StreamRequest, generate
from alisa.checks import check_bool
from alisa.runtime.sampling import SamplingOptions
from alisa.settings import IgnoredSettingWarning
from scheduler import preset

PROFILE = {"p.json": json.dumps(asdict(preset("v100-32gb"))).encode()}  # a valid profile
SCORED = "--caching-ratio 0.5 --max-new-tokens 2 --kernels reference"

CASES = {
    # #2: H2O sums every step's attention (no window), TOVA reads the last step alone.
    "score-decay-with-h2o": Case(
        f"generate hi --policy h2o --score-decay {SCORED}",
        OK,
        (
            "alisa generate: warning: --score-decay: score_decay=True has no effect with "
            "policy='h2o', which has no score window of several decode steps to fade",
        ),
    ),
    "no-score-decay-with-tova": Case(
        f"generate hi --policy tova --no-score-decay {SCORED}",
        OK,
        ("--score-decay: score_decay=False has no effect with policy='tova'",),
    ),
    "score-decay-with-swa-is-read": Case(
        f"generate hi --policy swa --score-decay --score-window 8 {SCORED}",
        OK,
        unsaid=("has no effect",),
    ),
    # #5: the profile is read only to plan device/host tiers.
    "profile-without-gpu-memory": Case(
        "generate hi --profile {tmp}/p.json --max-new-tokens 2 --kernels reference",
        OK,
        (
            "alisa generate: warning: --profile: profile=",
            "has no effect without gpu_memory (no device/host tiers)",
        ),
        PROFILE,
    ),
    "profile-in-plan-is-read": Case(
        "plan --model {model} --profile {tmp}/p.json --batch 1 --prompt-len 32 --gen-len 8",
        OK,
        unsaid=("has no effect",),
        files=PROFILE,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_tour3_a2(name, tmp_path, models, capsys, monkeypatch):  # noqa: F811
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


def test_the_cli_says_an_ignored_setting_once_in_its_own_words(models, capsys, monkeypatch):  # noqa: F811
    # The config's own IgnoredSettingWarning is not printed beside the CLI's line.
    argv = ["generate", "hi", "--model", models["model"], "--stride", "4", "--max-new-tokens", "2"]
    code, _, err = run_cli(argv + ["--kernels", "reference"], capsys, monkeypatch, None)
    assert code == OK
    assert err.count("stride=4 has no effect") == 1, err
    assert "alisa generate: warning: --stride: stride=4 has no effect with policy='dense'" in err
    assert "IgnoredSettingWarning" not in err


def test_batch_says_an_ignored_setting_once(tmp_path, models, capsys, monkeypatch):  # noqa: F811
    # alisa batch copies the CLI's config (without gpu_memory): the copy says nothing again.
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "a", "prompt": "Hi"}\n')
    argv = ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    argv += ["--model", models["model"], "--no-progress", "--kernels", "reference"]
    code, _, err = run_cli(argv + ["--sink-tokens", "2"], capsys, monkeypatch, None)
    assert code == OK
    assert err.count("sink_tokens=2 has no effect") == 1, err
    assert "alisa batch: warning: --sink-tokens: sink_tokens=2 has no effect" in err


def test_a_copy_warns_only_about_what_its_changes_leave_unread():
    with pytest.warns(IgnoredSettingWarning):
        config = AlisaConfig(policy="swa", caching_ratio=0.5, stride=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        config.with_overrides(kv_bits=8)  # stride was said when config was built
    with pytest.warns(IgnoredSettingWarning) as record:
        config.with_overrides(policy="h2o", score_decay=True)  # stride's reason changes too
    assert sorted(str(item.message).split(" has")[0] for item in record) == [
        "score_decay=True",
        "stride=4",
    ]
    assert {item.filename for item in record} == {__file__}


# #3: the setting is accepted (a sweep may set it for every policy) and said.
@pytest.mark.parametrize("policy", ["h2o", "tova"])
@pytest.mark.parametrize("decay", [True, False])
def test_score_decay_without_a_score_window_warns(policy, decay):
    with pytest.warns(
        IgnoredSettingWarning,
        match=rf"score_decay={decay} has no effect with policy='{policy}', which has no score "
        "window",
    ):
        AlisaConfig(policy=policy, caching_ratio=0.5, score_decay=decay)


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_the_warning_is_true_score_decay_changes_no_token(policy):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    prompt = "Hello there, a longer prompt " * 6
    tokens = []
    for decay in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IgnoredSettingWarning)
            config = AlisaConfig(
                policy=policy, caching_ratio=0.3, score_decay=decay, min_budget_tokens=0
            )
        tokens.append(generate(model, tokenizer, prompt, config, max_new_tokens=12).token_ids)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"policy": "swa", "caching_ratio": 0.5, "score_decay": True, "score_window": 8},
        {"policy": "strided", "caching_ratio": 0.5, "stride": 4},
        {"policy": "swa", "caching_ratio": 0.5, "retention": "host", "host_bits": 4},
        {"kv_bits": 8, "residual_tokens": 4},
        # Read by the planner over the whole device (alisa plan): only the CLI judges these.
        {"recompute": "never", "profile": "p.json"},
    ],
)
def test_settings_that_are_read_warn_nothing(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        AlisaConfig(**kwargs)


# #9: the eviction settings of a policy that keeps every token, from Python as on the CLI.
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stride", 4),
        ("recent_fraction", 0.25),
        ("sink_tokens", 2),
        ("min_budget_tokens", 0),
        ("score_window", 8),
        ("score_decay", True),
        ("head_max", True),
        ("per_head", True),
        ("observation_window", 3),
        ("dense_layers", 1),
        ("layer_schedule", "pyramid"),
    ],
)
def test_an_eviction_setting_with_dense_warns(field, value):
    with pytest.warns(
        IgnoredSettingWarning,
        match=rf"{field}={value!r} has no effect with policy='dense', which keeps every token",
    ) as record:
        AlisaConfig(**{field: value})
    assert record[0].filename == __file__  # points at the line that built the config


# #10: at run time the same warning, from the config the call was given.
def test_generate_with_an_ignored_setting_warns():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with pytest.warns(IgnoredSettingWarning, match=r"stride=4 has no effect with policy='dense'"):
        output = generate(model, tokenizer, "Hi", AlisaConfig(stride=4), max_new_tokens=2)
    assert len(output.token_ids[0]) == 2


# #19, #20: a numpy bool (what comparing arrays gives) is the bool it equals.
def test_a_numpy_bool_setting_is_stored_as_a_python_bool():
    config = AlisaConfig(policy="swa", caching_ratio=0.5, per_head=np.bool_(True))
    assert config.per_head is True
    assert config == AlisaConfig(policy="swa", caching_ratio=0.5, per_head=True)
    assert SamplingOptions(do_sample=np.bool_(False)).do_sample is False


def test_numpy_bools_pass_the_shared_checks_and_other_numbers_do_not():
    check_bool("chat", np.bool_(False))
    for value in (np.int64(1), 1, "yes", None):
        with pytest.raises(ValueError, match=r"chat=.* must be True or False"):
            check_bool("chat", value)
    with pytest.raises(ValueError, match=r"per_head=\S*1\)? must be a bool or None"):
        AlisaConfig(policy="swa", caching_ratio=0.5, per_head=np.int64(1))


def test_generate_takes_a_numpy_bool_flag():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    plain = generate(model, tokenizer, "Hi", max_new_tokens=2, chat=False)
    numpy_flag = generate(model, tokenizer, "Hi", max_new_tokens=2, chat=np.bool_(False))
    assert numpy_flag.token_ids == plain.token_ids


# #7: NaN equals no id, itself included, so two NaN ids would pass the duplicate check.
@pytest.mark.parametrize("nan", [float("nan"), np.float64("nan"), np.float32("nan")])
def test_a_nan_request_id_is_refused(nan):
    with pytest.raises(
        ValueError, match=r"id=\S*nan\)? of a StreamRequest is NaN, which equals no id"
    ):
        StreamRequest(prompt_ids=[5], max_new_tokens=1, id=nan)


@pytest.mark.parametrize("identifier", [0.5, float("inf"), 3, "a", None])
def test_other_request_ids_are_taken(identifier):
    assert StreamRequest(prompt_ids=[5], max_new_tokens=1, id=identifier).id == identifier
