"""The RULER suite: generation, fitting, scoring, the shared prefill and the runner's rows."""

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from architectures import FAMILIES as ARCHITECTURES
from architectures import build
from conftest import byte_tokenizer, saved_tiny_llama, tiny_llama

from alisa import generate
from experiments.systems import make_cache
from experiments.tasks.ruler.families import (
    FAMILIES,
    Haystack,
    Request,
    clean_prediction,
    fit,
    generate_samples,
    string_match_all,
    string_match_part,
    uses_chat,
)
from experiments.tasks.ruler.options import RulerOptions
from experiments.tasks.ruler.shared import decode_after_prefill, shared_prefill, system_cache

PROSE = Path(__file__).parent / "fixtures" / "prose.txt"
LENGTH = 2040  # bytes = tokens with the byte tokenizer; the tiny models reach 2,048
CHAT = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def haystack():
    return Haystack.from_text(PROSE.read_text(), byte_tokenizer(), source="prose fixture")


def request(haystack, tokenizer=None, *, length=LENGTH, samples=4, seed=0, chat=False):
    tokenizer = tokenizer or byte_tokenizer()
    return Request(
        haystack=haystack,
        tokenizer=tokenizer,
        chat=uses_chat(tokenizer, chat),
        length=length,
        samples=samples,
        seed=seed,
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_generation_is_deterministic_and_fits_the_length(haystack, name):
    family = FAMILIES[name]
    first = [family.sample(request(haystack), i) for i in range(3)]
    again = [family.sample(request(haystack), i) for i in range(3)]
    assert first == again
    assert len({s.prompt for s in first}) == 3  # samples differ from each other
    other_seed = family.sample(request(haystack, seed=1), 0)
    assert other_seed.prompt != first[0].prompt
    for sample in first:
        total = len(sample.input_ids) + sample.new_tokens
        # Within one haystack unit of the length: a sentence (at most 223 bytes here) or, for
        # the word lists, one word's entries.
        assert LENGTH - 240 <= total <= LENGTH, (name, total)


@pytest.mark.parametrize("name", ["niah_single", "niah_grid"])
def test_samples_at_chosen_indices_are_those_of_the_whole_set(haystack, name):
    options = RulerOptions(samples=4)
    whole = generate_samples(byte_tokenizer(), haystack, name, LENGTH, options)
    chosen = generate_samples(byte_tokenizer(), haystack, name, LENGTH, options, indices=[3, 1])
    assert chosen == [whole[3], whole[1]]


@pytest.mark.parametrize("name", ["niah_single", "niah_multikey", "niah_multivalue", "vt"])
def test_every_reference_is_in_the_prompt_before_the_question(haystack, name):
    for index in range(3):
        sample = FAMILIES[name].sample(request(haystack), index)
        question = sample.prompt.rindex("\n")
        for reference in sample.references:
            assert reference in sample.prompt[:question]


def test_grid_needles_sit_at_the_requested_depths(haystack):
    samples = 5
    for index in range(samples):
        sample = FAMILIES["niah_grid"].sample(request(haystack, samples=samples), index)
        wanted = index / (samples - 1)
        context = sample.prompt.split("\n")[1]  # the template puts the context on its own line
        needle = context.index("One of the special magic numbers")
        # Sentences here are at most 223 bytes of ~1,400: the nearest boundary is that close.
        assert abs(needle / len(context) - wanted) < 0.17, (index, needle / len(context))
        assert abs(sample.depths[0] - wanted) < 0.17
        assert sample.references[0] in context[needle : needle + 80]


def test_multi_needle_depths_are_ordered_and_spread(haystack):
    sample = FAMILIES["niah_multikey"].sample(request(haystack), 0)
    assert len(sample.depths) == 4 and list(sample.depths) == sorted(sample.depths)
    keys = re.findall(r"numbers for (\S+) is: (\d{7})\.", sample.prompt)
    assert len({key for key, _ in keys}) == 4  # four distinct keys, one asked
    asked = sample.prompt[sample.prompt.rindex("for ") :]
    assert sum(key in asked for key, _ in keys) == 1
    assert dict(keys)[next(key for key, _ in keys if key in asked)] == sample.references[0]


def test_common_words_repeat_more_than_the_others(haystack):
    sample = FAMILIES["cwe"].sample(request(haystack), 0)
    listing = sample.prompt.split("\n")[-2]  # the list to answer about (the example comes first)
    counts = Counter(re.findall(r"\d+\. (\w+)", listing))
    assert len(sample.references) == 10
    common = min(counts[word] for word in sample.references)
    others = max(n for word, n in counts.items() if word not in sample.references)
    assert common > others  # 6 vs 1 below 4,096 tokens, as RULER


def test_frequent_words_answer_is_the_next_three_after_the_dots(haystack):
    sample = FAMILIES["fwe"].sample(request(haystack), 0)
    text = sample.prompt[sample.prompt.index("coded words. ") :].split("\n")[0]
    counts = Counter(text.split()[5:])
    ranked = [word for word, _ in counts.most_common() if word != "..."]
    assert list(sample.references) == ranked[:3]
    assert counts[ranked[2]] > counts[ranked[3]]


def test_frequent_words_without_scipy_name_the_bench_extra(haystack, monkeypatch):
    monkeypatch.delitem(sys.modules, "scipy.special", raising=False)
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"scipy.special is not installed: .*\[bench\]"):
        FAMILIES["fwe"].sample(request(haystack), 0)


def test_prompts_follow_the_model_format(haystack):
    chat_tokenizer = byte_tokenizer()
    chat_tokenizer.chat_template = CHAT
    chat = FAMILIES["niah_single"].sample(request(haystack, chat_tokenizer, chat="auto"), 0)
    plain = FAMILIES["niah_single"].sample(request(haystack), 0)
    assert chat.prompt.startswith("<|user|>") and "<|end|><|assistant|> The special" in chat.prompt
    assert plain.prompt.startswith("A special magic number is hidden")
    assert plain.prompt.endswith("mentioned in the provided text is")
    with pytest.raises(ValueError, match="no chat template"):
        uses_chat(byte_tokenizer(), True)


def test_fit_finds_the_largest_size_and_names_what_cannot_fit():
    size, prompt = fit(lambda n: "x" * (10 + 3 * n), len, 100)
    assert size == 30 and len(prompt) == 100
    with pytest.raises(ValueError, match="cwe: the smallest prompt has 40 tokens"):
        fit(lambda n: "x" * (10 + 3 * n), len, 20, smallest=10, what="cwe")
    with pytest.raises(ValueError, match="5 units of the source make only 25 tokens"):
        fit(lambda n: "x" * (10 + 3 * n), len, 100, largest=5, what="cwe")


def test_too_few_words_or_sentences_are_refused(haystack):
    with pytest.raises(ValueError, match="at least 8"):
        Haystack.from_text("One sentence. Two.", byte_tokenizer(), source="tiny.txt")
    with pytest.raises(ValueError, match="units of the source"):
        FAMILIES["cwe"].sample(request(haystack, length=20000), 0)


def test_scoring_is_rulers_string_match():
    references = ["1234567", "Apple", "kiwi"]
    assert string_match_all("the numbers: 1234567, apple.", references) == pytest.approx(2 / 3)
    assert string_match_all("nothing here", references) == 0.0
    assert string_match_all(" 1234567 APPLE Kiwi ", references) == 1.0
    assert string_match_part("APPLE", references) == 1.0
    assert string_match_part("pear", references) == 0.0
    assert clean_prediction("  a\tb\x00c  ") == "a\nb\nc"
    with pytest.raises(ValueError, match="references"):
        string_match_all("x", [])


SYSTEMS = [
    "hf-dynamic",
    "alisa:kv_bits=8",
    "alisa:policy=swa,caching_ratio=0.2",
    "alisa:policy=h2o,caching_ratio=0.2",
    "alisa:policy=tova,caching_ratio=0.2",
    "alisa:policy=streaming,caching_ratio=0.2",
    "alisa:policy=swa,caching_ratio=0.1,retention=host",
    "alisa:policy=swa,caching_ratio=0.1,retention=host,kv_bits=8",
]


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_shared_prefill_decodes_as_each_system_alone(rows, architecture):
    model = tiny_llama() if architecture == "llama" else build(ARCHITECTURES["gemma3"])
    tokenizer = byte_tokenizer()
    prompts = ["The quick brown fox jumps over the lazy dog. " * 9, "A lazy dog naps. " * 12]
    batch = tokenizer(prompts[:rows], return_tensors="pt", padding=True)
    ids = batch["input_ids"]
    mask = batch["attention_mask"] if rows > 1 else None
    caches = [system_cache(name, model, max_new_tokens=8) for name in SYSTEMS]
    logits, _ = shared_prefill(model, ids, mask, caches)
    for name, cache in zip(SYSTEMS, caches, strict=True):
        shared = decode_after_prefill(model, tokenizer, ids, mask, cache, logits, max_new_tokens=8)
        own, config = make_cache(name, model)
        alone = generate(
            model, tokenizer, prompts[:rows], config, max_new_tokens=8, past_key_values=own
        )
        assert shared.token_ids == alone.token_ids, name
        assert shared.kv_tier_bytes == alone.kv_tier_bytes, name
    assert model.config._attn_implementation == "sdpa"  # restored after the shared prefill


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    model_dir = saved_tiny_llama(root / "tiny-model")
    return root, model_dir


def ruler_config(root: Path, model_dir: Path, name: str, extra: str = "") -> Path:
    path = root / f"{name}.toml"
    path.write_text(f"""
name = "{name}"
[sweep]
task = ["ruler"]
model = ["{model_dir}"]
length = [{LENGTH}]
family = ["niah_single", "vt"]
batch = [1]
system = ["hf-dynamic", "alisa:policy=swa,caching_ratio=0.1", "alisa:policy=swa,retention=host"]
caching_ratio = [0.1]
[options.ruler]
samples = 2
haystack = "{PROSE}"
[runtime]
results_dir = "{root / "results"}"
threads = 1
{extra}
""")
    return path


def results(root: Path, name: str) -> list[dict]:
    (run,) = sorted((root / "results" / name).iterdir())
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


def test_the_runner_prefills_once_for_every_system_and_resumes(workspace, monkeypatch):
    from experiments.run import main as run_main
    from experiments.runconfig import load_config, point_key
    from experiments.tasks.ruler import shared

    root, model_dir = workspace
    config = ruler_config(root, model_dir, "grouped")
    prefills = []
    original = shared.shared_prefill

    def counting(model, ids, mask, caches):
        prefills.append(len(caches))
        return original(model, ids, mask, caches)

    monkeypatch.setattr(shared, "shared_prefill", counting)
    assert run_main(["--config", str(config), "--no-progress"]) == 0
    assert prefills == [3] * 4  # 2 families x 2 samples, each prefilled once for 3 systems
    rows = results(root, "grouped")
    assert len(rows) == 6
    systems = {row["metrics"]["system"] for row in rows}
    # caching_ratio in the sweep applies to the alisa systems: host at r = 0.1, named in full.
    assert "alisa:policy=swa,caching_ratio=0.1,retention=host" in systems
    for row in rows:
        metrics = row["metrics"]
        assert metrics["samples"] == 2 and 0.0 <= metrics["score"] <= 1.0
        assert metrics["score"] == sum(s["score"] for s in metrics["per_sample"]) / 2
        assert all(s["prompt_tokens"] + 32 <= LENGTH for s in metrics["per_sample"])
        assert metrics["kv_device_bytes"] > 0 and metrics["format"] == "plain"
        assert (metrics["kv_host_bytes"] > 0) == ("retention=host" in metrics["system"])
        # The command runs this point alone.
        argv = row["command"].split(" --set ")
        overrides = [item.strip("'") for item in argv[1:]]
        assert load_config(config, overrides).points() == [row["point"]]
    dense = next(r for r in rows if r["metrics"]["system"] == "hf-dynamic")
    drop = next(r for r in rows if r["metrics"]["system"] == "alisa:policy=swa,caching_ratio=0.1")
    assert drop["metrics"]["kv_device_bytes"] < 0.5 * dense["metrics"]["kv_device_bytes"]
    prefills.clear()
    assert run_main(["--config", str(config), "--no-progress"]) == 0
    assert prefills == [] and [point_key(r["point"]) for r in results(root, "grouped")] == [
        point_key(r["point"]) for r in rows
    ]


def test_the_cost_task_runs_one_system_alone(workspace):
    from experiments.run import main as run_main

    root, model_dir = workspace
    config = ruler_config(root, model_dir, "cost")
    overrides = ["--set", "sweep.task=ruler_cost", "--set", "sweep.system=hf-dynamic"]
    overrides += ["--set", f"options.ruler_cost.haystack={str(PROSE)!r}"]
    overrides += ["--set", "options.ruler_cost.new_tokens=8"]
    assert run_main(["--config", str(config), "--no-progress", *overrides]) == 0
    (row,) = results(root, "cost")
    assert row["point"] == {  # an HF cache takes no AlisaConfig field: caching_ratio dropped
        "task": "ruler_cost",
        "model": str(model_dir),
        "length": LENGTH,
        "batch": 1,
        "system": "hf-dynamic",
    }
    metrics = row["metrics"]
    assert metrics["peak_rss_bytes"] > 0 and metrics["decode_tokens_per_s"] > 0
    assert metrics["kv_tier_bytes"]["device"] == metrics["kv_bytes"] > 0


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("sweep.family=needles", "sweep.family 'needles' is unknown"),
        ("sweep.length=4096", "length=4096 is longer than the model's context of 2048"),
        ("options.ruler.samples=0", "options.ruler.samples=0 must be an integer >= 1"),
        ("options.ruler.chat=1", "options.ruler.chat=1 must be 'auto', true or false"),
        ("options.ruler.haystack='/no/such.txt'", "text file '/no/such.txt' does not exist"),
        ("sweep.gpu_memory=1GiB", "gpu_memory/host_memory tiers are not measured"),
        ("sweep.system=hf-fast", "unknown system 'hf-fast'"),
    ],
)
def test_bad_ruler_input_is_refused_naming_it(workspace, capsys, override, needle):
    from experiments.run import main as run_main

    root, model_dir = workspace
    config = ruler_config(root, model_dir, "bad")
    assert run_main(["--config", str(config), "--no-progress", "--set", override]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (root / "results" / "bad").exists()  # nothing recorded, nothing left behind


def test_a_ruler_task_without_its_keys_is_refused(tmp_path, capsys):
    from experiments.run import main as run_main

    path = tmp_path / "c.toml"
    path.write_text('name = "x"\n[sweep]\ntask = ["ruler"]\nlength = [1024]\n')
    assert run_main(["--config", str(path)]) == 1
    assert "task 'ruler' needs sweep.family" in capsys.readouterr().err


def _row(family, length, system, scores, depths=None, task="ruler"):
    per_sample = [
        {"index": i, "score": s, "depths": [depths[i]] if depths else []}
        for i, s in enumerate(scores)
    ]
    metrics = {
        "system": system,
        "score": sum(scores) / len(scores),
        "samples": len(scores),
        "per_sample": per_sample,
        "kv_device_bytes": 1000.0,
        "kv_host_bytes": 0.0,
        "decode_tokens_per_s": 10.0,
        "decode_s": 1.0,
        "median_step_ms": 100.0,
        "peak_kv_bytes": 2000.0,
        "load_average": 1.0,
    }
    point = {"task": task, "model": "m", "length": length, "family": family, "batch": 1}
    return {"point": {**point, "system": system}, "metrics": metrics, "seconds": 10.0}


HOST = "alisa:policy=swa,caching_ratio=0.1,retention=host"
HOST_05 = "alisa:policy=swa,caching_ratio=0.05,retention=host"
DROP = "alisa:policy=swa,caching_ratio=0.1"


def test_the_report_computes_the_targets_from_the_rows(tmp_path, capsys):
    from experiments.report import main as report_main
    from experiments.tasks.ruler.report import targets

    rows = [
        _row("niah_single", 4096, "hf-dynamic", [1, 1, 1, 1]),
        _row("niah_single", 4096, HOST, [1, 1, 1, 1]),
        _row("niah_single", 4096, HOST_05, [1, 1, 0, 0]),
        _row("niah_single", 4096, DROP, [0, 0, 0, 0]),
        _row("cwe", 4096, "hf-dynamic", [1, 1, 0.5, 0.5]),
        _row("cwe", 4096, HOST, [0.5, 0.5, 0.5, 0.5]),  # 0.67 of dense: below 0.90
        _row("fwe", 4096, "hf-dynamic", [0.3, 0.3]),  # dense below 0.5: not counted
        _row("fwe", 4096, HOST, [0.0, 0.0]),
    ]
    depths = [0.0, 0.5, 1.0]
    rows += [
        _row("niah_grid", 2048, "hf-dynamic", [1, 0, 1], depths),
        _row("niah_grid", 2048, HOST, [1, 1, 0], depths),  # misses the needle at depth 1.0
    ]
    result = targets(rows)
    assert result["host_r0.1_share_ge_0.9"] == {
        "met": False,
        "tasks": 2,
        "below": [{"family": "cwe", "length": 4096, "share": 0.667}],
    }
    assert result["host_r0.05_share_ge_0.8"]["below"] == [
        {"family": "niah_single", "length": 4096, "share": 0.5}
    ]
    grid = result["grid_host_r0.1_finds_what_dense_finds"]
    assert grid == {"met": False, "cells": 2, "missed": [{"length": 2048, "depth": 1.0}]}
    assert result["run_under_2h"] == {"met": True, "seconds": 100.0}
    partial = targets(rows, partial="3 of 4 ruler points")["run_under_2h"]
    assert partial == {"met": None, "seconds": 100.0, "partial": "3 of 4 ruler points"}
    run = tmp_path / "results" / "r" / "1"
    run.mkdir(parents=True)
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"name": "r"}))
    env = {"torch": "t", "transformers": "x", "cpu": "c", "cpu_count": 2, "threads": 2}
    (run / "env.json").write_text(json.dumps({**env, "gpu": None, "git_commit": "abc"}))
    assert report_main([str(run)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["targets"] == json.loads(json.dumps(result))
    assert summary["scores"]["m|b1|4096|cwe"] == {"dense": 0.75, "swa host r=0.1": 0.5}
    # Columns: dense, swa drop r=0.1, swa host r=0.1, swa host r=0.05 (blank: not measured).
    assert "| 4096 | cwe | 0.75 |  | 0.50 (0.67) |  |" in "\n".join(out)
    for figure in ("ruler_niah_grid.png", "ruler_vs_ratio_4096.png"):
        assert (run / figure).stat().st_size > 1000


def test_score_vs_ratio_ticks_are_the_ratios_run():
    """Over a narrow span of r (0.05-0.1) the log axis is labelled at the ratios run, plainly,
    with no minor-tick labels written over each other."""
    import matplotlib.pyplot as plt

    from experiments.tasks.ruler.report import _panel

    scores = {HOST: {"score": 1.0}, HOST_05: {"score": 0.5}, "hf-dynamic": {"score": 1.0}}
    figure, axis = plt.subplots()
    _panel(axis, scores, "niah_single")
    figure.canvas.draw()
    assert [t.get_text() for t in axis.get_xticklabels()] == ["0.05", "0.1"]
    assert all(t.get_text() == "" for t in axis.get_xticklabels(minor=True))
    plt.close(figure)


def test_cost_bytes_come_from_the_cost_rows_where_no_ruler_row_has_that_length():
    from experiments.tasks.ruler.report import cost_rows

    alone = {"point": {"task": "ruler_cost", "model": "m", "length": 8192, "batch": 1}}
    alone["metrics"] = {
        "system": HOST,
        "decode_tokens_per_s": 9.0,
        "kv_tier_bytes": {"device": 300, "host": 700},
    }
    rows = [_row("niah_single", 4096, HOST, [1]), alone]
    merged = cost_rows(rows)
    assert merged[("m", 1, 8192, HOST)]["device"] == [300]
    assert merged[("m", 1, 8192, HOST)]["host"] == [700]
    assert merged[("m", 1, 4096, HOST)]["device"] == [1000.0]  # the RULER rows' own


def test_ruler_options_are_validated():

    assert RulerOptions().samples == 10
    for field, value in (("samples", 0), ("seed", -1), ("new_tokens", 0), ("chat", "yes")):
        with pytest.raises(ValueError, match=f"options.ruler.{field}="):
            RulerOptions(**{field: value})


def test_a_setting_beyond_policy_ratio_and_bits_gets_its_own_column_and_not_the_target():
    """Host r = 0.1 with ``estimate_rest`` is another system than host r = 0.1: its own label
    (in the table, the JSON line and the figure's lines), and the targets read the default one."""
    from experiments.tasks.ruler.report import System, summary

    rest = HOST + ",estimate_rest=true"
    assert System.of(rest).label == "swa host r=0.1 estimate_rest=True"
    assert System.of(HOST).label == "swa host r=0.1"
    rows = [
        _row("niah_single", 4096, "hf-dynamic", [1, 1, 1, 1, 1]),
        _row("niah_single", 4096, rest, [1, 1, 1, 1, 1]),  # listed first: still not the target's
        _row("niah_single", 4096, HOST, [1, 1, 1, 1, 0]),
    ]
    result = summary(rows)
    assert result["scores"]["m|b1|4096|niah_single"] == {
        "dense": 1.0,
        "swa host r=0.1 estimate_rest=True": 1.0,
        "swa host r=0.1": 0.8,
    }
    assert result["targets"]["host_r0.1_share_ge_0.9"]["below"] == [
        {"family": "niah_single", "length": 4096, "share": 0.8}
    ]


def test_systems_that_sort_alike_keep_the_order_of_the_rows():
    """Columns of equal sort keys (the same r, another setting) come in the rows' order, so a
    report is the same whatever the process's string hashing."""
    from experiments.tasks.ruler.report import markdown_scores

    rest = HOST + ",estimate_rest=true"
    labels = {HOST: "swa host r=0.1", rest: "swa host r=0.1 estimate_rest=True"}
    for order in ([HOST, rest], [rest, HOST]):
        rows = [_row("cwe", 4096, system, [1]) for system in ["hf-dynamic", *order]]
        header = markdown_scores(rows).splitlines()[0]
        assert (
            header == "| length | family | dense | " + " | ".join(labels[s] for s in order) + " |"
        )


@pytest.mark.parametrize(
    ("sweep", "samples", "partial"),
    [
        # Every point of the shipped config, its samples: the time target is judged.
        (None, 10, None),
        # Fewer samples than the file asks: not the report.
        (None, 5, "5 of ruler_smollm2.toml's 10 samples a point"),
        # Two of its families (with --set): not the report either.
        (
            {"family": ["niah_single", "niah_multikey"]},
            10,
            "48 of ruler_smollm2.toml's 168 ruler points",
        ),
    ],
)
def test_the_time_target_is_judged_only_on_the_whole_report_of_a_shipped_config(
    sweep, samples, partial
):
    from experiments.data import REPO_ROOT
    from experiments.report import _partial
    from experiments.runconfig import RunConfig, load_config

    config = load_config(REPO_ROOT / "experiments" / "configs" / "ruler_smollm2.toml").as_dict()
    config["sweep"] = {**config["sweep"], **(sweep or {})}
    config["options"] = {**config["options"], "ruler": {"samples": samples}}
    rows = [{"point": point} for point in RunConfig(**config).points()]
    ruler = [row for row in rows if row["point"]["task"] == "ruler"]
    assert _partial(config, ruler) == partial
    assert _partial(config, ruler[1:]) == f"{len(ruler) - 1} of {len(ruler)} ruler points"
