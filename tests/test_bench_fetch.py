"""experiments.bench_fetch: host retention's gather of fetched rows, each way it can run."""

import json

import pytest

from experiments.bench_fetch import main, parse_args


def test_main_prints_a_row_per_fetch_size(capsys):
    argv = ["--batch", "2", "--heads", "2", "--head-dim", "8", "--positions", "64"]
    main([*argv, "--fetched", "4,16", "--calls", "2", "--threads", "1", "--device", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    assert line["benchmark"] == "host_fetch" and line["device"] == "cpu"
    assert [(r["fetched_per_head"], r["rows"]) for r in line["rows"]] == [(4, 16), (16, 64)]
    assert all(r["torch_ms"] > 0 and r["kernel_ms"] > 0 and r["parts"] == 1 for r in line["rows"])
    assert [row.split("|")[1].strip() for row in out[2:4]] == ["4", "16"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fetched", "1,x"], "--fetched='1,x'"),
        (["--fetched", "0"], "--fetched=[0]"),
        (["--positions", "8", "--fetched", "9"], "--fetched=[9]"),
        (["--head-dim", "0"], "--head-dim=0"),
        (["--calls", "0"], "--calls=0"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
