"""The CLI's error contract: one line naming the problem, exit code != 0, no traceback."""

import subprocess
import sys

import pytest

from alisa.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "hi", "--model", "no/such/model/here"], "model='no/such/model/here'"),
        (["generate", "hi", "--model", "nobody/no-such-model"], "nobody/no-such-model"),
        (["generate", "hi", "--dtype", "float64"], "dtype='float64'"),
        (["generate", "hi", "--max-new-tokens", "-3"], "--max-new-tokens=-3"),
        (["generate", "   "], "prompt is empty"),
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt"),
        (["generate", "hi", "--policy", "magic"], "policy='magic'"),
        (["generate", "hi", "--caching-ratio", "1.5"], "caching_ratio=1.5"),
    ],
)
def test_bad_input_is_one_line_without_traceback(capsys, args, needle):
    code, out, err = run_cli(capsys, *args)
    assert code != 0
    assert needle in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_empty_prompt_file_is_rejected(capsys, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n")
    code, _, err = run_cli(capsys, "generate", "--prompt-file", str(path))
    assert code != 0 and "prompt is empty" in err


def test_undecodable_prompt_file_is_rejected(capsys, tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00\x80")
    code, _, err = run_cli(capsys, "generate", "--prompt-file", str(path))
    assert code != 0 and "binary.txt" in err and "Traceback" not in err


@pytest.mark.slow
def test_generate_prints_completion_and_stats_line(smollm2):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "alisa",
            "generate",
            "The capital of France is",
            "--max-new-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    stats = [line for line in result.stderr.splitlines() if line.startswith("[alisa]")]
    assert len(stats) == 1
    for field in ("ttft", "tok/s", "kv held"):
        assert field in stats[0]


@pytest.mark.slow
def test_prompt_from_stdin(smollm2):
    result = subprocess.run(
        [sys.executable, "-m", "alisa", "generate", "--max-new-tokens", "4"],
        input="The capital of France is",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
