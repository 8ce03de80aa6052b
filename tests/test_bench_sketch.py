"""experiments.bench_sketch: the sketch product per layer in both dtypes."""

import json

import pytest

from experiments.bench_sketch import main, parse_args


def test_main_prints_a_row_per_shape_and_the_product_this_cpu_uses(capsys):
    main(["--batches", "1,2", "--positions", "40", "--calls", "3", "--threads", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    assert line["benchmark"] == "sketch_product"
    assert line["chosen"] in ("bfloat16", "float32")
    assert [(r["batch"], r["positions"]) for r in line["rows"]] == [(1, 40), (2, 40)]
    assert all(r["bfloat16_us"] > 0 and r["float32_us"] > 0 for r in line["rows"])
    assert out[0] == f"product used on this CPU: {line['chosen']}"
    assert sum(row.startswith("| 1 × 40 |") or row.startswith("| 2 × 40 |") for row in out) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "1,x"], "--batches='1,x'"),
        (["--positions", "0"], "--positions='0'"),
        (["--calls", "0"], "--calls=0"),
        (["--head-dim", "1"], "--head-dim=1"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
