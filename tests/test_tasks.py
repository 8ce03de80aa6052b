"""The runner's accuracy and WikiText-2 tasks (experiments/tasks/), each on the tiny model."""

import json
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama

import experiments.tasks.accuracy as accuracy
from alisa import AlisaConfig
from experiments.tasks import TASKS, Context

PROSE = (Path(__file__).parent / "fixtures" / "prose.txt").read_text()


def write(root: Path, relative: str, rows: list[dict]) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "wikitext2").mkdir()
    (root / "wikitext2" / "wiki.test.raw").write_text(PROSE)
    needle = "The magic number is: 4815162. " + "Filler text. " * 20
    write(
        root,
        "passkey_niah/ruler_niah_single_1_noise.jsonl",
        [
            {"input": needle, "answer_prefix": " It is", "outputs": ["4815162"], "depth": 0.25},
            {"input": "x" * 600, "answer_prefix": " It is", "outputs": ["1"], "depth": 0.5},
        ],
    )
    piqa = [{"goal": f"Open jar {i}", "sol1": "twist the lid", "sol2": "eat it"} for i in range(3)]
    write(root, "piqa/valid.jsonl", piqa)
    (root / "piqa" / "valid-labels.lst").write_text("0\n1\n0\n")
    articles = [{"article": "Article: Rain fell.\nSummary:", "summary_gt": "Rain fell in Wales."}]
    write(root, "xsum/h2o_xsum_0shot.jsonl", articles * 2)
    return Context(tiny_llama(), byte_tokenizer(), root, AlisaConfig(policy="swa"))


def test_niah_scores_rulers_string_match_and_skips_long_prompts(context, monkeypatch):
    answers = []

    def generate(model, tokenizer, prompt, config, max_new_tokens, compile):
        assert compile == "off"  # a new length every row: never compiled
        answers.append(max_new_tokens)
        return type("Output", (), {"texts": [" the number 4815162 ."]})()

    monkeypatch.setattr(accuracy, "generate", generate)
    result = TASKS["niah"](context, {}, {"max_prompt_tokens": 500, "new_tokens": 7})
    assert result == {"accuracy": 1.0, "n": 1, "by_depth": {"0.2": 1.0}, "by_length": {"512": 1.0}}
    assert answers == [7]  # the 600-byte prompt was skipped


def test_multiple_choice_limits_examples_and_scores_both_ways(context):
    three = TASKS["piqa"](context, {}, {"limit": "none"})
    two = TASKS["piqa"](context, {}, {"limit": 2})
    assert (three["n"], two["n"]) == (3, 2)
    for result in (three, two):
        assert result["acc"] * result["n"] % 1 == 0 and 0 <= result["acc_norm"] <= 1


def test_xsum_scores_the_summary_cut_at_the_stop(context, monkeypatch):
    text = " Rain fell in Wales.\n###\nArticle: ..."
    monkeypatch.setattr(accuracy, "generate", lambda *a, **k: type("O", (), {"texts": [text]})())
    result = TASKS["xsum"](context, {}, {"limit": 1})
    assert result == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0, "n": 1}


def test_attention_statistics_cover_every_layer(context):
    options = {"segment_tokens": 40}
    none = TASKS["attention_sparsity"](context, {}, {**options, "threshold": 1e-9})
    most = TASKS["attention_sparsity"](context, {}, {**options, "threshold": 0.99})
    assert len(none["per_layer"]) == 2 and none["mean"] == 0.0
    assert 0.5 < most["mean"] < 1.0
    rho = TASKS["spearman"](context, {}, {**options, "rows": 8, "ratio": 0.5})
    assert set(rho) == {"local", "strided", "swa"} and all(-1 <= r <= 1 for r in rho.values())


def test_throughput_runs_the_batch_under_the_kv_budget(context):
    options = {"prompt_tokens": 16, "waves": 1, "new_tokens": 3, "kv_budget": "1MiB"}
    result = TASKS["throughput"](context, {"batch": 2}, options)
    assert result["tokens_per_s"] > 0 and result["kv_budget_bytes"] == 2**20
    static = TASKS["throughput"](context, {"batch": 2, "system": "hf-dynamic"}, options)
    assert static["tokens_per_s"] > 0 and 1 <= static["largest_batch"] <= 2
    with pytest.raises(ValueError, match="system='hf-fast' is unknown"):
        TASKS["throughput"](context, {"system": "hf-fast"}, options)
