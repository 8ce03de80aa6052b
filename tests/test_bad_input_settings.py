"""Issue 67's bad input of checkpoints and settings: damaged weights, calibration contexts past
the model's, settings that would change nothing, and a summary that says what each number counts.

The CLI rows use ``tests/test_bad_input.py``'s table machinery (:class:`Case`,
:func:`check_case`); the Python API's are plain tests.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import byte_tokenizer, tiny_llama
from safetensors.torch import load_file, save_file
from test_bad_input import ERR, OK, Case, check_case, models  # noqa: F401

from alisa import AlisaCache, AlisaConfig, load_model

DROPPED = "model.layers.0.mlp.up_proj.weight"  # the weight the partial checkpoint lacks

CASES = {
    "checkpoint-missing-weight": Case(
        "generate hi --model {partial} --max-new-tokens 2",
        ERR,
        ("partial", "does not match LlamaForCausalLM", "1 missing weight", DROPPED, "random"),
    ),
    "checkpoint-truncated": Case(
        "generate hi --model {truncated} --max-new-tokens 2",
        ERR,
        ("cannot read the weights file", "truncated/model.safetensors", "is it complete?"),
    ),
    "profile-context-past-the-model": Case(
        "profile --model {mid} --context 100000 --output {tmp}/p.json",
        ERR,
        ("--context=100000", "100008 tokens", "context of 512", "give --context <= 504"),
        absent=("p.json",),
    ),
    "profile-context-past-a-short-model": Case(
        "profile --model {short} --context 100000 --output {tmp}/p.json",
        ERR,
        ("--context=100000", "context of 64", "--context >= 130", "cannot hold"),
        absent=("p.json",),
        unsaid=("<= 56",),  # a bound below the least calibration context helps no one
    ),
    "profile-default-context-past-the-model": Case(
        "profile --model {mid} --output {tmp}/p.json",
        ERR,
        ("--context=1024", "context of 512", "--context was not given: 1024 is its default"),
        absent=("p.json",),
    ),
    "retention-host-with-dense": Case(
        "generate hi --retention host --max-new-tokens 2",
        ERR,
        ("--retention", "retention='host' has no effect", "policy='dense'", "keeps every token"),
    ),
    "retention-host-with-an-evicting-policy": Case(
        "generate hi --policy swa --caching-ratio 0.5 --retention host --max-new-tokens 2",
        OK,
        unsaid=("no effect",),
    ),
    "dense-layers-all-layers": Case(
        "generate hi --policy swa --caching-ratio 0.5 --dense-layers 2 --max-new-tokens 2",
        ERR,
        ("--dense-layers", "dense_layers=2", "all of the model's 2 layers", "evict nothing"),
    ),
    "dense-layers-all-but-one": Case(
        "generate hi --policy swa --caching-ratio 0.5 --dense-layers 1 --max-new-tokens 2", OK
    ),
    "plan-host-memory-bounds-the-plan": Case(
        "plan --model opt-13b --hardware v100-32gb --batch 64 --prompt-len 1024 --host-memory 1KB",
        ERR,
        ("--host-memory", "host_memory='1KB'", "too small"),
    ),
    "gpu-memory-summary-says-what-it-counts": Case(
        "generate hi --gpu-memory 2MB --max-new-tokens 2",
        OK,
        ("peak process memory", "--gpu-memory 1.9 MiB holds weights", "device KV", "buffers"),
        unsaid=("peak memory",),
    ),
}


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory) -> dict:  # noqa: F811 - the imported fixture
    """``models`` plus a 512-token model and two damaged copies of the tiny one: one lacking a
    weight, one whose weights file is cut in half."""
    root = tmp_path_factory.mktemp("checkpoints")
    mid = root / "mid"
    tiny_llama(max_position_embeddings=512).save_pretrained(mid)
    byte_tokenizer().save_pretrained(mid)
    partial = _copy(models["model"], root / "partial")
    weights = load_file(partial / "model.safetensors")
    del weights[DROPPED]
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})
    truncated = _copy(models["model"], root / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    return {**models, "mid": str(mid), "partial": str(partial), "truncated": str(truncated)}


def _copy(source: str, target):
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_settings(name, tmp_path, checkpoints, capsys, monkeypatch):
    check_case(CASES[name], tmp_path, checkpoints, capsys, monkeypatch)


def _edited(source: str, target, edit):
    """A copy of the checkpoint ``source`` whose weights ``edit`` changed (in place)."""
    _copy(source, target)
    weights = load_file(target / "model.safetensors")
    edit(weights)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


def test_load_model_refuses_a_missing_weight(checkpoints):
    with pytest.raises(ValueError, match=f"1 missing weight \\({DROPPED}\\), which would run on"):
        load_model(checkpoints["partial"])


def test_load_model_names_the_first_missing_weights_and_their_count(checkpoints, tmp_path):
    def drop_layer(weights):
        for name in [name for name in weights if name.startswith("model.layers.1.")]:
            del weights[name]

    path = _edited(checkpoints["model"], tmp_path / "m", drop_layer)
    with pytest.raises(ValueError) as error:
        load_model(path)
    message = str(error.value)
    assert f"the checkpoint {path!r} does not match LlamaForCausalLM" in message
    # Layer 1's 9 weights, the first three by name.
    assert "9 missing weights (model.layers.1.input_layernorm.weight, " in message
    assert "and 6 more), which would run on random values" in message


def test_load_model_refuses_an_unexpected_weight(checkpoints, tmp_path):
    def add(weights):
        weights["model.layers.0.mlp.extra.weight"] = weights[DROPPED].clone()

    with pytest.raises(ValueError, match=r"1 unexpected weight \(model\.layers\.0\.mlp\.extra"):
        load_model(_edited(checkpoints["model"], tmp_path / "m", add))


def test_load_model_refuses_a_weight_of_the_wrong_shape(checkpoints, tmp_path):
    def reshape(weights):
        weights[DROPPED] = weights[DROPPED][:3, :3].clone()

    with pytest.raises(ValueError, match=rf"wrong shape \({DROPPED} saved \[3, 3\], expected"):
        load_model(_edited(checkpoints["model"], tmp_path / "m", reshape))


def test_load_model_names_a_truncated_weights_file(checkpoints):
    with pytest.raises(ValueError) as error:
        load_model(checkpoints["truncated"])
    message = str(error.value)
    assert message.startswith(
        f"cannot read the weights file '{checkpoints['truncated']}/model.safetensors' "
        "(is it complete?): "
    )
    assert "SafetensorError" in message


def test_tied_weights_are_not_missing(tmp_path):
    tied = tiny_llama(tie_word_embeddings=True)
    tied.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")  # stored once
    model, _ = load_model(str(tmp_path))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_host_retention_needs_an_evicting_policy():
    with pytest.raises(ValueError, match="retention='host' has no effect with policy='dense'"):
        AlisaConfig(retention="host")
    # An evicting policy: the host keeps what the budget leaves out.
    assert AlisaConfig(policy="swa", caching_ratio=0.2, retention="host").retention == "host"


def test_dense_layers_must_leave_a_layer_to_the_policy():
    model = tiny_llama()  # 2 layers
    with pytest.raises(ValueError, match="dense_layers=2 .* all of the model's 2 layers dense"):
        AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5, dense_layers=2))
    AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5, dense_layers=1))
    # Dense already keeps every token: its dense layers change nothing and are not refused.
    AlisaCache(model, AlisaConfig(dense_layers=2))
    # The config's own properties resolve on a layer count its dense layers leave room in.
    assert AlisaConfig(policy="swa", caching_ratio=0.5, dense_layers=3).selects_per_head


def test_calibration_refuses_a_context_past_the_model_before_measuring(monkeypatch):
    from alisa.calibration import profile

    def measured(*args, **kwargs):
        raise AssertionError("measured before the context was checked")

    monkeypatch.setattr(profile, "copy_bandwidth", measured)
    model = tiny_llama(max_position_embeddings=512)
    with pytest.raises(ValueError, match=r"sizes\[1\]=600 plus the 8 tokens .* <= 504"):
        profile.measure_report(model, sizes=(1, 600))
    assert profile.context_error(model, 504, "context") is None
    assert "context=505" in profile.context_error(model, 505, "context")


def test_the_summary_says_what_the_budget_limits():
    from alisa.commands.generate import budget_text, stats_line
    from alisa.model.adapter import model_shape
    from alisa.planning.spec import model_spec
    from alisa.runtime.engine import GenerationOutput
    from alisa.sizes import format_bytes

    model = tiny_llama()
    result = GenerationOutput(
        texts=["x"],
        token_ids=[[5, 6]],
        prompt_tokens=[4],
        finish_reasons=["length"],
        ttft_s=0.1,
        kv_tier_bytes={"device": 3072, "host": 1024},
        peak_memory_bytes=500 * 2**20,
    )
    assert budget_text(result, model, AlisaConfig()) == ""  # no budget: nothing it limits
    config = AlisaConfig(gpu_memory="2MiB")
    text = budget_text(result, model, config)
    weights = format_bytes(model_spec(model, model_shape(model)).total_weight_bytes)
    assert text.startswith(f"--gpu-memory 2.0 MiB holds weights {weights}, device KV 3.0 KiB")
    line = stats_line(result, config, budget=text)
    assert f"peak process memory 500.0 MiB | {text} | policy dense" in line
