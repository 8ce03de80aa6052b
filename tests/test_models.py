import pytest
import torch
from conftest import tiny_llama

from alisa import load_model
from alisa.model.loading import cache_root, resolve_dtype, resolve_model_path


def test_local_directory_loads_with_left_padding(tmp_path, tokenizer):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded_tokenizer.padding_side == "left"
    assert loaded_tokenizer.pad_token is not None
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded(ids).logits, model(ids).logits)


def test_dtype_is_applied(tmp_path, tokenizer):
    tiny_llama().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16


def test_unknown_spec_lists_everything_tried(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(ValueError) as error:
        resolve_model_path(str(missing))
    message = str(error.value)
    assert str(missing) in message
    for attempt in ("built-in model", "GGUF file", "local model directory", "hub id"):
        assert attempt in message


def test_directory_without_config_is_reported(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_hub_ids_pass_through_to_from_pretrained():
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


@pytest.mark.parametrize("name", ["float64", "int8", "half-ish"])
def test_unknown_dtype_is_rejected(name):
    with pytest.raises(ValueError, match=f"dtype='{name}'"):
        resolve_dtype(name)


def test_cache_directory_can_be_overridden(monkeypatch, tmp_path):
    monkeypatch.setenv("ALISA_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"


@pytest.mark.slow
def test_builtin_smollm2_is_converted_once_and_cached(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    path = resolve_model_path("smollm2-135m")
    assert str(path).startswith(str(cache_root()))
    assert any(p.suffix == ".safetensors" for p in __import__("pathlib").Path(path).iterdir())


def test_weights_can_be_placed_by_accelerate(tmp_path, tokenizer):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), dtype="float32", max_memory={"cpu": "1GB"})
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded(ids).logits, model(ids).logits)
