"""The sixth bad-input tour's findings (docs/bad-input-tour.md, "Sixth tour"), each a test."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import byte_tokenizer, tiny_llama
from serve_support import request, running_server

from alisa import AlisaConfig, generate
from alisa.jobs.runner import BatchJob, run_batch
from alisa.serve import ServeSettings

SMALL = 72  # a vocabulary the byte tokenizer's "hello" (ids 73, 70, 77, ...) runs past


def test_a_prompt_past_the_vocabulary_is_refused_by_generate():
    """T1: a tokenizer of another model gave ids the embedding cannot look up: an
    ``IndexError`` from ``torch.embedding`` (a traceback in the CLI); now a ValueError naming
    the prompt, the id and the vocabulary, before the model runs."""
    model = tiny_llama(vocab_size=SMALL)
    with pytest.raises(ValueError, match=r"prompts\[1\] tokenizes to id 73, past the model's "):
        generate(model, byte_tokenizer(), ["AB", "hello"], max_new_tokens=2)
    with pytest.raises(ValueError, match="does the tokenizer belong to this model"):
        generate(model, byte_tokenizer(), "hello", max_new_tokens=2)


def test_a_batch_row_past_the_vocabulary_names_its_line(tmp_path):
    """U-T1: the batch refusal named ``prompt_ids[0]`` of a "request"; now the file, the line
    and the id, with the likely cause, before any row is written."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "AB"}\n{"id": 2, "prompt": "hello"}\n')
    job = BatchJob(input=source, output=tmp_path / "o.jsonl", max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match=r"in.jsonl:2: id 2: the prompt tokenizes to id 73, past"):
        run_batch(tiny_llama(vocab_size=SMALL), byte_tokenizer(), job)
    assert not (tmp_path / "o.jsonl").exists()


def test_a_text_prompt_past_the_vocabulary_is_a_400_and_the_server_keeps_serving():
    """T1c: one text request whose tokens the model cannot embed stopped the server's engine
    (every later request answered 503); now it is a 400 naming ``prompt`` and the next
    request is served."""
    model = tiny_llama(vocab_size=SMALL)
    with running_server(model, byte_tokenizer(), ServeSettings(model_name="tiny")) as served:
        status, body = request(served.port, "POST", "/v1/completions", {"prompt": "hello"})
        assert status == 400 and body["error"]["param"] == "prompt"
        assert "tokenizes to id 73" in body["error"]["message"]
        assert request(served.port, "GET", "/health")[0] == 200
        good = {"prompt": [5, 6], "max_tokens": 2}
        assert request(served.port, "POST", "/v1/completions", good)[0] == 200


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_after_a_prompt_was_edited_or_the_dtype_changed_is_refused(tmp_path):
    """S3, S4: a done row whose prompt was edited since, or a resume in another dtype, was
    taken as done (its answer was to the old prompt, or made at another precision). Rows
    record their prompt's digest and the weights' dtype; a resume compares them."""
    source, output = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    source.write_text('{"id": 1, "prompt": "AB"}\n')
    job = BatchJob(input=source, output=output, max_new_tokens=2, progress=False)
    model = tiny_llama()
    run_batch(model, byte_tokenizer(), job)
    made = _rows(output)[0]["settings"]
    assert made["dtype"] == "float32" and len(made["prompt_sha256"]) == 64
    before = output.read_bytes()
    source.write_text('{"id": 1, "prompt": "CD"}\n')
    with pytest.raises(ValueError, match=r"row id=1: prompt: edited since"):
        run_batch(model, byte_tokenizer(), job)
    source.write_text('{"id": 1, "prompt": "AB"}\n')
    with pytest.raises(ValueError, match=r"dtype: float32 there, bfloat16 now"):
        run_batch(tiny_llama().to(torch.bfloat16), byte_tokenizer(), job)
    assert output.read_bytes() == before
    assert run_batch(model, byte_tokenizer(), job).already_done == 1  # the same: resumed


def test_rows_of_an_older_alisa_are_compared_on_what_they_recorded(tmp_path):
    """A row written before prompts and dtypes were recorded resumes on what it holds."""
    source, output = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    source.write_text('{"id": 1, "prompt": "AB"}\n{"id": 2, "prompt": "CD"}\n')
    job = BatchJob(input=source, output=output, max_new_tokens=2, progress=False)
    run_batch(tiny_llama(), byte_tokenizer(), job)
    old = _rows(output)[0]
    for key in ("prompt_sha256", "dtype"):
        del old["settings"][key]
    output.write_text(json.dumps(old) + "\n")
    summary = run_batch(tiny_llama(), byte_tokenizer(), job)
    assert summary.already_done == 1 and [row["id"] for row in _rows(output)] == [1, 2]


@pytest.mark.parametrize(
    ("cache", "field", "words"),
    [
        ({"stride": 3}, "stride", "stride=3 has no effect with policy='swa'"),
        ({"residual_tokens": 5}, "residual_tokens", "with kv_bits=16"),
        ({"host_bits": 8}, "host_bits", "with retention='drop'"),  # at its default: asked
        ({"policy": "h2o", "score_window": 4}, "score_window", "policy='h2o'"),
    ],
)
def test_a_request_setting_that_changes_nothing_is_a_400(cache, field, words):
    """S2: the server answered 200 to request cache settings that change nothing (the CLI
    warns; a client never sees a warning); now a 400 naming ``alisa.<field>``."""
    config = AlisaConfig(policy="swa", caching_ratio=0.5, min_budget_tokens=0)
    settings = ServeSettings(model_name="tiny", config=config)
    with running_server(tiny_llama(), byte_tokenizer(), settings) as served:
        body = {"prompt": "hi", "max_tokens": 2, "alisa": cache}
        status, answer = request(served.port, "POST", "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == f"alisa.{field}"
        assert words in answer["error"]["message"]
        good = {"prompt": "hi", "max_tokens": 2, "alisa": {"caching_ratio": 0.3}}
        assert request(served.port, "POST", "/v1/completions", good)[0] == 200


def test_a_path_given_as_the_model_is_told_to_load_it():
    """U1: a path where the model goes was said to be a tokenizer swapped with the model (a
    string has ``encode`` too); it is told to load the model, and a tokenizer is named as one
    without the ``generate`` call's example (``attached``, ``AlisaCache`` take no tokenizer)."""
    from alisa import AlisaCache, attached

    with pytest.raises(ValueError, match=r"load it first: model, tokenizer = alisa.load_model"):
        generate("/models/llama", byte_tokenizer(), ["hi"])
    with pytest.raises(ValueError, match="load it first") as refusal, attached("x"):
        pass
    assert "swapped" not in str(refusal.value)
    with pytest.raises(ValueError, match="it looks like a tokenizer: pass the model here"):
        AlisaCache(byte_tokenizer(), AlisaConfig())


def test_byte_sizes_take_scientific_notation_and_refuse_more_than_a_machine_holds():
    """U2: ``--gpu-memory 1e9`` was refused with "use a number": it is one."""
    from alisa.sizes import parse_bytes

    assert parse_bytes("1e9", field="gpu_memory") == 10**9
    assert parse_bytes("2.5e3KB", field="gpu_memory") == 2_500_000
    for value in ("1e99", 1e99, 2**70):
        with pytest.raises(ValueError, match="more bytes than any machine holds"):
            parse_bytes(value, field="gpu_memory")


def test_an_evicting_policy_on_a_model_of_sliding_layers_only_warns():
    """S5: ``--policy swa --caching-ratio 0.1`` on a model whose every layer is a sliding
    window ran as dense with only a note in the stats line; it now warns (as
    ``dense_layers`` covering every layer is refused), and a model with a full-attention
    layer does not."""
    import warnings

    from transformers import MistralConfig, MistralForCausalLM

    from alisa.settings import IgnoredSettingWarning

    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config = MistralConfig(
        vocab_size=512, num_hidden_layers=2, num_key_value_heads=2, sliding_window=16, **sizes
    )
    swa = AlisaConfig(policy="swa", caching_ratio=0.1, min_budget_tokens=0)
    run = dict(max_new_tokens=2, stop_at_eos=False)
    with pytest.warns(IgnoredSettingWarning, match="evicts in no layer of this model: all its 2"):
        generate(MistralForCausalLM(config), byte_tokenizer(), "x" * 40, swa, **run)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        generate(tiny_llama(), byte_tokenizer(), "x" * 40, swa, **run)
