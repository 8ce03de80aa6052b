"""probes.bench_reselect: the fetch and step figures per re-selection interval."""

import pytest
import torch
from conftest import padded_batch, tiny_llama

from alisa import AlisaConfig
from probes.bench_reselect import decode, fetch_figures, parse_args, print_table


@pytest.mark.parametrize("interval", [1, 3])
def test_fetch_figures_count_the_selections_of_the_interval(interval):
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(60, 60))
    config = AlisaConfig(
        policy="swa",
        budget_tokens=24,
        min_budget_tokens=0,
        retention="host",
        reselect_every=interval,
    )
    seconds, layers = decode(model, {"input_ids": ids, "attention_mask": mask}, config, 6)
    assert len(seconds) == 6
    figures = fetch_figures(layers, 6)
    selections = [layer.keeper.steps - before for layer, _, before in layers]
    assert selections == [6 // interval] * len(layers)
    assert figures["budget"] == 24
    assert 0 < figures["changed_share"] <= 1
    # Spread over the steps: a selection every s steps fetches s steps' worth at once.
    expected = figures["fetched_per_selection"] * (6 // interval) / 6
    assert figures["fetched_per_step"] == pytest.approx(expected)


def test_table_and_arguments(capsys):
    row = {
        "reselect_every": 4,
        "mean_step_ms": 10.0,
        "fetched_per_selection": 8.0,
        "fetched_per_step": 2.0,
        "budget": 40.0,
        "changed_share": 0.2,
    }
    print_table([row])
    assert "| 4 | 10.0 | 8.0 | 2.0 | 40 | 0.200 |" in capsys.readouterr().out
    assert parse_args(["--intervals", "1,4"]).intervals == [1, 4]
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--intervals", "0,2"])


def test_main_prints_a_row_per_interval(monkeypatch, capsys):
    import json
    from pathlib import Path

    from conftest import byte_tokenizer

    import experiments.data
    import experiments.shapes
    from probes.bench_reselect import main

    text = (Path(__file__).parent / "fixtures" / "prose.txt").read_text(encoding="utf-8")
    monkeypatch.setattr(
        experiments.shapes,
        "load_benchmark_model",
        lambda spec, dtype: (tiny_llama(), byte_tokenizer()),
    )
    monkeypatch.setattr(experiments.data, "data_dir", lambda path: Path("."))
    monkeypatch.setattr(experiments.data, "load_wikitext2", lambda root: text * 4)
    args = ["--batch", "2", "--prompt-tokens", "200", "--steps", "4", "--intervals", "1,2"]
    assert main([*args, "--threads", str(torch.get_num_threads())]) == 0  # leaves it as it was
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["reselect_every"] for row in report["rows"]] == [1, 2]
    assert all(0 < row["changed_share"] <= 1 for row in report["rows"])
