"""The twelfth bad-input tour's findings in the experiment runner (docs/bad-input-tour.md,
"Twelfth tour"): sweep keys and settings that changed nothing, tasks run past the model's
context or the data, a throughput point where nothing fit; each a test."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama
from transformers.utils import logging as hf_logging

from experiments.run import main as run_main


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("tour12")
    model_dir = root / "tiny"
    tiny_llama(max_position_embeddings=64).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    (root / "data" / "wikitext2").mkdir(parents=True)
    (root / "data" / "wikitext2" / "wiki.test.raw").write_text(" = T = \n" + "A fox ran. " * 60)
    return root, model_dir


def config(root: Path, model_dir: Path, sweep: str, extra: str = "", name: str = "t") -> str:
    path = root / f"{name}.toml"
    path.write_text(f"""
name = "{name}"
[sweep]
model = ["{model_dir}"]
{sweep}
[options.perplexity]
segment_tokens = 32
[runtime]
data_dir = "{root / "data"}"
results_dir = "{root / "results"}"
threads = 1
{extra}
""")
    return str(path)


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = run_main([*argv, "--no-progress"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, " ".join(err.split())


def test_a_sweep_field_no_point_reads_is_warned(workspace, capsys):
    """S2: ``sweep.host_bits`` where every point drops ran and was recorded in every row."""
    path = config(*workspace, 'task = ["perplexity"]\npolicy = ["swa"]\nhost_bits = [4]', name="hb")
    code, err = run(["--config", path], capsys)
    assert code == 0
    assert "warning: sweep.host_bits has no effect in any point: host_bits=4" in err
    # read by one point of the sweep: said by nobody
    sweep = 'task = ["perplexity"]\npolicy = ["swa"]\nretention = ["drop", "host"]\nhost_bits = [4]'
    code, err = run(["--config", config(*workspace, sweep, name="hb2")], capsys)
    assert code == 0 and "host_bits" not in err


def test_host_retention_under_dense_is_noted_as_the_ratio_is(workspace, capsys):
    """S2: ``retention = host`` for dense points ran them dropping, recorded as drop, unsaid."""
    sweep = 'task = ["perplexity"]\npolicy = ["dense", "swa"]\nretention = ["host"]'
    code, err = run(["--config", config(*workspace, sweep, name="rh")], capsys)
    assert code == 0
    assert "note: sweep.retention ['host'] applies to the evicting policies" in err
    only_dense = 'task = ["perplexity"]\npolicy = ["dense"]\nretention = ["host"]'
    code, err = run(["--config", config(*workspace, only_dense, name="rh2")], capsys)
    assert code == 1 and "sweep.retention=['host'] has no effect with sweep.policy ['dense']" in err


@pytest.mark.parametrize(
    ("sweep", "said"),
    [
        ('family = ["niah_single"]', "sweep.family has no effect: only ruler read it"),
        ('system = ["vllm"]', "sweep.system has no effect: only ruler, ruler_cost, throughput"),
        ('system = ["alisa:policy=h2o"]', "sweep.system has no effect"),
    ],
)
def test_a_sweep_key_no_task_of_the_sweep_reads_is_warned(workspace, capsys, sweep, said):
    """S2, S3: ``sweep.family`` and ``sweep.system`` on a perplexity run were dropped (family)
    or written into rows that did not run them (an 'h2o' row holding swa's perplexity)."""
    name = f"k{abs(hash(sweep))}"
    path = config(*workspace, f'task = ["perplexity"]\npolicy = ["swa"]\n{sweep}', name=name)
    code, err = run(["--config", path], capsys)
    assert code == 0 and f"warning: {said}" in err and "sweep.task is ['perplexity']" in err
    (results,) = (workspace[0] / "results" / name).rglob("results.jsonl")
    assert all("system" not in json.loads(row)["point"] for row in results.read_text().splitlines())


def test_a_throughput_system_is_checked_with_the_config(workspace, capsys):
    """S3: a system throughput does not know is refused before any point runs."""
    sweep = 'task = ["throughput"]\npolicy = ["swa"]\nsystem = ["alisa", "caching_ratio=2"]'
    code, err = run(["--config", config(*workspace, sweep, name="ts")], capsys)
    assert code == 1
    assert "system='caching_ratio=2' is unknown to throughput; valid: alisa" in err
    assert not (workspace[0] / "results" / "ts").exists()


def test_two_places_for_the_protocol_are_refused(workspace, capsys):
    """S2: ``sweep.protocol`` against ``options.perplexity.protocol`` (the sweep won) without
    a word."""
    path = config(*workspace, 'task = ["perplexity"]\nprotocol = ["prefill"]', name="p")
    code, err = run(["--config", path, "--set", "options.perplexity.protocol=streaming"], capsys)
    assert code == 1
    assert "sweep.protocol ['prefill'] and options.perplexity.protocol 'streaming'" in err


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ("[options.perplexity]\nsegment_tokens = 128", "(options.perplexity.segment_tokens=128)"),
        (
            "[options.throughput]\nprompt_tokens = 60\nnew_tokens = 8",
            "(options.throughput.prompt_tokens=60 and new_tokens=8)",
        ),
    ],
)
def test_a_task_past_the_model_s_context_is_refused(workspace, capsys, options, said):
    """S4: 128-token segments on a 64-token model were scored; 100,000-token throughput prompts
    gave figures that contradicted each other."""
    task = "throughput" if "throughput" in options else "perplexity"
    path = config(*workspace, f'task = ["{task}"]\npolicy = ["swa"]', name=f"c{task}")
    text = Path(path).read_text().replace("[options.perplexity]\nsegment_tokens = 32", options)
    Path(path).write_text(text)
    code, err = run(["--config", path], capsys)
    assert code == 1 and said in err and "64" in err


def test_text_too_short_names_the_options(workspace, capsys):
    """U3: 'text has 503 tokens; 1 segments of 512 need 512' named neither option nor fix."""
    path = config(*workspace, 'task = ["perplexity"]\nbatch = [40]', name="u3")
    code, err = run(["--config", path], capsys)
    assert code == 1
    assert "(options.perplexity.segment_tokens=32, rows from sweep.batch): lower them" in err


def test_throughput_more_prompts_than_the_text_gives_is_named(workspace, capsys):
    """U4: a batch the text cannot fill was reported through a deleted temporary file."""
    sweep = 'task = ["throughput"]\npolicy = ["swa"]\nbatch = [1000]'
    extra = "[options.throughput]\nprompt_tokens = 16\nnew_tokens = 2"
    code, err = run(["--config", config(*workspace, sweep, extra, name="u4")], capsys)
    assert code == 1
    assert "sweep.batch=1000 x options.throughput.waves=2 needs 2000 different prompts" in err
    assert "in.jsonl" not in err


def test_a_throughput_point_where_nothing_fits_is_an_error(workspace, capsys):
    """S5: ``kv_budget = 1KB`` recorded 0 tok/s from 0 batches as a result."""
    sweep = 'task = ["throughput"]\npolicy = ["swa"]\nbatch = [2]'
    extra = '[options.throughput]\nprompt_tokens = 16\nnew_tokens = 2\nkv_budget = "1KB"'
    code, err = run(["--config", config(*workspace, sweep, extra, name="s5")], capsys)
    assert code == 1 and "of 4 prompts do not fit options.throughput.kv_budget=1KB" in err
    results = workspace[0] / "results" / "s5"
    assert not any(line for f in results.rglob("results.jsonl") for line in f.read_text().split())


def test_no_progress_hides_the_loading_bars_too(workspace, capsys):
    """S6: ``--no-progress`` still showed transformers' 'Loading weights' bar."""
    hf_logging.enable_progress_bar()
    try:
        path = config(*workspace, 'task = ["perplexity"]', name="s6")
        assert run(["--config", path], capsys)[0] == 0
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_a_ruler_system_given_the_sweep_s_fields_is_quiet():
    """U5: a dense system given the base config's floor printed a raw IgnoredSettingWarning
    with its source line (the sweep crosses every system with every field by design)."""
    from experiments.tasks.ruler.shared import check_system

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_system("alisa:policy=dense", {"min_budget_tokens": 0})


def test_rows_of_a_perplexity_run_carry_no_system(workspace, capsys):
    """S3: a mixed sweep keeps ``system`` only in the points of tasks that read it."""
    sweep = 'task = ["perplexity", "throughput"]\npolicy = ["swa"]\nsystem = ["alisa"]'
    extra = "[options.throughput]\nprompt_tokens = 16\nnew_tokens = 2"
    assert run(["--config", config(*workspace, sweep, extra, name="mix")], capsys)[0] == 0
    (results,) = (workspace[0] / "results" / "mix").rglob("results.jsonl")
    points = [json.loads(line)["point"] for line in results.read_text().splitlines()]
    assert {p["task"]: "system" in p for p in points} == {"perplexity": False, "throughput": True}
