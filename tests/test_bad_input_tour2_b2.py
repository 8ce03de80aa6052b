"""Bad input from the second bad-input tour (issue 67, docs/bad-input-tour.md) to attach/detach,
load_model, get_policy, an AlisaCache fed to another model, and ``alisa generate``: each refused
with a message naming the argument and its value, or warned about where the run is fine but
not what the user asked for."""

import math
import shutil

import pytest
import torch
from conftest import tiny_llama
from test_bad_input import ERR, OK, Case, check_case, models, run_cli  # noqa: F401 - a fixture

import alisa
from alisa import AlisaCache, AlisaConfig
from alisa.kv.cache import PackedCache
from alisa.model.loading import TOKENIZER_FILES, load_model
from alisa.policies import get_policy

CASES = {
    # #18: every token is a sink, so swa keeps all of them (as the floor's warning says).
    "sink-tokens-cover-every-token": Case(
        "generate Hi --policy swa --caching-ratio 0.5 --sink-tokens 1000000 "
        "--min-budget-tokens 0 --max-new-tokens 2 --kernels reference",
        OK,
        ("--sink-tokens", "sink_tokens=1000000 keeps all 4 tokens", "runs as dense", "lower it"),
    ),
    "sink-tokens-below-the-tokens": Case(
        "generate Hi --policy swa --caching-ratio 0.5 --sink-tokens 1 --min-budget-tokens 0 "
        "--max-new-tokens 8 --kernels reference",
        OK,
        unsaid=("evicts nothing",),
    ),
    # #33: truncation to one token leaves a space, which is not an empty prompt the user gave.
    "truncated-to-whitespace": Case(
        "generate --model {short} --prompt-file {tmp}/long.txt --truncate-prompt "
        "--max-new-tokens 63",
        ERR,
        ("--max-new-tokens=63", "only 1 prompt token", "context of 64", "whitespace (' ')"),
        {"long.txt": b"word " * 100},
        unsaid=("prompts[0]", "is empty"),
    ),
    "truncated-to-text": Case(
        "generate --model {short} --prompt-file {tmp}/long.txt --truncate-prompt "
        "--max-new-tokens 62 --kernels reference",
        OK,
        ("truncated from 500 to its last 2 tokens",),
        {"long.txt": b"word " * 100},
    ),
    # #51: a model's config.json given instead of its folder.
    "model-is-its-config-file": Case(
        "generate hi --model {model}/config.json",
        ERR,
        ("config.json' is a file, not a model directory", "give its folder"),
        unsaid=("missing", "resolves to nothing"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_tour2_b2(name, tmp_path, models, capsys, monkeypatch):  # noqa: F811
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


# ---- #6, #7: attach / detach something that is not a model -----------------------------------


@pytest.mark.parametrize("function", [alisa.attach, alisa.detach])
@pytest.mark.parametrize("model", [None, "model"])
def test_attach_and_detach_refuse_what_is_not_a_model(function, model):
    with pytest.raises(ValueError, match=rf"model={model!r} must be a torch model"):
        function(model)


# ---- #8, #9, #50, #51: load_model -------------------------------------------------------------


def test_load_model_refuses_the_meta_device_before_loading(models):  # noqa: F811
    with pytest.raises(ValueError, match=r"device='meta' holds no data .* give 'cpu'"):
        load_model(models["model"], device="meta")


@pytest.mark.parametrize(
    ("budgets", "match"),
    [
        ("1GB", r"max_memory='1GB' must be a dict of per-device budgets such as \{0: '6GiB'"),
        ({"cpu": "lots"}, r"max_memory\['cpu'\]='lots' is not a byte size"),
        ({0: -5}, r"max_memory\[0\]=-5 must be a finite number of bytes >= 0"),
    ],
)
def test_load_model_refuses_max_memory_not_in_byte_budgets(models, budgets, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        load_model(models["model"], max_memory=budgets)


def test_load_model_takes_max_memory_budgets_in_any_byte_unit(models):  # noqa: F811
    model, _ = load_model(models["model"], max_memory={"cpu": "1.5G"})
    assert next(model.parameters()).device.type == "cpu"


def _without_tokenizer(model_dir: str, tmp_path):
    """A copy of a saved model without its tokenizer's files."""
    folder = tmp_path / "weights-only"
    shutil.copytree(model_dir, folder)
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    return folder


def test_load_model_names_a_directory_without_tokenizer_files(models, tmp_path):  # noqa: F811
    folder = _without_tokenizer(models["model"], tmp_path)
    match = rf"the directory '{folder}' holds no tokenizer \(none of tokenizer.json, "
    with pytest.raises(ValueError, match=match):
        load_model(str(folder))


def test_cli_says_the_tokenizer_is_missing(models, tmp_path, capsys, monkeypatch):  # noqa: F811
    folder = _without_tokenizer(models["model"], tmp_path)
    code, _, err = run_cli(["generate", "hi", "--model", str(folder)], capsys, monkeypatch, None)
    assert code == ERR
    assert "holds no tokenizer" in err and "tokenizer.save_pretrained" in err
    assert "Traceback" not in err and "sentencepiece" not in err


def test_load_model_says_a_file_is_not_a_model_directory(models):  # noqa: F811
    config = f"{models['model']}/config.json"
    match = rf"model='{config}' is a file, not a model directory .* give its folder "
    with pytest.raises(ValueError, match=match):
        load_model(config)


# ---- #28: get_policy validates as AlisaConfig does --------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("caching_ratio", 2),
        ("caching_ratio", 0),
        ("caching_ratio", math.nan),
        ("caching_ratio", "0.5"),
        ("recent_fraction", 1.5),
        ("sink_tokens", -1),
        ("budget_tokens", 0),
        ("min_budget_tokens", -1),
        ("observation_window", -1),
    ],
)
def test_get_policy_refuses_what_alisa_config_refuses_with_its_message(field, value):
    with pytest.raises(ValueError) as from_config:
        AlisaConfig(policy="swa", **{field: value})
    with pytest.raises(ValueError) as from_policy:
        get_policy("swa", **{field: value})
    assert str(from_policy.value) == str(from_config.value)
    assert str(from_policy.value).startswith(f"{field}={value!r} must be")


@pytest.mark.parametrize(("name", "option"), [("swa", "window"), ("strided", "stride")])
def test_a_policy_with_options_of_its_own_checks_the_shared_ones_too(name, option):
    with pytest.raises(ValueError, match=r"caching_ratio=2 must be in \(0, 1\]"):
        get_policy(name, caching_ratio=2, **{option: 4})
    with pytest.raises(ValueError, match=rf"{option}=0 must be an integer >= 1"):
        get_policy(name, **{option: 0})


# ---- #29-#31: an AlisaCache fed to another model than the one it was built for ----------------


def _ids(tokenizer):
    return tokenizer("Hi", return_tensors="pt")


@pytest.mark.parametrize("config", [AlisaConfig(), AlisaConfig(policy="swa", caching_ratio=0.5)])
def test_a_cache_refuses_a_model_it_was_not_built_for(tokenizer, config):
    built_for, other = tiny_llama(), tiny_llama(seed=1, max_position_embeddings=64)
    cache = AlisaCache(built_for, config)
    with pytest.raises(ValueError, match=r"built for LlamaForCausalLM at 0x[0-9a-f]+, and this"):
        other.generate(**_ids(tokenizer), max_new_tokens=2, past_key_values=cache)
    assert cache.get_seq_length() == 0  # refused before any layer stored a token


def test_a_cache_names_both_models_when_the_other_is_attached_too(tokenizer):
    built_for, other = tiny_llama(), tiny_llama(seed=1)
    AlisaCache(other, AlisaConfig())  # attaches the other model as well
    cache = AlisaCache(built_for, AlisaConfig())
    match = (
        rf"built for LlamaForCausalLM at {id(built_for):#x} and is given to another model, "
        rf"LlamaForCausalLM at {id(other):#x}"
    )
    with pytest.raises(ValueError, match=match):
        other.generate(**_ids(tokenizer), max_new_tokens=2, past_key_values=cache)
    with pytest.raises(ValueError, match=match):
        alisa.generate(other, tokenizer, "Hi", max_new_tokens=2, past_key_values=cache)


def test_a_cache_still_serves_its_own_model_as_hf_does(tokenizer):
    model = tiny_llama()
    ids = _ids(tokenizer)
    reference = model.generate(**ids, max_new_tokens=6, do_sample=False)
    ours = model.generate(
        **ids, max_new_tokens=6, do_sample=False, past_key_values=AlisaCache(model, AlisaConfig())
    )
    assert torch.equal(ours, reference)


def test_a_mixed_forward_refuses_a_newcomer_built_for_another_model(tokenizer):
    model, other = tiny_llama(), tiny_llama(seed=1)
    running = AlisaCache(model, AlisaConfig())
    model(**_ids(tokenizer), past_key_values=running)
    with pytest.raises(ValueError, match="is given to another model"):
        PackedCache(running, AlisaCache(other, AlisaConfig()), 1)


# ---- #14, #19: --kernels with retention drop is read (not an ignored setting) -----------------


@pytest.mark.parametrize("config", [{}, {"policy": "swa", "caching_ratio": 0.5}])
@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_kernels_choose_the_dense_store_and_slot_map_of_a_dropping_cache(config, kernels):
    """Not ignored with policy dense or retention drop: the compiled CPU kernels also run the
    dense store's decode attention and writes and the slot map's claims (docs: tour notes)."""
    cache = AlisaCache(tiny_llama(), AlisaConfig(kernels=kernels, **config))
    compiled = kernels == "cpu"
    assert all(layer.compiled == compiled for layer in cache.layers)
    assert all(layer.store_factory.keywords["compiled"] == compiled for layer in cache.layers)
