"""probes.ruler_probe: one sample's steps per system, as the runner decodes them."""

import json

import pytest
import torch
from conftest import byte_tokenizer, saved_tiny_llama, tiny_llama
from test_ruler import PROSE, request

from experiments.tasks.ruler.families import FAMILIES, Haystack
from experiments.tasks.ruler.shared import decode_after_prefill, shared_prefill, system_cache
from probes.ruler_probe import departure, main, parse_args, probe

# An 8-token budget departs from dense at the second step on this model and prompt.
SYSTEMS = ["hf-dynamic", "alisa", "alisa:policy=streaming,budget_tokens=8,min_budget_tokens=0"]


def one_sample(tokenizer, length=600):
    haystack = Haystack.from_text(PROSE.read_text(), tokenizer, source="prose fixture")
    return FAMILIES["niah_single"].sample(request(haystack, tokenizer, length=length, samples=1), 0)


def test_each_system_decodes_as_the_runner_and_departs_where_its_tokens_do():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    sample = one_sample(tokenizer)
    rows = probe(model, tokenizer, sample, SYSTEMS, steps=6, top=3)
    ids = torch.tensor([sample.input_ids])
    caches = [system_cache(name, model, max_new_tokens=6) for name in SYSTEMS]
    logits, _ = shared_prefill(model, ids, None, caches)
    for row, cache in zip(rows, caches, strict=True):
        alone = decode_after_prefill(model, tokenizer, ids, None, cache, logits, max_new_tokens=6)
        assert [step["token"] for step in row["steps"]] == alone.token_ids[0], row["system"]
        assert row["prediction"] == alone.texts[0]
        for step in row["steps"]:
            (first, top), (_, second) = step["candidates"][:2]
            assert step["text"] == first  # greedy: the chosen token leads
            assert step["margin"] == pytest.approx(top - second, abs=2e-4)
    assert rows[0]["departure"] is None
    assert rows[1]["departure"] is None  # r = 1 keeps every token: the reference's tokens
    tokens = [[s["token"] for s in row["steps"]] for row in rows]
    first = next(i for i, (a, b) in enumerate(zip(tokens[2], tokens[0], strict=True)) if a != b)
    gone = rows[2]["departure"]
    assert gone["step"] == first
    assert gone["reference_margin"] == rows[0]["steps"][first]["margin"]
    assert gone["margin"] == rows[2]["steps"][first]["margin"]


def test_departure_is_the_first_different_token():
    def steps(tokens):
        return [{"token": t, "text": str(t), "margin": t / 10} for t in tokens]

    assert departure(steps([1, 2, 3]), steps([1, 2, 3, 4])) is None
    assert departure(steps([1, 2, 3]), steps([1, 5, 3])) == {
        "step": 1,
        "reference": "2",
        "reference_margin": 0.2,
        "chosen": "5",
        "margin": 0.5,
    }


def test_the_command_prints_a_table_and_one_json_line(tmp_path, capsys):
    folder = saved_tiny_llama(tmp_path / "tiny")
    code = main(
        [
            "--model",
            str(folder),
            "--length",
            "600",
            "--haystack",
            str(PROSE),
            "--steps",
            "4",
            "--threads",
            "1",
            "--systems",
            ";".join(SYSTEMS),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("{")
    report = json.loads(out[-1])
    assert [row["system"] for row in report["rows"]] == SYSTEMS
    assert all(len(row["steps"]) <= 4 for row in report["rows"])
    assert any(line.startswith("| hf-dynamic |") for line in out)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--family", "nope"], "--family='nope' is unknown"),
        (["--sample", "-1"], "--sample=-1"),
        (["--sample", "3", "--samples", "3"], "--samples=3 must exceed --sample=3"),
        (["--systems", "hf-dynamic"], "name a reference and at least one more"),
        (["--systems", "hf-dynamic;alisa:caching_ratio=2"], "caching_ratio=2"),
        (["--systems", "hf-dynamic;bogus"], "unknown system 'bogus'"),
    ],
)
def test_bad_arguments_are_refused_naming_them(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_missing_haystack_is_an_error_not_a_traceback(tmp_path, capsys):
    code = main(["--haystack", str(tmp_path / "none.txt"), "--systems", "hf-dynamic;alisa"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
