"""The twenty-first bad-input tour's findings (an independent tester's, stop 94), each a test."""

from __future__ import annotations

import pytest
from conftest import byte_tokenizer, run_main, saved_tiny_llama, tiny_llama

from alisa import stream_generate
from alisa.settings import IgnoredSettingWarning


@pytest.mark.parametrize("compile", ["auto", "off"])
def test_a_cache_length_eager_steps_never_read_is_said(compile):
    """P117: ``stream_generate(..., max_cache_len=1)`` ran eager on a CPU (``compile="auto"``
    settles eager there) and ignored the length without a word; other settings that change
    nothing warn."""
    with pytest.warns(IgnoredSettingWarning, match=r"max_cache_len=1 has no effect: the decode"):
        results = list(
            stream_generate(
                tiny_llama(),
                byte_tokenizer(),
                "hi",
                max_new_tokens=2,
                compile=compile,
                max_cache_len=1,
            )
        )
    assert [result.finish_reason for result in results] == ["length"]


def test_a_cache_length_is_checked_where_it_is_not_read():
    """A length that could never size a cache is refused whether or not the steps compile."""
    with pytest.raises(ValueError, match=r"max_cache_len=0 must be an integer >= 1"):
        next(stream_generate(tiny_llama(), byte_tokenizer(), "hi", max_cache_len=0))


def test_serve_says_a_cache_length_its_eager_steps_never_read(tmp_path, capsys, monkeypatch):
    """The server's ``--max-cache-len`` under eager steps: said at start, naming the flag."""
    from alisa.serve import AlisaServer

    monkeypatch.setattr(AlisaServer, "run", lambda self, sock: None)  # start, then stop
    folder = str(saved_tiny_llama(tmp_path / "m"))
    argv = ["serve", "--model", folder, "--port", "0", "--max-cache-len", "64"]
    code, err = run_main([*argv, "--compile", "off"], capsys)
    assert code == 0 and "Traceback" not in err
    assert "alisa serve: warning: --max-cache-len: max_cache_len=64 has no effect" in err


@pytest.mark.parametrize(("flag", "value"), [("--batch", "0"), ("--context", "-5")])
def test_profile_says_a_size_out_of_range_before_it_says_it_is_unread(flag, value, capsys):
    """D69, D70 (clean, odd): ``alisa profile --model none --batch 0`` answered only that
    ``--batch`` has no effect without a model, never that 0 is out of range."""
    code, err = run_main(["profile", "--model", "none", flag, value], capsys)
    assert code == 1 and f"{flag}={value} must be >= 1" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "said"), [("", "holds no settings"), ("[sweep]\n", "holds only sweep")]
)
def test_an_experiment_config_without_a_name_says_so(tmp_path, capsys, text, said):
    """D75 (clean, odd): an empty TOML file was refused as ``name=None must be letters, ...``,
    which does not say that the file is empty or the name missing."""
    config = tmp_path / "empty.toml"
    config.write_text(text)
    code, err = run_main(["experiment", "--config", str(config)], capsys)
    assert code == 1 and "Traceback" not in err
    assert f"{said}: it needs a name" in err


def test_the_server_engine_warns_of_a_cache_length_its_eager_steps_never_read():
    """The Python twin of ``alisa serve --max-cache-len`` (``ServeSettings``) is told too."""
    from alisa.serve import ServeSettings
    from alisa.serve.engine import ServeEngine
    from alisa.serve.metrics import ServeMetrics

    settings = ServeSettings(model_name="tiny", compile="off", max_cache_len=64)
    with pytest.warns(IgnoredSettingWarning, match=r"max_cache_len=64 has no effect"):
        ServeEngine(tiny_llama(), byte_tokenizer(), settings, ServeMetrics(settings.config, {}))
