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
        (["generate", "hi", "--threads", "0"], "--threads=0"),
        (["batch", "in.jsonl", "-o", "out.jsonl", "--threads", "-2"], "--threads=-2"),
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


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["generate", "--help"],
        ["batch", "--help"],
        ["genrate"],
        ["generate", "--top-k", "x"],
    ],
)
def test_help_and_usage_errors_import_neither_torch_nor_transformers(args):
    """``alisa --help`` and argument errors answer at once: the heavy libraries load only when a
    command runs (their import alone takes seconds on a busy machine)."""
    probe = (
        "import sys\nfrom alisa.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "print('HEAVY', heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert "HEAVY []" in result.stdout, result.stdout[-500:] + result.stderr[-500:]


def test_public_names_load_on_first_use():
    import alisa

    assert set(alisa.__all__) >= {"AlisaConfig", "generate", "load_model", "run_batch"}
    assert alisa.AlisaConfig(policy="swa", caching_ratio=0.5).caching_ratio == 0.5
    with pytest.raises(AttributeError, match="no_such_name"):
        alisa.no_such_name  # noqa: B018


def test_every_config_field_has_one_help_group():
    from dataclasses import fields

    from alisa import AlisaConfig
    from alisa.commands.options import CACHE_GROUPS

    grouped = [name for names in CACHE_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in fields(AlisaConfig) if f.init)


def test_generate_help_starts_with_the_common_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: alisa generate [options] [prompt]")
    assert text.index("--max-new-tokens") < text.index("--do-sample") < text.index("--policy")
    assert text.index("--policy") < text.index("--kv-bits") < text.index("--gpu-memory")


def test_stats_line_explains_kv_above_dense():
    from conftest import tiny_llama

    from alisa import AlisaConfig
    from alisa.commands.generate import spare_note
    from alisa.runtime.engine import GenerationOutput

    def output(kv_bytes: int) -> GenerationOutput:
        ids = [[5] * 6]
        return GenerationOutput(
            texts=["x"],
            token_ids=ids,
            prompt_tokens=[10],
            finish_reasons=["length"],
            ttft_s=0.1,
            kv_bytes=kv_bytes,
        )

    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.2, kv_bits=8)
    # tiny_llama: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes = 512 bytes per token
    assert spare_note(output(16 * 512), model, config) == ""
    note = spare_note(output(16 * 512 + 1), model, config)
    assert "these 16 tokens" in note and "--max-new-tokens" in note and "INT8" in note
