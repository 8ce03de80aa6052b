"""The placement LP: brute force agreement, recompute pricing, capacities, bad input."""

import itertools
import json
import re
from dataclasses import replace

import pytest

from scheduler import (
    CostModel,
    HardwareProfile,
    ModelSpec,
    Options,
    Workload,
    evaluate,
    load_profile,
    make_buckets,
    model_preset,
    preset,
    solve,
)
from scheduler.workload import FETCH_GROWTH, fetch_growth

GIB = 1024**3

TINY_MHA = ModelSpec(
    name="tiny-mha",
    num_layers=16,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=1000,
)
TINY_GQA = ModelSpec(
    name="tiny-gqa",
    num_layers=16,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=1000,
)


def machine(device_bytes, host_bytes=64 * GIB, link=1e9, flops=1e12, overlap=True):
    return HardwareProfile(
        name="test",
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        h2d_bytes_per_s=link,
        d2h_bytes_per_s=link,
        device_flops=flops,
        device_bytes_per_s=100e9,
        overlap=overlap,
    )


def kv_total(model, workload):
    return workload.kept_tokens(workload.gen_len - 1) * model.kv_bytes_per_token(workload.kv_bits)


@pytest.mark.parametrize("overlap", [True, False])
def test_lp_matches_brute_force_on_a_tiny_case(overlap):
    workload = Workload(batch=8, prompt_len=512, gen_len=32, recent_fraction=0.25)
    weights = TINY_MHA.total_weight_bytes
    hardware = machine(weights + 0.6 * kv_total(TINY_MHA, workload), link=2e9, overlap=overlap)
    options = Options(buckets=1, allow_weight_offload=False)
    plan = solve(hardware, TINY_MHA, workload, options)
    best = None
    grid = [i / 100 for i in range(101)]
    for g, c in itertools.product(grid, grid):
        x = 1 - g - c
        if g < 0.25 or x < -1e-9:
            continue
        candidate = evaluate(
            hardware, TINY_MHA, workload, {"g": g, "c": c, "x": max(0.0, x), "w": 0.0}, buckets=1
        )
        if candidate.peak_device_bytes <= hardware.device_bytes and (
            best is None or candidate.decode_s < best.decode_s
        ):
            best = candidate
    assert plan.decode_s <= best.decode_s * (1 + 1e-6)
    assert plan.decode_s >= best.decode_s * 0.98  # the grid is 1/100 coarse


def test_everything_stays_on_device_when_it_fits():
    workload = Workload(batch=4, prompt_len=256, gen_len=64)
    plan = solve(machine(16 * GIB), TINY_MHA, workload)
    assert plan.p1 is None and plan.p2 is None
    assert all(b.device_fraction == 1.0 for b in plan.buckets)


def test_phases_switch_as_the_cache_grows():
    workload = Workload(batch=16, prompt_len=1024, gen_len=2048, recent_fraction=0.1)
    weights = TINY_MHA.total_weight_bytes
    first = workload.kept_tokens(0) * TINY_MHA.kv_bytes_per_token()
    plan = solve(machine(weights + 1.5 * first, link=1e9, flops=1e10), TINY_MHA, workload)
    assert plan.p1 is not None or plan.p2 is not None
    assert plan.buckets[0].device_fraction == pytest.approx(1.0, abs=1e-6)
    assert plan.buckets[-1].device_fraction < 1.0
    assert plan.peak_device_bytes <= (1.5 * first + weights) * (1 + 1e-6)  # solver tolerance


def test_recompute_is_chosen_for_mha_when_the_link_is_slow():
    workload = Workload(batch=16, prompt_len=2048, gen_len=64, recent_fraction=0.1)
    hardware = machine(
        TINY_MHA.total_weight_bytes + 0.3 * kv_total(TINY_MHA, workload), link=1e8, flops=1e13
    )
    plan = solve(hardware, TINY_MHA, workload)
    # MHA: an attention input (hidden) is half a token's K+V, and recomputing it is cheap here.
    assert max(b.recompute_fraction for b in plan.buckets) > 0.2
    no_recompute = solve(hardware, TINY_MHA, workload, Options(allow_recompute=False))
    assert plan.decode_s < no_recompute.decode_s


def test_recompute_is_not_chosen_when_hidden_states_are_bigger_than_kv():
    workload = Workload(batch=16, prompt_len=2048, gen_len=64, recent_fraction=0.1)
    # GQA: the hidden state (576 values) is bigger than K+V (128), so recompute moves more bytes.
    hardware = machine(
        TINY_GQA.total_weight_bytes + 0.3 * kv_total(TINY_GQA, workload), link=1e8, flops=1e13
    )
    plan = solve(hardware, TINY_GQA, workload)
    assert all(b.recompute_fraction < 1e-6 for b in plan.buckets)
    assert max(b.host_fraction for b in plan.buckets) > 0


def test_sparsity_and_int8_shrink_the_kv_the_plan_moves():
    hardware = preset("v100-32gb")
    model = model_preset("opt-13b")
    dense = solve(hardware, model, Workload(batch=64, prompt_len=128, gen_len=512))
    sparse = solve(
        hardware,
        model,
        Workload(batch=64, prompt_len=128, gen_len=512, caching_ratio=0.2, kv_bits=8),
    )
    assert sparse.tokens_per_s > dense.tokens_per_s
    assert sparse.simulated and "SIMULATION" in sparse.describe()


def test_device_shortfall_is_named_in_bytes():
    workload = Workload(batch=4, prompt_len=256, gen_len=16)
    with pytest.raises(ValueError, match=r"short by \d+ bytes"):
        solve(
            machine(TINY_MHA.total_weight_bytes // 2),
            TINY_MHA,
            workload,
            Options(allow_weight_offload=False),
        )


def test_host_shortfall_is_named_in_bytes():
    workload = Workload(batch=16, prompt_len=4096, gen_len=16, recent_fraction=0.1)
    hardware = machine(
        TINY_MHA.total_weight_bytes + kv_total(TINY_MHA, workload) // 3, host_bytes=1000
    )
    with pytest.raises(ValueError, match=r"host_bytes=1000 is too small: .* short by \d+ bytes"):
        solve(hardware, TINY_MHA, workload)


def test_static_split_is_one_placement_for_all_buckets():
    workload = Workload(batch=16, prompt_len=1024, gen_len=512, recent_fraction=0.1)
    hardware = machine(TINY_MHA.total_weight_bytes + 0.5 * kv_total(TINY_MHA, workload))
    plan = solve(hardware, TINY_MHA, workload, Options(static=True))
    assert len({(b.device_fraction, b.host_fraction) for b in plan.buckets}) == 1
    assert solve(hardware, TINY_MHA, workload).decode_s <= plan.decode_s + 1e-9


def test_profiles_round_trip_and_bad_files_are_reported(tmp_path):
    path = tmp_path / "p.json"
    preset("a100-40gb").save(path)
    assert load_profile(path) == preset("a100-40gb")
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(path)
    path.write_text(json.dumps({"name": "x", "bogus": 1}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_profile(path)


def test_unknown_presets_list_the_known_ones():
    with pytest.raises(ValueError, match="a100-40gb"):
        preset("tpu-v9")
    with pytest.raises(ValueError, match="opt-13b"):
        model_preset("gpt-5")


@pytest.mark.parametrize(
    ("field", "value"), [("batch", 0), ("gen_len", -1), ("caching_ratio", 0.0), ("kv_bits", 3)]
)
def test_bad_workloads_name_the_field(field, value):
    options = {"batch": 1, "prompt_len": 8, "gen_len": 8, field: value}
    with pytest.raises(ValueError, match=field):
        Workload(**options)


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_the_reselect_interval_is_a_positive_integer(value):
    with pytest.raises(ValueError, match=re.escape(f"reselect_every={value!r}")):
        Workload(batch=1, prompt_len=8, gen_len=8, retention="host", reselect_every=value)


def test_bad_hardware_names_the_field():
    with pytest.raises(ValueError, match="h2d_bytes_per_s"):
        HardwareProfile(
            name="x",
            device_bytes=1,
            host_bytes=1,
            h2d_bytes_per_s=0,
            d2h_bytes_per_s=1,
            device_flops=1,
            device_bytes_per_s=1,
        )


def test_host_retention_counts_fetches_the_sketch_and_the_host_region():
    """retention="host": the plan holds every token on the host, a key sketch of every token on
    the device, and pays for fetching fetch_share of the budget each step."""
    options = {"batch": 4, "prompt_len": 1000, "gen_len": 8, "caching_ratio": 0.2}
    drop = solve(machine(16 * GIB), TINY_MHA, Workload(**options))
    host_workload = Workload(**options, retention="host", host_bits=8, fetch_share=0.25)
    host = solve(machine(16 * GIB), TINY_MHA, host_workload)
    seen = 4 * (1000 + 7)  # the last bucket's largest step
    assert host.peak_host_bytes == pytest.approx(seen * TINY_MHA.kv_bytes_per_token(8))
    sketch = seen * TINY_MHA.sketch_bytes_per_token()
    assert host.peak_device_bytes == pytest.approx(drop.peak_device_bytes + sketch)
    kept = 4 * round(1007 * 0.2)
    assert host.fetch_bytes_per_step == pytest.approx(0.25 * kept * TINY_MHA.kv_bytes_per_token(8))
    assert host.decode_s > drop.decode_s  # fetches and scoring are not free
    assert drop.fetch_bytes_per_step == 0
    with pytest.raises(ValueError, match="retention='disk'"):
        Workload(**options, retention="disk")


def test_host_retention_selection_uses_the_calibrated_rate_when_the_profile_has_it():
    """A profile with select_bytes_per_s / select_overhead_s costs the selection with them;
    one without (presets, older profiles) reads the sketch at the KV read rate as before."""
    workload = Workload(batch=4, prompt_len=1000, gen_len=1, caching_ratio=0.2, retention="host")
    seen = 4 * 1000
    sketch = seen * TINY_MHA.sketch_bytes_per_token()
    bucket = make_buckets(workload, 1)[0]
    formula = CostModel(machine(16 * GIB), TINY_MHA, workload).retention_terms(bucket)
    assert formula["scoring_s"] == pytest.approx(sketch / 100e9)
    calibrated = replace(
        machine(16 * GIB, overlap=False), select_bytes_per_s=2e9, select_overhead_s=0.003
    )
    cost = CostModel(calibrated, TINY_MHA, workload)
    terms = cost.retention_terms(bucket)
    assert terms["scoring_s"] == pytest.approx(0.003 + sketch / 2e9)
    assert terms["fetch_bytes"] == formula["fetch_bytes"]  # fetches stay over the host link
    drop = CostModel(calibrated, TINY_MHA, replace(workload, retention="drop"))
    # Without overlapping copies (a CPU) the selection and the fetch add to the step.
    assert cost.step_time(bucket, {"g": 1.0}) - drop.step_time(bucket, {"g": 1.0}) == (
        pytest.approx(terms["scoring_s"] + terms["fetch_bytes"] / 1e9)
    )


def test_host_selection_and_fetch_are_spread_over_the_reselect_interval():
    """A selection every s steps: its time per step is 1/s of a selection's; its fetch per step
    is 1/s of one that moves fetch_growth(s) times the every-step tokens; the steps between
    attend to (s - 1) / 2 tokens per sequence beyond the budget on average."""
    workload = Workload(batch=4, prompt_len=1000, gen_len=1, caching_ratio=0.2, retention="host")
    profile = replace(
        machine(16 * GIB, overlap=False), select_bytes_per_s=2e9, select_overhead_s=0.003
    )
    bucket = make_buckets(workload, 1)[0]
    every_step = CostModel(profile, TINY_MHA, workload)
    every_four = CostModel(profile, TINY_MHA, replace(workload, reselect_every=4))
    one, four = every_step.retention_terms(bucket), every_four.retention_terms(bucket)
    assert four["scoring_s"] == pytest.approx(one["scoring_s"] / 4)
    assert fetch_growth(1) == 1.0 and 1.0 < fetch_growth(4) < 2.0
    assert four["fetch_bytes"] == pytest.approx(one["fetch_bytes"] * fetch_growth(4) / 4)
    assert (one["extra_kept"], four["extra_kept"]) == (0.0, 4 * 1.5)
    for held in ("sketch_bytes", "region_bytes"):  # every token stays held either way
        assert four[held] == one[held]
    # Without overlapping copies: the step saves 3/4 of the selection and about 2/3 of the
    # fetch, and pays for reading the extra tokens.
    saved_s = (
        one["scoring_s"] - four["scoring_s"] + (one["fetch_bytes"] - four["fetch_bytes"]) / 1e9
    )
    extra_s = 4 * 1.5 * TINY_MHA.kv_bytes_per_token() / profile.device_bytes_per_s
    step = every_step.step_time(bucket, {"g": 1.0}) - every_four.step_time(bucket, {"g": 1.0})
    assert step == pytest.approx(saved_s - extra_s)
    assert fetch_growth(64) == fetch_growth(8)  # levels off past the last measured interval
    assert FETCH_GROWTH[0] == (0.0, 1.0)


def test_a_host_plan_names_its_reselect_interval():
    options = {"batch": 4, "prompt_len": 1000, "gen_len": 8, "caching_ratio": 0.2}
    workload = Workload(**options, retention="host", reselect_every=4)
    plan = solve(machine(16 * GIB), TINY_MHA, workload)
    assert "a selection every 4 steps" in plan.describe()
    assert plan.to_dict()["workload"]["reselect_every"] == 4
    every_step = solve(machine(16 * GIB), TINY_MHA, replace(workload, reselect_every=1))
    assert "a selection every step" in every_step.describe()
    assert plan.fetch_bytes_per_step == pytest.approx(
        every_step.fetch_bytes_per_step * fetch_growth(4) / 4
    )
