"""`alisa batch` and the experiment runner under torchrun: 2 gloo ranks on CPU.

Each test starts real processes (torchrun and two ranks), so there are few of them: a kill -9
of one rank mid-job and a re-run, 2 ranks against 1 process on greedy fp32, a sweep spread
over ranks (in tests/test_experiments.py).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa.cli import main
from alisa.jobs.parts import parts_dir, share

TESTS = Path(__file__).parent
REPO = TESTS.parent

# A rank that records its pid and, with a delay, runs each forward pass slowly (the kill
# test's window; static batches and continuous batching alike).
RANK_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from alisa.runtime.engine import Engine
real = Engine.step
def slow(*args, **kwargs):
    time.sleep({delay})
    return real(*args, **kwargs)
Engine.step = slow
with open(os.path.join({pids!r}, "rank-" + os.environ["RANK"]), "w") as handle:
    handle.write(str(os.getpid()))
from alisa.cli import main
sys.exit(main(sys.argv[1:]))
"""


def torchrun(script: Path, args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def write_prompts(path: Path, count: int) -> list[str]:
    ids = [f"p{index}" for index in range(count)]
    rows = [{"id": i, "prompt": "word " * (3 + n % 7) + str(n)} for n, i in enumerate(ids)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ids


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def batch_args(source: Path, target: Path, model_dir: Path) -> list[str]:
    return ["batch", str(source), "-o", str(target), "--model", str(model_dir)]


def test_kill_9_of_one_rank_ends_the_job_and_a_rerun_finishes_each_id_once(tmp_path, model_dir):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_prompts(source, 24)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(TESTS), delay=0.1, pids=str(tmp_path)))
    flags = ["--dtype", "float32", "--max-new-tokens", "3", "--no-progress"]
    process = torchrun(script, batch_args(source, target, model_dir) + flags + ["--max-batch", "1"])
    parts = [parts_dir(target) / f"rank-{rank}.jsonl" for rank in (0, 1)]
    deadline = time.time() + 120
    while time.time() < deadline and sum(len(lines_of(p)) for p in parts) < 4:
        time.sleep(0.05)
    os.kill(int((tmp_path / "rank-1").read_text()), signal.SIGKILL)
    killed = time.time()
    _, err = process.communicate(timeout=90)
    assert time.time() - killed < 60, "the surviving rank did not stop in time"
    assert process.returncode != 0
    assert "re-run the same command" in err  # rank 0 says why it stopped, in one line
    written = [line for part in parts for line in lines_of(part)]
    assert 4 <= len(written) < len(ids)
    # The same command again, here with one process (another world size): only missing ids run.
    assert main(batch_args(source, target, model_dir) + flags) == 0
    final = lines_of(target)
    rows = [json.loads(line) for line in final]  # every line is valid JSON
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every id exactly once
    assert set(written) <= set(final)  # nothing written before the kill was lost or redone
    assert not parts_dir(target).exists()


def test_two_ranks_write_the_texts_of_one_process(tmp_path, model_dir):
    source = tmp_path / "in.jsonl"
    ids = write_prompts(source, 16)
    assert all(share(ids, 2, rank, key=str) for rank in (0, 1))  # both ranks get work
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(TESTS), delay=0, pids=str(tmp_path)))
    # One prompt per batch in both runs: the same shapes, so fp32 greedy tokens are identical.
    flags = ["--dtype", "float32", "--max-new-tokens", "6", "--max-batch", "1", "--no-progress"]
    ranked, single = tmp_path / "ranked.jsonl", tmp_path / "single.jsonl"
    process = torchrun(script, batch_args(source, ranked, model_dir) + flags)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert err.count("[alisa batch]") == 1  # one report, from rank 0
    assert main(batch_args(source, single, model_dir) + flags) == 0
    texts = {}
    for path in (ranked, single):
        rows = [json.loads(line) for line in lines_of(path)]
        assert sorted(r["id"] for r in rows) == sorted(ids)
        texts[path.name] = {r["id"]: r["text"] for r in rows}
    assert texts["ranked.jsonl"] == texts["single.jsonl"]
    assert not parts_dir(ranked).exists()


def _finish_early_or_wait(rank, world, port, how, queue):
    from alisa.jobs.distributed import RankError, RankProgress, process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    with process_group(timeout_s=3) as ranks:
        progress = RankProgress(ranks, f"test-{how}", 4, False, "test")
        progress.update(1)
        if rank == 1:
            if how == "dies":
                os._exit(0)  # gone without a word: no launcher's SIGTERM reaches rank 0
            time.sleep(8)  # alive but doing nothing (past the 3 s): only the heartbeat tells
            os._exit(0)
        started = time.time()
        try:
            progress.wait_for_all(every_s=0.05)
        except RankError as error:
            queue.put((str(error), time.time() - started))
        queue.close()
        queue.join_thread()  # delivered before the hard exit below
        os._exit(0)  # do not wait for the silent rank at teardown


@pytest.mark.parametrize(
    ("how", "needle", "within"),
    [("dies", "another rank stopped", 2.5), ("hangs", "rank 1 did no work for 3 s", 10)],
)
def test_a_rank_waiting_for_a_dead_or_silent_peer_fails_with_a_clear_error(how, needle, within):
    import torch.multiprocessing as mp

    from alisa.parallel.dist import free_port

    queue = mp.get_context("spawn").Queue()
    mp.spawn(_finish_early_or_wait, args=(2, free_port(), how, queue), nprocs=2, join=True)
    message, seconds = queue.get(timeout=5)
    assert needle in message and "re-run the same command" in message
    assert seconds < within  # a dead peer at once; a silent one after --rank-timeout


def test_share_deals_every_item_once_balanced_and_the_same_everywhere():
    items = [{"id": i, "prompt": "x" * (i * 37 % 101)} for i in range(23)]
    for world in (1, 2, 3, 5):
        shares = [
            share(items, world, rank, key=lambda r: r["id"], cost=lambda r: len(r["prompt"]))
            for rank in range(world)
        ]
        ids = sorted(r["id"] for part in shares for r in part)
        assert ids == list(range(23))  # every item exactly once
        counts = [len(part) for part in shares]
        assert max(counts) - min(counts) <= 1
        costs = [sum(len(r["prompt"]) for r in part) for part in shares]
        assert max(costs) - min(costs) <= 101  # within the largest single item
        again = share(list(reversed(items)), world, 0, key=lambda r: r["id"])
        assert again == share(items, world, 0, key=lambda r: r["id"])  # input order is irrelevant
