"""experiments.kernels (one kernel per layer, each way it can run) and experiments.timing."""

import json

import pytest
import torch

from alisa.ops.backends import choose_ops
from experiments.kernels import ATTEND_WAYS, main, parse_args
from experiments.timing import median_seconds


def run(argv: list[str], capsys) -> tuple[list[str], dict]:
    """The printed lines and the JSON line of one in-process run."""
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(out[-1])


def check_recorded(line: dict) -> None:
    """Every row names the machine and the backend that ran."""
    backend = choose_ops("cpu", torch.float32, "cpu").describe()
    for row in line["rows"]:
        assert row["backend"] == backend
        assert row["machine"]["torch"] == torch.__version__
        assert row["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_sketch_prints_a_row_per_shape_and_the_product_this_cpu_uses(capsys):
    argv = ["sketch", "--batches", "1,2", "--positions", "40", "--calls", "3", "--threads", "1"]
    out, line = run(argv, capsys)
    assert line["benchmark"] == "sketch_product"
    assert line["chosen"] in ("bfloat16", "compiled")  # a CPU: never the widened product
    assert [(r["batch"], r["positions"]) for r in line["rows"]] == [(1, 40), (2, 40)]
    products = ("bfloat16_us", "float32_us", "compiled_us")
    assert all(r[p] > 0 for r in line["rows"] for p in products)
    assert out[0] == f"product used on this CPU: {line['chosen']}"
    assert sum(row.startswith(("| 1 × 40 |", "| 2 × 40 |")) for row in out) == 2
    assert (line["heads"], line["groups"], line["head_dim"], line["threads"]) == (3, 3, 64, 1)
    check_recorded(line)


def test_attend_prints_a_row_per_shape_and_every_way(capsys):
    argv = ["attend", "--batches", "1,2", "--slots", "40", "--calls", "3", "--threads", "1"]
    out, line = run([*argv, "--ring", "4"], capsys)
    assert line["benchmark"] == "slot_attention" and line["ring"] == 4
    assert [(r["batch"], r["slots"]) for r in line["rows"]] == [(1, 40), (2, 40)]
    assert all(r[f"{way}_us"] > 0 for r in line["rows"] for way in ATTEND_WAYS)
    assert sum(row.startswith(("| 1 × 40 |", "| 2 × 40 |")) for row in out) == 2
    check_recorded(line)


def test_fetch_prints_a_row_per_fetch_size(capsys):
    argv = ["fetch", "--batch", "2", "--heads", "2", "--head-dim", "8", "--positions", "64"]
    argv += ["--fetched", "4,16", "--calls", "2", "--threads", "1", "--device", "cpu"]
    out, line = run(argv, capsys)
    assert line["benchmark"] == "host_fetch" and line["device"] == "cpu" and line["gpu"] is None
    assert [(r["fetched_per_head"], r["rows"]) for r in line["rows"]] == [(4, 16), (16, 64)]
    assert all(r["torch_ms"] > 0 and r["kernel_ms"] > 0 and r["parts"] == 1 for r in line["rows"])
    assert all(r["speedup"] == pytest.approx(r["torch_ms"] / r["kernel_ms"]) for r in line["rows"])
    assert [row.split("|")[1].strip() for row in out[2:4]] == ["4", "16"]
    check_recorded(line)


def test_a_run_leaves_torch_threads_as_they_were(capsys):
    threads = torch.get_num_threads()
    argv = ["fetch", "--batch", "1", "--heads", "1", "--head-dim", "4", "--positions", "8"]
    run([*argv, "--fetched", "2", "--calls", "1", "--threads", str(threads + 1)], capsys)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required"),
        (["nope"], "invalid choice: 'nope'"),
        (["sketch", "--batches", "1,x"], "'1,x' is not a comma list of positive integers"),
        (["sketch", "--positions", "0"], "'0' is not a comma list of positive integers"),
        (["sketch", "--calls", "0"], "--calls=0 must be at least 1"),
        (["sketch", "--head-dim", "1"], "--head-dim=1 must be at least 2"),
        (["attend", "--slots", "0"], "'0' is not a comma list of positive integers"),
        (["attend", "--ring", "-1"], "--ring=-1 must be at least 0"),
        (["attend", "--groups", "0"], "--groups=0 must be at least 1"),
        (["fetch", "--fetched", "1,x"], "'1,x' is not a comma list of positive integers"),
        (["fetch", "--fetched", "0"], "'0' is not a comma list of positive integers"),
        (["fetch", "--positions", "8", "--fetched", "9"], "--fetched=[9]: each at most"),
        (["fetch", "--head-dim", "0"], "--head-dim=0 must be at least 1"),
        (["fetch", "--threads", "0"], "--threads=0 must be at least 1"),
        (["fetch", "--device", "nowhere"], "'nowhere': not a device here (cpu"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_median_seconds_warms_up_then_takes_the_median_of_the_repeats(monkeypatch):
    import alisa.calibration.steps

    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # three timed calls: 1, 3 and 2 seconds
    monkeypatch.setattr(alisa.calibration.steps, "device_clock", lambda device: next(ticks))
    calls = []
    assert median_seconds(lambda: calls.append(1), repeats=3, warm_up=2) == 2.0
    assert len(calls) == 5  # two warm-up calls, untimed, then the three


def test_median_seconds_reads_the_clock_of_the_device_it_is_given(monkeypatch):
    import alisa.calibration.steps

    seen = []
    monkeypatch.setattr(alisa.calibration.steps, "device_clock", lambda d: seen.append(d) or 0.0)
    median_seconds(lambda: None, repeats=2, warm_up=0, device="cpu")
    assert seen == [torch.device("cpu")] * 4  # drained before and after each timed call


@pytest.mark.parametrize(
    "kwargs, message",
    [({"repeats": 0}, "repeats=0 must be at least 1"), ({"repeats": 1, "warm_up": -1}, "warm_up")],
)
def test_median_seconds_refuses_impossible_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        median_seconds(lambda: None, **kwargs)


def test_products_times_each_form_over_a_shapes_weights(capsys):
    argv = ["products", "--layers", "1", "--batches", "1,9", "--calls", "1", "--threads", "1"]
    out, line = run(argv, capsys)
    assert line["benchmark"] == "weight_products"
    assert (line["model"], line["layers"], line["matrices"]) == ("smollm2-135m", 1, 8)
    assert [r["batch"] for r in line["rows"]] == [1, 9]
    ways = ("linear_ms", "blas_transposed_ms", "row_kernel_ms", "gb_per_s_row_kernel")
    assert all(r[way] > 0 for r in line["rows"] for way in ways)
    assert out[0].startswith("8 float32 matrices of smollm2-135m")
    check_recorded(line)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["products", "--model", "gpt-5"], "is not a known shape"),
        (["products", "--layers", "0"], "--layers=0 must be at least 1"),
    ],
)
def test_products_refuses_an_unknown_shape_and_no_layers(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
