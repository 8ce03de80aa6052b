"""The experiment runner and report: sweeps, resumption, kill -9 safety, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import saved_tiny_llama, tiny_llama

from alisa import AlisaConfig
from experiments.report import main as report_main
from experiments.run import main as run_main
from experiments.runconfig import load_config

COPA = [
    {
        "premise": "The man fell.",
        "choice1": "He tripped.",
        "choice2": "He sang.",
        "question": "cause",
        "label": 0,
    },
    {
        "premise": "It rained.",
        "choice1": "The street got wet.",
        "choice2": "The sun rose.",
        "question": "effect",
        "label": 0,
    },
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiments")
    model_dir = saved_tiny_llama(root / "tiny-model")
    data = root / "data"
    (data / "wikitext2").mkdir(parents=True)
    (data / "wikitext2" / "wiki.test.raw").write_text(
        " = Title = \n" + "The quick brown fox. " * 400
    )
    (data / "copa").mkdir()
    (data / "copa" / "superglue_COPA_val.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in COPA)
    )
    return root, model_dir, data


def write_config(root: Path, model_dir: Path, data: Path, name="t", extra="") -> Path:
    path = root / f"{name}.toml"
    path.write_text(f"""
name = "{name}"
[sweep]
task = ["perplexity", "copa"]
model = ["{model_dir}"]
policy = ["dense", "swa", "h2o"]
caching_ratio = [0.5, 0.25]
batch = [2]
[options.perplexity]
segment_tokens = 48
[runtime]
data_dir = "{data}"
results_dir = "{root / "results"}"
threads = 1
{extra}
""")
    return path


CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"


def rows(folder: Path) -> list:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def only_run(root: Path, name: str) -> Path:
    runs = sorted((root / "results" / name).iterdir())
    assert len(runs) == 1
    return runs[0]


def test_sweep_runs_every_point_once_and_resumes(workspace):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="sweep")
    assert run_main(["--config", str(config), "--no-progress"]) == 0
    folder = only_run(root, "sweep")
    first = rows(folder)
    # 2 tasks x (dense once + swa, h2o at two ratios) = 10 points
    assert len(first) == 10
    assert {r["point"]["task"] for r in first} == {"perplexity", "copa"}
    assert all("perplexity" in r["metrics"] or "acc" in r["metrics"] for r in first)
    env = json.loads((folder / "env.json").read_text())
    assert env["torch"] and env["threads"] == 1
    assert run_main(["--config", str(config), "--no-progress"]) == 0
    assert rows(only_run(root, "sweep")) == first  # resumed: nothing redone


def test_overrides_change_the_sweep_and_start_a_new_run(workspace):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="override")
    code = run_main(
        [
            "--config",
            str(config),
            "--set",
            "sweep.policy=swa",
            "--set",
            "sweep.task=copa",
            "--no-progress",
        ]
    )
    assert code == 0
    assert [r["point"]["policy"] for r in rows(only_run(root, "override"))] == ["swa", "swa"]


def test_report_writes_tables_and_plots(workspace, capsys):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="report")
    run_main(["--config", str(config), "--set", "sweep.task=perplexity", "--no-progress"])
    assert report_main([str(root / "results" / "report")]) == 0
    folder = only_run(root, "report")
    text = (folder / "report.md").read_text()
    assert "| perplexity" in text or "perplexity |" in text
    assert (folder / "perplexity_vs_sparsity.png").stat().st_size > 1000


def test_kill_9_loses_and_duplicates_nothing(workspace):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="killed", extra="[options.copa]\nlimit = 2")
    config.write_text(
        config.read_text().replace(
            "caching_ratio = [0.5, 0.25]",
            "caching_ratio = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]",
        )
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--config", str(config), "--no-progress"],
        cwd=Path(__file__).parents[1],
    )
    results = root / "results" / "killed"
    deadline = time.time() + 120
    while time.time() < deadline:
        files = list(results.glob("*/results.jsonl"))
        if files and len(files[0].read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    partial = rows(only_run(root, "killed"))
    total = len(load_config(config).points())
    assert 4 <= len(partial) < total
    assert run_main(["--config", str(config), "--no-progress"]) == 0
    final = rows(only_run(root, "killed"))
    assert final[: len(partial)] == partial
    keys = [r["id"] for r in final]
    assert len(keys) == len(set(keys)) == total


def test_both_protocols_are_run_and_named_in_every_row(workspace):
    root, model_dir, data = workspace
    extra = 'protocol = ["streaming", "prefill"]\npreset = ["default", "paper"]'
    config = write_config(root, model_dir, data, name="protocols")
    text = config.read_text().replace("batch = [2]", "batch = [2]\n" + extra)
    config.write_text(text)
    assert run_main(["--config", str(config), "--no-progress"]) == 0
    results = rows(only_run(root, "protocols"))
    perplexity = [r for r in results if r["point"]["task"] == "perplexity"]
    copa = [r for r in results if r["point"]["task"] == "copa"]
    # copa has no protocol: run once per (policy, r, preset), not once per protocol.
    assert len(copa) == 2 * 5 and all("protocol" not in r["point"] for r in copa)
    assert len(perplexity) == 2 * 2 * 5
    for row in perplexity:
        assert row["metrics"]["protocol"] == row["point"]["protocol"]
        expected = 1 if row["point"]["protocol"] == "streaming" else 24  # half of 48 tokens
        assert row["metrics"]["prefill_tokens"] == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('name = "x"\nbogus = 1\n[sweep]\ntask = ["copa"]', "unknown key(s) ['bogus']"),
        ('name = "x"\n[sweep]\ntask = ["copa"]\nratio = [0.5]', "unknown sweep key 'ratio'"),
        ('name = "x"\n[sweep]\ntask = []', "sweep.task is an empty list"),
        ('name = "x"', "the sweep is empty"),
        ('name = "x"\n[sweep]\ntask = ["summarise"]', "unknown task 'summarise'"),
        ('name = "x"\n[sweep]\ntask = ["copa"]\n[runtime]\ngpu = 1', "unknown runtime key 'gpu'"),
        ('name = "x"\n[sweep]\ntask = ["copa"]\ncaching_ratio = [1.5]', "caching_ratio=1.5"),
        ("name = [", "not valid TOML"),
        (
            'name = "x"\n[sweep]\ntask = ["perplexity"]\nprotocol = ["offline"]',
            "sweep.protocol 'offline' is unknown",
        ),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert run_main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_unknown_override_key_is_named(tmp_path, capsys, workspace):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="ovr")
    assert run_main(["--config", str(config), "--set", "speed=fast"]) == 1
    assert "'speed'" in capsys.readouterr().err


def test_missing_data_and_unwritable_results_are_clear_errors(tmp_path, capsys, workspace):
    root, model_dir, data = workspace
    empty = tmp_path / "no-data"
    empty.mkdir()
    config = write_config(tmp_path, model_dir, empty, name="nodata")
    assert run_main(["--config", str(config), "--set", "sweep.task=copa", "--no-progress"]) == 1
    assert "superglue_COPA_val.jsonl" in capsys.readouterr().err
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    config = write_config(tmp_path, model_dir, data, name="unwritable")
    code = run_main(["--config", str(config), "--set", f"runtime.results_dir={str(blocker)!r}"])
    assert code == 1 and "results directory" in capsys.readouterr().err


def test_a_malformed_results_line_is_reported_with_its_line(workspace, capsys):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="corrupt")
    run_main(
        [
            "--config",
            str(config),
            "--set",
            "sweep.task=copa",
            "--set",
            "sweep.policy=swa",
            "--no-progress",
        ]
    )
    folder = only_run(root, "corrupt")
    lines = (folder / "results.jsonl").read_text().splitlines()
    (folder / "results.jsonl").write_text(lines[0] + "\n{garbage\n" + "\n".join(lines[1:]) + "\n")
    assert (
        run_main(["--config", str(config), "--set", "sweep.task=copa", "--set", "sweep.policy=swa"])
        == 1
    )
    assert "results.jsonl:2" in capsys.readouterr().err


def test_torchrun_spreads_points_over_ranks_and_merges_one_results_file(workspace):
    from alisa.jobs.parts import parts_dir, share
    from experiments.runconfig import point_key

    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="ranks", extra="[options.copa]\nlimit = 2")
    overrides = ["--set", "sweep.task=copa", "--no-progress"]
    points = load_config(config, ["sweep.task=copa"]).points()
    assert all(share(points, 2, rank, key=point_key) for rank in (0, 1))  # both get points
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["2", "-m", "experiments.run", "--config", str(config), *overrides]
    done = subprocess.run(
        command,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("results in") == 1  # rank 0 reports
    folder = only_run(root, "ranks")
    merged = rows(folder)
    assert sorted(r["id"] for r in merged) == sorted(point_key(p) for p in points)
    assert not parts_dir(folder / "results.jsonl").exists()
    assert run_main(["--config", str(config), *overrides]) == 0  # one process resumes: no work
    assert rows(only_run(root, "ranks")) == merged


def test_both_protocols_score_the_tokens_a_full_forward_scores():
    from experiments.tasks.perplexity import decode_perplexity, protocol_prefill

    model = tiny_llama()
    segments = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=segments).logits.float()
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), segments[:, 1:], reduction="none"
    )  # (2, 39): nll[:, t] predicts token t + 1
    for protocol in ("streaming", "prefill"):
        prefill = protocol_prefill(protocol, 40)
        assert prefill == (1 if protocol == "streaming" else 20)
        result = decode_perplexity(
            model, segments, AlisaConfig(), prefill_tokens=prefill, progress=False
        )
        assert result.tokens == 2 * (40 - prefill)
        assert abs(result.nll - float(nll[:, prefill - 1 :].mean())) < 1e-4
    with pytest.raises(ValueError, match="protocol='batch'"):
        protocol_prefill("batch", 40)


def test_the_sparsity_plot_draws_a_line_per_policy_retention_preset_and_protocol(tmp_path):
    """What ``experiments.plot_retention`` drew from fidelity runs, the report draws from a run:
    perplexity vs KV sparsity, one series per retention, preset and protocol, dense flat."""
    from experiments.report import plot_sparsity_curves, sparsity_lines

    def row(policy, ratio, ppl, retention="drop", preset="default", protocol="streaming"):
        point = {"task": "perplexity", "policy": policy, "caching_ratio": ratio}
        point |= {"retention": retention, "preset": preset, "protocol": protocol}
        return {"point": point, "metrics": {"perplexity": ppl}}

    rows = [
        row("dense", 1.0, 23.0),
        row("swa", 0.2, 31.0),
        row("swa", 0.5, 27.0),
        row("swa", 0.2, 23.6, retention="host"),
        row("swa", 0.2, 44.8, preset="paper"),
        row("swa", 0.2, 29.2, preset="paper", protocol="prefill"),
    ]
    lines = sparsity_lines("perplexity", rows)
    name = "policy={}, retention={}, preset={}, protocol={}".format
    assert lines[name("swa", "drop", "default", "streaming")] == [
        (50.0, 27.0),
        (pytest.approx(80.0), 31.0),
    ]
    assert lines[name("swa", "host", "default", "streaming")] == [(pytest.approx(80.0), 23.6)]
    assert lines[name("swa", "drop", "paper", "prefill")] == [(pytest.approx(80.0), 29.2)]
    assert lines[name("dense", "drop", "default", "streaming")] == [(0.0, 23.0)]
    assert len(lines) == 5
    figure = plot_sparsity_curves("perplexity", rows, tmp_path)
    assert figure == tmp_path / "perplexity_vs_sparsity.png" and figure.stat().st_size > 0
    assert sparsity_lines("copa", [{"point": {"task": "copa"}, "metrics": {"acc": 1}}]) == {}


def test_the_fidelity_config_reads_passkeys_answers_from_ten_new_tokens(workspace, monkeypatch):
    """``experiments/configs/fidelity.toml`` is what ``experiments.fidelity`` ran: perplexity per
    protocol (the segments one batch) and passkey retrieval, whose answer is read from 10 greedy
    tokens (12 without the option); ``--set`` narrows it as the old flags did."""
    import experiments.tasks.accuracy as accuracy

    root, model_dir, data = workspace
    (data / "passkey_niah").mkdir(exist_ok=True)
    passkey = {"prompt": "The pass key is 71432. Remember it. The pass key is", "answer": 71432}
    passkeys = [{**passkey, "id": n, "depth": 0.5} for n in range(2)]
    (data / "passkey_niah" / "passkey_landmark_format.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in passkeys)
    )
    asked = []

    def generate(model, tokenizer, prompt, config, max_new_tokens, compile):
        assert compile == "off"  # a new length every row: never compiled
        asked.append(max_new_tokens)
        return type("Output", (), {"texts": [" 71432"]})()

    monkeypatch.setattr(accuracy, "generate", generate)
    overrides = [f"sweep.model={model_dir}", "sweep.policy=dense,swa", "sweep.caching_ratio=0.5"]
    overrides += [
        "sweep.protocol=streaming",
        "sweep.batch=2",
        "options.perplexity.segment_tokens=48",
    ]
    overrides += [f"runtime.data_dir={str(data)!r}", f"runtime.results_dir={str(root / 'f')!r}"]
    argv = ["--config", str(CONFIGS / "fidelity.toml"), "--no-progress"]
    assert run_main([*argv, *(item for o in overrides for item in ("--set", o))]) == 0
    [folder] = (root / "f" / "fidelity").iterdir()
    results = {(r["point"]["task"], r["point"]["policy"]): r for r in rows(folder)}
    assert sorted(results) == [
        ("passkey", "dense"),
        ("passkey", "swa"),
        ("perplexity", "dense"),
        ("perplexity", "swa"),
    ]
    assert results["perplexity", "swa"]["metrics"]["tokens"] == 2 * (48 - 1)
    assert (
        results["passkey", "swa"]["metrics"] | {"accuracy": 1.0, "n": 2}
        == (results["passkey", "swa"]["metrics"])
    )
    assert asked == [10] * 4
    with pytest.raises(ValueError, match="options.passkey.new_tokens=0 must be an integer >= 1"):
        load_config(CONFIGS / "fidelity.toml", ["options.passkey.new_tokens=0"])


@pytest.mark.parametrize(
    "config",
    [
        AlisaConfig(),
        AlisaConfig(policy="swa", caching_ratio=0.2, retention="host"),
        AlisaConfig(gpu_memory=123456789, recompute="never", kv_bits=8, score_decay=False),
    ],
)
def test_a_benchmark_system_name_reads_back_as_its_config(config):
    # bench_cost_model measures each configuration in a worker process by this name.
    from experiments.systems import parse_alisa, system_name

    assert parse_alisa(system_name(config)) == config
