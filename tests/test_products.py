"""The weights' product form of decode steps (alisa.ops.products): the same numbers either way,
measured per batch size on the steps themselves, a clear win kept, a wrong product never."""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import tiny_llama
from torch import nn

from alisa import AlisaConfig, generate
from alisa.ops.backends import Ops, choose_ops
from alisa.ops.products import (
    MARGIN,
    ORDER,
    ROW_KERNEL_ROWS,
    SETTLING,
    TRIALS,
    WeightProducts,
    bucket,
    route_linears,
    transposed_linear,
)
from alisa.runtime.compiled import CompiledDecode
from alisa.runtime.engine import Engine


@pytest.mark.parametrize("shape", [(3, 16), (2, 1, 16), (5, 2, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_transposed_product_is_the_linear_one(shape, bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    weight = torch.randn(24, 16, generator=generator)
    offset = torch.randn(24, generator=generator) if bias else None
    out = transposed_linear(x, weight, offset)
    assert out.shape == (*shape[:-1], 24) and out.is_contiguous()
    torch.testing.assert_close(out, nn.functional.linear(x, weight, offset))


@pytest.mark.parametrize("rows", [1, 2, 5, ROW_KERNEL_ROWS, ROW_KERNEL_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_transposed_form_runs_the_row_kernel_at_few_float32_rows(rows, dtype, monkeypatch):
    """Up to ROW_KERNEL_ROWS float32 rows the transposed form is the CPU's row kernel (each output
    one dot product, another summing order than the BLAS: float rounding only, and the check
    accepts it); more rows, and other dtypes, go to the BLAS."""
    from alisa.ops import cpu

    calls = []
    kernel = cpu.weight_product
    monkeypatch.setattr(cpu, "weight_product", lambda *a: calls.append(a) or kernel(*a))
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 300, generator=generator).to(dtype)  # odd sizes: no even split
    weight = torch.randn(37, 300, generator=generator).to(dtype)
    out = transposed_linear(x, weight)
    assert out.shape == (rows, 1, 37) and out.dtype == dtype and out.is_contiguous()
    assert len(calls) == (rows <= ROW_KERNEL_ROWS and dtype is torch.float32)
    assert WeightProducts().check(x, weight, None, out)  # a few ulps of the sums' size


@pytest.mark.parametrize("rows", [3, 9, 14])  # one product at a time; tiles, a part one
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_row_kernel_is_the_product_whatever_its_parts(rows, parts):
    """Each output is summed by one thread in a tile slot set by its row's parity: the parts
    change which thread, not the value (41 weight rows: a tile past the last repeats it)."""
    from alisa.ops import cpu

    generator = torch.Generator().manual_seed(parts)
    x = torch.randn(rows, 64, generator=generator)
    weight = torch.randn(41, 64, generator=generator)
    out = torch.full((rows, 41), float("nan"))
    cpu.weight_rows(x.numpy(), weight.numpy(), out.numpy(), parts)
    torch.testing.assert_close(out, cpu.weight_product(x, weight), rtol=0, atol=0)
    torch.testing.assert_close(out, x @ weight.T)


def test_batch_sizes_are_measured_by_powers_of_two():
    sizes = (1, 2, 3, 4, 5, 8, 9, 64, 65)
    assert [bucket(rows) for rows in sizes] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


class _Clock:
    """Seconds that advance by ``cost[form]`` over each product of the step being run."""

    def __init__(self, cost: dict[bool, list[float]]) -> None:
        self.cost, self.now, self.form, self.reads = cost, 0.0, False, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the product's end
            costs = self.cost[self.form]
            self.now += costs.pop(0) if len(costs) > 1 else costs[0]
        return self.now


def _run_steps(products: WeightProducts, clock: _Clock, rows: int, steps: int) -> list[bool]:
    """Forms the ``steps`` decode steps of ``rows`` rows ran (one linear layer a step)."""
    layer = nn.Linear(8, 4)
    forms = []
    for _ in range(steps):
        clock.form = products.form(rows)
        forms.append(clock.form)
        with products.step(rows, layer):
            layer(torch.randn(rows, 1, 8))
    return forms


def test_a_batch_size_keeps_the_transposed_form_where_it_wins_clearly():
    clock = _Clock({False: [3.0], True: [1.0]})
    products = WeightProducts(clock=clock)
    forms = _run_steps(products, clock, rows=6, steps=2 * (TRIALS + 1) + 3)
    trials = 2 * (TRIALS + 1)
    assert forms[:trials] == [False, True, True, False] * ((TRIALS + 1) // 2)  # ORDER
    assert forms[trials:] == [True] * 3 and products.chosen == {8: True}
    # six float32 rows ran by the CPU's row kernel, and the record says so
    assert products.describe() == "weight products measured: transposed (row kernel) at 5-8 rows"
    # another batch size is measured on its own
    assert _run_steps(products, clock, rows=2, steps=2) == [False, True]
    assert 2 not in products.chosen


def test_past_the_row_kernels_rows_the_transposed_form_is_the_blas():
    clock = _Clock({False: [3.0], True: [1.0]})
    products = WeightProducts(clock=clock)
    _run_steps(products, clock, rows=ROW_KERNEL_ROWS + 4, steps=2 * (TRIALS + 1) + 1)
    assert products.describe() == "weight products measured: transposed at 17-32 rows"


def test_a_win_inside_the_noise_keeps_the_standard_form():
    # one fast transposed step, but the transposed steps' median (4.0) is not below the
    # standard steps' (4.0); the first step of each form is left out
    clock = _Clock({False: [9.0, 4.0, 4.1, 3.9], True: [9.0, 1.0, 4.0, 4.2]})
    products = WeightProducts(clock=clock)
    forms = _run_steps(products, clock, rows=1, steps=2 * (TRIALS + 1) + 2)
    assert products.chosen == {1: False} and forms[-2:] == [False, False]
    assert products.describe() == "weight products measured: standard at 1 row"


def test_a_win_smaller_than_the_margin_keeps_the_standard_form():
    # every transposed step is faster, by less than MARGIN: a toss-up
    clock = _Clock({False: [1.0], True: [1.0 - MARGIN / 2]})
    products = WeightProducts(clock=clock)
    forms = _run_steps(products, clock, rows=1, steps=2 * (TRIALS + 1) + 2)
    assert products.chosen == {1: False} and forms[-2:] == [False, False]


class _Drifting(_Clock):
    """Both forms cost the same, and every product costs 10 % less than the one before: a
    machine speeding up over its first steps."""

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += 0.9 ** (self.reads // 2)
        return self.now


def test_a_machine_speeding_up_does_not_choose_for_the_later_form():
    clock = _Drifting({})
    products = WeightProducts(clock=clock)
    _run_steps(products, clock, rows=4, steps=SETTLING)
    assert products.chosen == {4: False}
    # plain alternation (standard, transposed, ...) with each form's median would have kept
    # the transposed form: its steps come later, so they are faster
    steps = [0.9**n for n in range(1, SETTLING + 1)]
    assert statistics.median(steps[3::2]) < (1 - MARGIN) * statistics.median(steps[2::2])


def test_a_transposed_product_that_misses_pytorchs_is_never_used():
    class Wrong(WeightProducts):
        def check(self, x, weight, bias, out):
            return super().check(x, weight, bias, out + 1.0)

    clock = _Clock({False: [3.0], True: [1.0]})
    products = Wrong(clock=clock)
    forms = _run_steps(products, clock, rows=4, steps=6)
    assert forms == [False, True, False, False, False, False]  # refused at its first product
    assert products.checked is False and products.chosen == {}
    assert "missed PyTorch's" in products.describe()


def test_the_check_accepts_float_rounding_only():
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(4, 64, generator=generator), torch.randn(32, 64, generator=generator)
    products = WeightProducts()
    assert products.check(x, weight, None, transposed_linear(x, weight))
    assert not products.check(x, weight, None, transposed_linear(x, weight) * 1.001)


@pytest.mark.parametrize("asked", ["transposed", "standard"])
def test_a_form_asked_for_runs_every_step_unmeasured(asked):
    clock = _Clock({False: [1.0], True: [1.0]})
    products = WeightProducts(asked, clock=clock)
    assert _run_steps(products, clock, rows=3, steps=4) == [asked == "transposed"] * 4
    assert products.chosen == {} and products.describe() == f"weight products {asked} (asked)"


def test_an_unknown_form_is_refused_naming_it():
    with pytest.raises(ValueError, match="asked='fast' must be one of measured"):
        WeightProducts("fast")


def test_only_a_cpu_backend_measures_the_products():
    assert choose_ops("cpu", torch.float32, "cpu").products == "measured"
    assert choose_ops("cpu", torch.float32, "reference").products == "standard"
    assert "weight products measured" in choose_ops("cpu", torch.bfloat16, "cpu").describe()
    fields = dict(name="reference", product="float32", compiled=False, fused=False)
    with pytest.raises(ValueError, match="products='measured' runs on a CPU, not cuda"):
        Ops(device="cuda", mapped=False, placing=False, products="measured", **fields)
    with pytest.raises(ValueError, match="products='fast' must be one of"):
        Ops(device="cpu", mapped=False, placing=False, products="fast", **fields)


def test_a_generation_says_what_its_products_settled_on(tokenizer):
    model = tiny_llama()
    prompts = ["one two three", "four five"]
    steps = 2 * (TRIALS + 1) + 2
    config = AlisaConfig(kernels="cpu")
    result = generate(model, tokenizer, prompts, config, max_new_tokens=steps, stop_at_eos=False)
    assert ", weight products measured: " in result.kernels and "at 2 rows" in result.kernels
    assert result.kernels.count("weight products") == 1
    reference = AlisaConfig(kernels="reference")
    plain = generate(model, tokenizer, prompts, reference, max_new_tokens=4, stop_at_eos=False)
    assert "weight products" not in plain.kernels


def test_a_batch_size_settles_within_its_trials_and_says_so():
    clock = _Clock({False: [2.0], True: [1.0]})
    products = WeightProducts(clock=clock)
    settled = []
    for _ in range(SETTLING):
        settled.append(products.settled(5))
        _run_steps(products, clock, rows=5, steps=1)
    assert settled == [False] * SETTLING and products.settled(5) and products.settled(8)
    assert not products.settled(9)  # another batch size measures on its own
    assert WeightProducts("standard").settled(9)


def test_an_engine_before_its_first_measured_step_is_settled(tokenizer):
    engine = Engine(tiny_llama(), tokenizer)
    assert engine.settled(4) and engine.products is None


def test_a_linear_called_by_name_or_on_a_subclassed_weight_still_computes():
    class Marked(torch.Tensor):
        pass

    products = WeightProducts("transposed")
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    with products.step(3, nn.Linear(8, 5)), products:  # the mode, as a linear module enters it
        named = nn.functional.linear(input=x, weight=weight)
        odd = nn.functional.linear(x, weight.as_subclass(Marked))
        mixed = nn.functional.linear(x.double(), weight.double(), bias=torch.ones(5).double())
    torch.testing.assert_close(named, x @ weight.T)
    torch.testing.assert_close(odd.as_subclass(torch.Tensor), x @ weight.T)
    torch.testing.assert_close(mixed, x.double() @ weight.double().T + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_check_refuses_a_product_read_the_wrong_way(dtype):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=generator).to(dtype)
    weight = torch.randn(64, 64, generator=generator).to(dtype)
    products = WeightProducts()
    assert products.check(x, weight, None, transposed_linear(x, weight))
    assert not products.check(x, weight, None, transposed_linear(x, weight.T.contiguous()))


def test_a_backend_says_what_its_products_settled_on_in_place_of_measured():
    ops = choose_ops("cpu", torch.float32, "cpu")
    settled = ops.describe(products="weight products measured: transposed at 5-8 rows")
    assert settled.endswith(
        ", selection in one call, weight products measured: transposed at 5-8 rows"
    )
    assert ops.describe().endswith(", weight products measured")
    assert "weight products" not in choose_ops("cpu", torch.float32, "reference").describe()


def test_a_step_settled_on_pytorchs_form_runs_outside_the_mode():
    clock = _Clock({False: [1.0], True: [3.0]})
    products = WeightProducts(clock=clock)
    _run_steps(products, clock, rows=2, steps=SETTLING)
    assert products.chosen == {2: False}
    reads = clock.reads
    _run_steps(products, clock, rows=2, steps=3)
    assert clock.reads == reads  # no product timed, none dispatched through the mode
    _run_steps(products, clock, rows=3, steps=1)  # another batch size is measured
    assert clock.reads > reads


def test_a_step_is_timed_whole_and_pytorchs_form_runs_outside_the_mode():
    """A measured step's seconds are the whole step's (what the mode's dispatch costs counts
    against the transposed form), and a step in PyTorch's form never enters the mode."""

    class Counting(WeightProducts):
        seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.seen += 1
            return super().__torch_function__(func, types, args, kwargs)

    reads = []

    def clock() -> float:
        reads.append(len(reads))
        return float(len(reads))

    products = Counting(clock=clock)
    layer = nn.Linear(8, 4)
    for expected in ORDER:
        transposed = products.form(3)
        assert transposed is expected
        before = Counting.seen
        with products.step(3, layer):
            layer(torch.randn(3, 8))
            inside = Counting.seen
            torch.relu(torch.randn(3))
            assert Counting.seen == inside  # the mode only inside a linear module's forward
        assert (Counting.seen > before) is transposed  # the standard form: no dispatch at all
        assert not layer._forward_pre_hooks and not layer._forward_hooks  # nothing left
    assert len(reads) == 2 * len(ORDER)  # one read as each step starts, one as it ends
    assert [seconds for _, seconds in products.samples[4]] == [1.0] * len(ORDER)


def test_only_the_steps_own_rows_take_its_transposed_form(monkeypatch):
    """A product of more rows than the step's (a recompute region rebuilding batch x slots
    keys through the layer's projections) runs PyTorch's form: only the step's rows were
    measured, and at hundreds of rows the BLAS's own form is the faster one."""
    from alisa.ops import products as module

    seen = []
    transposed = module.transposed_linear
    monkeypatch.setattr(
        module, "transposed_linear", lambda x, *a: seen.append(x.shape) or transposed(x, *a)
    )
    layer = nn.Linear(8, 4)
    products = WeightProducts("transposed")
    inputs = {rows: torch.randn(rows, 1, 8) for rows in (1, 3, 4, 40)}
    with products.step(3, layer):
        outputs = {rows: layer(x) for rows, x in inputs.items()}
    assert seen == [(1, 1, 8), (3, 1, 8)]  # the rebuild-like 4 and 40 rows ran PyTorch's form
    for rows, x in inputs.items():
        torch.testing.assert_close(outputs[rows], layer(x))


def test_a_linear_that_raises_leaves_no_mode_and_no_hook_behind():
    from torch.overrides import _get_current_function_mode_stack

    class Failing(nn.Linear):
        def forward(self, x):
            super().forward(x)
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(8, 8), Failing(8, 4))
    products = WeightProducts("transposed")
    with pytest.raises(RuntimeError, match="boom"), products.step(3, model):
        model(torch.randn(3, 8))
    assert not _get_current_function_mode_stack()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    torch.testing.assert_close(
        model[0](torch.ones(1, 8)),
        nn.functional.linear(torch.ones(1, 8), model[0].weight, model[0].bias),
    )


class _Passes(_Clock):
    """Seconds of a compiled batch size's measurement (passes over the weights in the order
    ORDER, one read as each starts and one as it ends): ``cost[form]`` a pass."""

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += self.cost[ORDER[(self.reads // 2 - 1) % len(ORDER)]][0]
        return self.now


@pytest.mark.parametrize(("kernel", "wins"), [(0.5, True), (1 - MARGIN / 2, False)])
def test_a_compiled_batch_size_takes_the_row_kernel_where_its_products_win_clearly(kernel, wins):
    """A compiled step's form is measured on the products alone, once per batch size, before
    its graph is made: a clear win takes the row kernel, one inside the margin does not; past
    ROW_KERNEL_ROWS rows, with 16-bit weights or asked for PyTorch's form nothing is timed."""
    model = tiny_llama()
    clock = _Passes({False: [1.0], True: [kernel]})
    products = WeightProducts(clock=clock)
    assert products.traced_form(2, model) is wins
    assert clock.reads == 2 * SETTLING and products.chosen == {2: wins} and products.checked
    assert products.traced_form(2, model) is wins  # decided once: the graph keeps it
    assert not products.traced_form(ROW_KERNEL_ROWS + 1, model)
    assert clock.reads == 2 * SETTLING
    assert ("transposed (row kernel) at 2 rows" in products.describe()) is wins
    half = tiny_llama().to(torch.bfloat16)
    assert not WeightProducts(clock=clock).traced_form(1, half) and clock.reads == 2 * SETTLING
    assert not WeightProducts("standard").traced_form(1, model)
    assert WeightProducts("transposed").traced_form(1, model)


def test_the_weight_product_operator_is_the_row_kernel():
    from alisa.ops import cpu, library

    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 40, generator=generator), torch.randn(9, 40, generator=generator)
    assert torch.equal(library.weight_product(x, weight), cpu.weight_product(x, weight))
    torch.testing.assert_close(library.weight_product(x, weight), x @ weight.T)
    torch.library.opcheck(library.weight_product, (x, weight))


def test_a_compiled_forward_calls_the_row_kernel_operator_from_one_graph():
    """With :meth:`WeightProducts.graph_pass` the compiled forward's graph calls
    ``alisa::weight_product`` for every linear module (the tied head's too), the logits are
    the eager forward's within the sums' rounding and one graph serves every call; a batch size
    past the kernel's rows takes no pass and runs PyTorch's products, and the same batch size
    compiled without the pass gets a graph of its own, not the rewritten one."""
    from torch._dynamo.utils import counters

    model = tiny_llama()
    linears = sum(isinstance(module, nn.Linear) for module in model.modules())
    decode = CompiledDecode(model, "default", backend="eager")
    products = WeightProducts("transposed")
    ids = torch.randint(0, model.config.vocab_size, (2, 1))
    wide = torch.randint(0, model.config.vocab_size, (ROW_KERNEL_ROWS + 1, 1))
    rewrite = products.graph_pass(2, model)
    assert rewrite is route_linears and products.graph_pass(ROW_KERNEL_ROWS + 1, model) is None
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        eager = model(ids).logits
        decode.forward(rewrite)(ids)  # its graph made (the compiler's calls are fake ones)
    with torch.no_grad(), torch.profiler.profile() as profile:
        for _ in range(3):
            logits = decode.forward(rewrite)(ids).logits
        decode.forward(None)(wide)
        plain = decode.forward(None)(ids).logits
    calls = [event for event in profile.events() if event.name == "alisa::weight_product"]
    assert len(calls) == 3 * linears
    assert counters["stats"]["unique_graphs"] == 3  # two batch sizes, one of them twice
    torch.testing.assert_close(logits, eager)
    torch.testing.assert_close(plain, eager)
    assert products.row_kernel
    with pytest.raises(ValueError, match="mode='default'"):
        CompiledDecode(model, "reduce-overhead").forward(rewrite)


def test_the_graph_pass_leaves_products_whose_rows_are_known_only_when_run():
    """A product of rows the data picks (X-MOD's adapters route rows so) keeps PyTorch's
    ``F.linear``: its row count is a symbol the pass cannot write into the graph (it did, and
    the graph's code failed with ``NameError: name 'u0' is not defined``); the product of
    fixed rows beside it takes the operator."""
    routed = []

    def backend(graph, inputs):
        routed.append(route_linears(graph, inputs))
        return graph

    def step(x, weight):
        return nn.functional.linear(x[x[:, 0] > 0], weight), nn.functional.linear(x, weight)

    x, weight = torch.randn(5, 4), torch.randn(6, 4)
    x[:2, 0] = torch.tensor([1.0, -1.0])
    traced = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        picked, every = traced(x, weight)
    assert routed == [1]
    torch.testing.assert_close(picked, x[x[:, 0] > 0] @ weight.T)
    torch.testing.assert_close(every, x @ weight.T)


def test_a_compiled_generation_measures_its_products_and_keeps_the_tokens(tokenizer):
    """A static cache's compiled steps with the weights' products measured (``kernels="auto"``
    on a CPU) give the eager steps' tokens, and the record says what the products settled on."""
    model = tiny_llama()
    prompts = ["one two three", "four five"]
    config = AlisaConfig(policy="swa", caching_ratio=0.5)
    run = dict(max_new_tokens=6, stop_at_eos=False)
    eager = generate(model, tokenizer, prompts, config, compile="off", **run)
    compiled = generate(model, tokenizer, prompts, config, compile="on", **run)
    assert compiled.compile_s is not None and compiled.token_ids == eager.token_ids
    assert "weight products measured: " in compiled.kernels and "at 2 rows" in compiled.kernels
