"""experiments.bench_sketch: the sketch product per layer, each way it can run."""

import json

import pytest

from experiments.bench_sketch import main, parse_args


def test_main_prints_a_row_per_shape_and_the_product_this_cpu_uses(capsys):
    main(["--batches", "1,2", "--positions", "40", "--calls", "3", "--threads", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    assert line["benchmark"] == "sketch_product"
    assert line["chosen"] in ("bfloat16", "compiled")  # a CPU: never the widened product
    assert [(r["batch"], r["positions"]) for r in line["rows"]] == [(1, 40), (2, 40)]
    products = ("bfloat16_us", "float32_us", "compiled_us")
    assert all(r[p] > 0 for r in line["rows"] for p in products)
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
