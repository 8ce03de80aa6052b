"""experiments.bench_continuous: transformers' paged run under a KV budget, timelines, systems,
the stops of this process left out, bad flags refused."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama
from test_continuous import prompts, requests

from alisa import AlisaCache, AlisaConfig
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import Engine
from alisa.runtime.requests import RowLimit, StepRecord
from experiments import bench_continuous
from experiments.bench_continuous import block_bytes, counting_offloads, run_paged, systems
from experiments.timeline import PauseWatch, Timeline

REPO = Path(__file__).parent.parent
LENGTHS = (23, 6, 41, 12, 30)
NEW_TOKENS = (9, 14, 4, 11, 6)


def test_transformers_paged_run_gives_alisa_r1_tokens_within_the_budget():
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    ids = prompts(LENGTHS)
    # Room for about two of these rows at a time: transformers must wait or preempt.
    budget = 6 * block_bytes(model.config, model.dtype, page_size=16)
    paged = run_paged(model, ids, list(NEW_TOKENS), kv_bytes=budget, eos_ids=[-1], max_rows=3)
    assert paged.errors == [] and paged.kv_bytes <= budget
    assert [len(tokens) for tokens in paged.tokens] == list(NEW_TOKENS)
    # A request transformers soft-reset keeps only the token times after its reset.
    pairs = zip(paged.token_times, NEW_TOKENS, strict=True)
    assert all(0 < len(times) <= count for times, count in pairs)
    alisa_model = tiny_llama()
    engine = Engine(alisa_model, byte_tokenizer(), stop_at_eos=False)
    scheduler = ContinuousScheduler(
        engine, lambda: AlisaCache(alisa_model, AlisaConfig()), RowLimit(3)
    )
    ours = {r.id: r.token_ids for r in scheduler.run(requests(ids, NEW_TOKENS))}
    assert paged.tokens == [ours[index] for index in range(len(ids))]


def test_a_budget_below_one_block_is_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match="holds no block"):
        run_paged(model, [[3, 4]], [2], kv_bytes=10, eos_ids=[-1])


def test_timelines_count_rows_over_time():
    timeline = Timeline(10.0)
    for time_s, rows in ((11.0, 2), (12.0, 4), (14.0, 1)):
        timeline.add(StepRecord(time_s=time_s, rows=rows, tokens=rows))
    assert timeline.max_rows() == 4
    # 2 rows for 1 s, 4 for 1 s, 1 for 2 s, over 4 s.
    assert timeline.mean_rows() == pytest.approx((2 + 4 + 2) / 4)
    ends, rows, rate = timeline.series(width_s=2.0)
    assert ends.tolist() == [2.0, 4.0, 6.0] and rows.tolist() == [2, 4, 1]
    assert rate.tolist() == [1.0, 2.0, 0.5]
    # Token times of two requests, overlapping from 1.0 to 2.0.
    spans = Timeline.from_tokens(0.0, [[0.5, 1.0, 2.0], [1.0, 1.5, 2.0, 3.0]])
    assert spans.max_rows() == 2 and sum(spans.tokens) == 7
    assert spans.rows == [1, 2, 2, 2, 2, 2, 1]


def test_systems_are_named_or_refused():
    chosen = systems("static-drop,hf")
    assert [s.name for s in chosen] == ["static-drop", "hf"]
    assert chosen[0].static and chosen[0].config.caching_ratio == 0.2 and chosen[1].config is None
    assert len(systems("all")) == 11
    separate = systems("continuous-host-separate")[0]
    assert not separate.mixed and not separate.static and separate.config.retention == "host"
    reserve = systems("continuous-host-reserve")[0]
    assert reserve.reserve and reserve.mixed and reserve.config.retention == "host"
    dense = systems("continuous-dense")[0]
    assert dense.config == AlisaConfig() and not (dense.reserve or dense.static)
    compiled, eager = systems("static-drop-compiled,static-drop")
    assert compiled.static and compiled.compiled and not eager.compiled
    assert compiled.config == eager.config
    assert "static-drop-compiled" not in {s.name for s in systems("all")}  # named only
    with pytest.raises(ValueError, match="--systems nope unknown; valid: static-drop"):
        systems("nope")


def test_offloads_are_counted_and_not_printed(capsys):
    logger = logging.getLogger("ContinuousBatchingLogger")
    level = logger.level
    with counting_offloads() as counts:
        logger.info("Offloaded 2 requests (0 to CPU, 2 soft reset): 1 starved requests remain.")
        logger.info("Offloaded 1 requests (1 to CPU, 0 soft reset): 0 starved requests remain.")
        logger.info("Scheduled 3 requests")
    assert counts == [2, 1] and logger.level == level
    assert "Offloaded" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--prompts", "0"], "bench_continuous: error: --prompts=0 must be >= 1"),
        (["--repeats", "0"], "bench_continuous: error: --repeats=0 must be >= 1"),
        (["--kv-budget", "0"], "bench_continuous: error: --kv-budget='0' must be a byte size > 0"),
        (["--systems", "hf", "--plot-systems", "static-drop"], "--plot-systems static-drop: not"),
        (["--plot-systems", "nope"], "--plot-systems nope unknown; valid: static-drop"),
    ],
)
def test_bad_flags_are_refused_before_any_work(flags, needle, capsys):
    assert bench_continuous.main(flags) == 1
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == "" and "Traceback" not in captured.err


def test_bad_token_counts_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_continuous.main(["--new-tokens", "16,0"])
    assert exited.value.code == 2
    assert "'16,0' is not a comma list of positive integers" in capsys.readouterr().err


def test_pause_watch_leaves_out_the_seconds_a_process_was_stopped():
    watch = PauseWatch()
    watch.gaps = [(2.0, 5.0), (9.0, 10.0)]
    assert watch.paused(0.0, 20.0) == 4.0 and watch.active(0.0, 20.0) == 16.0
    assert watch.paused(3.0, 9.5) == 2.5  # parts of both gaps
    assert watch.paused(5.0, 9.0) == 0.0


STOPPED = """
import time
from experiments.timeline import PauseWatch
with PauseWatch() as watch:
    print("ready", flush=True)
    time.sleep(3.0)
print(len(watch.gaps), round(sum(b - a for a, b in watch.gaps), 1))
"""


def test_pause_watch_sees_a_sigstop():
    process = subprocess.Popen(
        [sys.executable, "-c", STOPPED], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(1.5)
    os.kill(process.pid, signal.SIGCONT)
    count, seconds = process.communicate(timeout=60)[0].split()
    assert int(count) == 1 and float(seconds) >= 1.0
