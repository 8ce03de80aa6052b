"""The bundled samples (examples/): the README's example files and the smoke sweep's data load as
the commands read them, so a fresh clone without the evaluation data runs them."""

from pathlib import Path

from alisa.jobs import read_requests
from experiments.data import load_copa, load_wikitext2
from experiments.runconfig import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def test_example_prompts_are_valid_batch_input():
    requests = read_requests(EXAMPLES / "prompts.jsonl")
    assert len(requests) >= 4
    assert any(r.chat for r in requests) and any(r.chat is None for r in requests)


def test_smoke_sweep_reads_the_bundled_samples():
    config = load_config(REPO / "experiments" / "configs" / "smoke.toml")
    root = REPO / config.runtime["data_dir"]
    assert root == EXAMPLES / "data"
    assert len(load_wikitext2(root).split()) > 300  # 2 x 64-token segments and more
    assert len(load_copa(root)) >= 8  # the sweep's copa limit
    assert "NOT the evaluation sets" in (root / "README.md").read_text()


def test_long_example_is_a_long_prompt():
    assert len((EXAMPLES / "long.txt").read_text().split()) > 500


def test_smoke_sweep_evicts_in_its_short_segments():
    # The default budget floor (64 tokens) would keep every token of a 64-token segment: swa and
    # h2o would equal dense, and a newcomer's first sweep would show no effect of eviction.
    config = load_config(REPO / "experiments" / "configs" / "smoke.toml")
    segment = config.options["perplexity"]["segment_tokens"]
    for floor in config.sweep["min_budget_tokens"]:
        for ratio in config.sweep["caching_ratio"]:
            assert floor < ratio * segment
