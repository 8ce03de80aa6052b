"""experiments.bench_attend: one layer's decode attention, PyTorch's path against the kernels."""

import json

import pytest

from experiments.bench_attend import WAYS, main, parse_args


def test_main_prints_a_row_per_shape_and_every_way(capsys):
    main(["--batches", "1,2", "--slots", "40", "--calls", "3", "--threads", "1", "--ring", "4"])
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    assert line["benchmark"] == "slot_attention"
    assert [(r["batch"], r["slots"]) for r in line["rows"]] == [(1, 40), (2, 40)]
    assert all(r[f"{way}_us"] > 0 for r in line["rows"] for way in WAYS)
    assert sum(row.startswith(("| 1 × 40 |", "| 2 × 40 |")) for row in out) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "1,x"], "'1,x': comma-separated integers"),
        (["--slots", "0"], "'0': every value must be at least 1"),
        (["--calls", "0"], "--calls=0"),
        (["--ring", "-1"], "--ring=-1"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
