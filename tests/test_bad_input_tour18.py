"""The eighteenth bad-input tour's silent findings (an independent tester's tour 92: S1, S2),
each a test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa import AlisaConfig
from alisa.jobs.stream import stream_generate

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", [1.5, 2.0])
def test_stream_generate_refuses_a_row_count_that_is_not_an_integer(value):
    """S1: ``max_rows=1.5`` was accepted; ``prefill_rows=2.5`` and ``BatchJob(max_batch=1.5)``
    were refused."""
    with pytest.raises(ValueError, match=rf"max_rows={value} must be an integer >= 1"):
        next(stream_generate(tiny_llama(), byte_tokenizer(), "hi", max_rows=value))


def test_estimate_rest_false_without_host_retention_is_refused_as_true_is():
    """S2: ``estimate_rest=False`` (``--no-estimate-rest``) with ``retention='drop'`` changed
    nothing, unsaid; ``True`` was refused."""
    for value in (True, False):
        with pytest.raises(ValueError, match=rf"estimate_rest={value} needs retention='host'"):
            AlisaConfig(policy="swa", caching_ratio=0.5, estimate_rest=value)
    AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", estimate_rest=False)


def test_plan_past_the_context_says_its_defaults_and_what_fits():
    """U1: ``alisa plan`` on a model of context under 640 failed on its own defaults (512 +
    128) without saying they were defaults or what to pass."""
    from types import SimpleNamespace

    from alisa.commands.options import CommandError
    from alisa.commands.plan import _check_context

    spec = SimpleNamespace(context_tokens=256, name="gpt2")
    with pytest.raises(CommandError) as caught:
        _check_context(spec, 512, 128)
    text = str(caught.value)
    assert "(unset, they are 512 and 128), e.g. --prompt-len 192 --gen-len 64" in text
    _check_context(spec, 192, 64)


def test_a_second_ctrl_c_while_a_command_stops_prints_no_traceback(tmp_path):
    """T1: a second Ctrl-C while ``alisa batch`` stopped (in its ``finally`` blocks, or in the
    exit's own clean-up) raised out of them with a ``KeyboardInterrupt`` traceback. The first
    Ctrl-C stops the command; later ones are noted once, and the clean-up runs to its end."""
    script = tmp_path / "impatient.py"
    script.write_text(
        "import atexit, signal, sys\n"
        "from alisa import cli\n"
        "from alisa.commands import COMMANDS\n"
        "done = []\n"
        "def run(args):\n"
        "    try:\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "    finally:\n"
        "        signal.raise_signal(signal.SIGINT)  # the impatient second, mid clean-up\n"
        "        signal.raise_signal(signal.SIGTERM)\n"
        "        done.append('closed')\n"
        "    return 0\n"
        "COMMANDS['plan'] = (*COMMANDS['plan'][:2], run)\n"
        "atexit.register(lambda: signal.raise_signal(signal.SIGINT))  # one more at the exit\n"
        "code = cli.main(['plan'])\n"
        "print(done, code)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip() == "['closed'] 130"
    assert result.stderr.count("stopping already") == 1, result.stderr
    assert "alisa plan: interrupted" in result.stderr


def test_a_sliding_only_model_names_the_budget_setting_given():
    """U2: on a model of sliding layers only, the warning said ``caching_ratio=1 has no effect``
    where ``budget_tokens=5`` was the setting given; it names the one given."""
    from alisa.settings import no_evicting_layer_note

    windows = [16, 16]
    by_tokens = AlisaConfig(policy="swa", budget_tokens=5)
    assert "so budget_tokens=5 has no effect" in no_evicting_layer_note(by_tokens, windows)
    by_ratio = AlisaConfig(policy="swa", caching_ratio=0.1)
    assert "so caching_ratio=0.1 has no effect" in no_evicting_layer_note(by_ratio, windows)
