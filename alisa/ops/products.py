"""Decode steps' weight products on a CPU, in the form this machine runs faster, as measured.

A decode step multiplies B rows (one new token a sequence) by every weight matrix of the model:
``F.linear(x, W)``, ``x`` (B, K) by ``W`` (N, K) transposed. PyTorch hands it to its BLAS as
``x @ Wᵀ``; the same numbers come out of ``(W @ xᵀ)ᵀ``, which the BLAS runs by another code path.
Which path is faster depends on the CPU, the BLAS and B, by a lot: on a 2-core AMD EPYC (AVX-512,
MKL 2024.2) one pass over SmolLM2-135M's float32 weights took 78 ms as ``x @ Wᵀ`` and 21 ms as
``(W @ xᵀ)ᵀ`` at B = 2, 86 / 46 ms at B = 7 and 173 / 127 ms at B = 64, but the same at B = 1
and 838 / 1,102 ms at B = 512 (docs/host-speed.md, "The weights' product form"). At one row the
BLAS runs on one thread, so up to sixteen float32 rows the transposed form is the CPU's own
compiled kernel, which reads the weights on every thread (26 against 50-53 ms at B = 1, 38
against 47-61 at B = 8, ``python -m experiments.kernels products``,
:func:`alisa.ops.cpu.weight_product`). No rule of
thumb holds across machines, so :class:`WeightProducts` measures both forms on the model's own
decode steps, per batch size (rounded up to a power of two), and keeps the faster one.

It is a ``TorchFunctionMode`` entered around each ``nn.Linear`` module's forward of a transposed
decode step (by hooks that :class:`alisa.runtime.engine.Engine`'s step registers and removes):
it sees the model's own ``F.linear`` calls, changes no model or class, and is gone when the step
ends; a step in PyTorch's form runs without it. Only products of the step's own rows take its
form: one of more rows (a recompute region's rebuild, batch x slots rows) runs PyTorch's. The
first decode steps of a batch size alternate the two forms in the order :data:`ORDER`
(balanced against a machine whose speed drifts over those steps), each step timed whole as it
would run once settled (a CPU computes synchronously), and after :data:`TRIALS` more of each
than the first (first-touch costs, left out) the transposed form is kept only where its step
over the neighbouring standard step, the median of those ratios (:func:`transposed_wins`), is
at least :data:`MARGIN` below 1: a clear win, not a toss-up of the machine's noise. (Timing the
products alone, alternating standard first, kept the transposed form at one row in two runs of
three, where the products cost the same and the transposed steps ran 5-10 % slower: the mode's
dispatch of every operator, and the later, faster steps of a machine warming up; stop 85.) Both
forms give the same products up to float rounding (the sums run in another order); the first
transposed product is checked against PyTorch's (:meth:`WeightProducts.check`) and a mismatch
keeps the standard form for good.

A compiled decode step (:mod:`alisa.runtime.compiled`) takes the row kernel as a registered
operator instead (:data:`alisa.ops.library.weight_product`): :meth:`WeightProducts.graph_pass`
gives the compiled call :func:`route_linears`, which rewrites the products in the graph dynamo
traced, before inductor compiles it, so no Python runs per operator; its form is measured once
per batch size on the products alone, before the graph is made (docs/compile.md, stop 90).

What is measured lives as long as its owner: a server keeps it for its life (each scheduler it
starts goes on with it), a continuous batch for every step it runs, while each ``generate``
call measures afresh: its first :data:`SETTLING` steps of a batch size alternate, half of them
in the slower form (a few percent of a 64-token call where the forms differ; nothing where they
do not, as at one row). Nothing is kept between processes, so nothing stale can be replayed.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

# Timed steps of each form per batch size before the choice, after the first of each.
TRIALS = 3
# The transposed form's median time over the standard form's must be this far below 1 (the gains
# it is for are 1.2-3.8x at 2-32 rows on the machine measured; at one row, 1.0x, noise decides).
MARGIN = 0.05
# The forms' order while measuring, repeated: standard, transposed, transposed, standard, so
# each pair of neighbouring steps holds one of each, in turns of which comes first. A machine
# that speeds up or slows down over the first steps (caches warming, a neighbour's load) then
# favours neither (plain alternation gives the second form the later, faster steps).
ORDER = (False, True, True, False)
# Decode steps of one batch size at most before its form settles (the first of each form too).
SETTLING = 2 * (TRIALS + 1)
# How decode steps' weight products run: measured per batch size, or one form always.
FORMS = ("measured", "transposed", "standard")
# The most rows the transposed form runs by the CPU's row kernel (alisa.ops.cpu.weight_rows): at
# thirty-two it no longer beats the BLAS (138 against 147 ms a pass over SmolLM2-135M, stop 89).
ROW_KERNEL_ROWS = 16
# A rewrite of the graph dynamo traced for a compiled step, before its backend compiles it:
# (graph, its placeholders' tensors) -> how many calls it rewrote (alisa.runtime.compiled).
GraphPass = Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], int]


def transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x2ᵀ)ᵀ``: float32 rows up to
    :data:`ROW_KERNEL_ROWS` by the CPU's compiled kernel (each thread a block of the
    weight's rows, 2.2x the BLAS at one row, where it runs on one thread), the rest by the BLAS.

    Parameters
    ----------
    x
        (..., K) inputs; flattened to (R, K) rows.
    weight
        (N, K).
    bias
        (N,) or None.

    Returns
    -------
    torch.Tensor
        (..., N), contiguous, as ``F.linear`` returns it.
    """
    from alisa.ops import cpu  # numba loads only where this form runs

    kernel = by_row_kernel(_product_rows(x), weight)
    return linear_by_rows(x, weight, bias, cpu.weight_product if kernel else blas_transposed)


def linear_by_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``x``'s rows multiplied by ``product(rows, weight)``
    ((R, K) rows, (N, K) weight -> (R, N)): the eager transposed form's shape, whose operations
    :func:`route_linears` writes into a compiled step's graph as nodes of their own. Returns
    (..., N), contiguous."""
    out = product(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def blas_transposed(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(R, N) ``rows @ weight.T`` as ``(weight @ rowsᵀ)ᵀ`` by the BLAS (a transposed view)."""
    return torch.mm(weight, rows.t()).t()


def by_row_kernel(rows: int, weight: torch.Tensor) -> bool:
    """Whether :func:`transposed_linear` runs ``rows`` rows by the CPU's row kernel: float32,
    a contiguous weight, at most :data:`ROW_KERNEL_ROWS` rows."""
    return rows <= ROW_KERNEL_ROWS and weight.dtype is torch.float32 and weight.is_contiguous()


def bucket(rows: int) -> int:
    """The batch size ``rows`` is measured under: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(rows - 1, 0).bit_length()


def transposed_wins(taken: list[tuple[bool, float]]) -> bool:
    """Whether the transposed form clearly beat PyTorch's in ``taken``, the measured steps in
    order ((transposed, seconds), :data:`ORDER` repeated): each pair of neighbouring steps
    (one of each form, a step apart, so a drifting machine moves both alike) gives a ratio,
    the first pair (first touches) left out; the median ratio must be below ``1 - MARGIN``."""
    ratios = []
    for first, second in zip(taken[2::2], taken[3::2], strict=True):
        (form, seconds), (_, other) = first, second
        transposed, standard = (seconds, other) if form else (other, seconds)
        ratios.append(transposed / standard if standard > 0 else 1.0)
    return statistics.median(ratios) < 1 - MARGIN


class WeightProducts(TorchFunctionMode):
    """The weight products of decode steps, per batch size in the form measured faster.

    Parameters
    ----------
    asked
        ``"measured"`` (each batch size's first steps try both forms), ``"transposed"`` or
        ``"standard"`` (always that form: tests, and a user pinning one).
    clock
        Seconds, read around each measured step (``time.perf_counter``; a test passes its
        own).
    """

    def __init__(
        self, asked: str = "measured", clock: Callable[[], float] = time.perf_counter
    ) -> None:
        super().__init__()
        if asked not in FORMS:
            raise ValueError(f"asked={asked!r} must be one of {', '.join(FORMS)}")
        self.asked, self.clock = asked, clock
        # bucket -> (transposed, the whole step's seconds) of each measured step, in order
        self.samples: dict[int, list[tuple[bool, float]]] = {}
        self.chosen: dict[int, bool] = {}  # bucket -> transposed (once measured)
        self.checked: bool | None = None  # None: no transposed product checked yet
        self._transposed = False
        self._step_rows = 0  # rows of the step running now (its products' rows, measured)
        self._traced_forms: dict[int, bool] = {}  # bucket -> a compiled step runs the kernel
        self.row_kernel = False  # a transposed product ran by the CPU's row kernel

    def form(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs the transposed form now."""
        if self.asked != "measured":
            return self.asked == "transposed"
        if self.checked is False:
            return False
        key = bucket(rows)
        if key in self.chosen:
            return self.chosen[key]
        return ORDER[len(self.samples.get(key, ())) % len(ORDER)]

    def settled(self, rows: int) -> bool:
        """Whether steps of ``rows`` rows run one form from now on (asked for, measured, or
        the transposed form refused, or a compiled step's form decided): a calibration times
        steps only then."""
        key = bucket(rows)
        return (
            self.asked != "measured"
            or self.checked is False
            or key in self.chosen
            or key in self._traced_forms
        )

    @contextmanager
    def step(self, rows: int, model: nn.Module) -> Iterator[None]:
        """Run one decode step of ``rows`` rows of ``model`` (a ``with`` block around its
        forward): in the transposed form, this mode entered around each of its ``nn.Linear``
        modules' forwards only, or in PyTorch's form (no mode, no hook). While measuring, the
        step is timed whole, each form as it runs once settled: the hooks and the mode's
        dispatch count, not only the products.

        The mode is entered per linear module, not around the whole forward, because a mode
        dispatches every operator of the step through Python: 1.8 µs each, 6 ms of a 71 ms
        step of SmolLM2-135M at one row (3,234 operators) and 15 of 89 ms with INT4 KV (7,854;
        stop 89), where the transposed steps had run 5-10 % slower than their products gain
        (stop 85). A linear function called outside an ``nn.Linear`` runs PyTorch's form."""
        self._transposed, self._step_rows = self.form(rows), rows
        measuring = not self.settled(rows)
        start = self.clock() if measuring else 0.0
        if self._transposed:
            with self._around_linears(model):
                yield
        else:
            yield
        if measuring and self.checked is not False:  # (a failed check ends the measuring)
            key = bucket(rows)
            taken = self.samples.setdefault(key, [])
            taken.append((self._transposed, self.clock() - start))
            if len(taken) == SETTLING:
                self.chosen[key] = transposed_wins(taken)

    @contextmanager
    def _around_linears(self, model: nn.Module) -> Iterator[None]:
        """Hooks that enter this mode as each ``nn.Linear`` of ``model`` starts and leave it as
        it ends (also when it raises), removed when the block ends: nothing stays on the
        model."""
        handles = []
        try:
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    handles.append(module.register_forward_pre_hook(self._enter))
                    handles.append(module.register_forward_hook(self._leave, always_call=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def graph_pass(self, rows: int, model: nn.Module) -> GraphPass | None:
        """What a compiled decode step of ``rows`` rows of ``model`` does to the graph dynamo
        traces: :func:`route_linears` where the row kernel is this batch size's form, else
        nothing (None). A compiled step runs no Python per operator, so its form is measured on
        the products alone (:meth:`traced_form`), before its graph is compiled: the choice is
        made once per batch size, and the graph never changes with it."""
        return route_linears if self.traced_form(rows, model) else None

    def traced_form(self, rows: int, model: nn.Module) -> bool:
        """Whether a compiled step of ``rows`` rows runs the row kernel: where it can (float32
        weights, at most :data:`ROW_KERNEL_ROWS` rows) and was asked or measured faster. The
        measurement, at a batch size's first step, times one pass over the model's linear
        weights at ``rows`` random rows each way, :data:`SETTLING` passes in the order
        :data:`ORDER`, and keeps the kernel where it clearly wins (:func:`transposed_wins`):
        about eight passes, 0.4 s for SmolLM2-135M. The first product is checked against
        PyTorch's (:meth:`check`) as in an eager step."""
        key = bucket(rows)
        if key not in self._traced_forms:  # decided once per batch size: the graph keeps it
            self._traced_forms[key] = self._decide_traced(rows, model)
            self.row_kernel = self.row_kernel or self._traced_forms[key]
        return self._traced_forms[key]

    def _decide_traced(self, rows: int, model: nn.Module) -> bool:
        """:meth:`traced_form`'s decision for a batch size (see there)."""
        if self.asked == "standard":
            return False
        weights = _row_kernel_weights(model, rows)
        if not weights:
            return False
        from alisa.ops import library  # numba loads only where the kernel runs

        generator = torch.Generator().manual_seed(0)
        inputs: dict[int, torch.Tensor] = {}
        for weight in weights:
            size = weight.shape[1]
            inputs.setdefault(size, torch.randn(rows, size, generator=generator))
        if self.checked is None:
            x, first = inputs[weights[0].shape[1]], weights[0]
            with torch.no_grad():
                self.checked = self.check(x, first, None, library.weight_product(x, first))
        if not self.checked or self.asked == "transposed":
            return bool(self.checked)
        key = bucket(rows)
        self.chosen[key] = self._row_kernel_wins(weights, inputs, library.weight_product)
        return self.chosen[key]

    def _row_kernel_wins(
        self, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], kernel: Callable
    ) -> bool:
        """:meth:`traced_form`'s measurement (see there): ``inputs`` the rows by size K."""
        taken = []
        with torch.no_grad():
            for index in range(SETTLING):
                transposed = ORDER[index % len(ORDER)]
                product = kernel if transposed else functional.linear
                start = self.clock()
                for weight in weights:
                    product(inputs[weight.shape[1]], weight)
                taken.append((transposed, self.clock() - start))
        return transposed_wins(taken)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.__enter__()

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.__exit__(None, None, None)

    def check(self, x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor) -> bool:
        """Whether the transposed product ``out`` equals PyTorch's within float rounding (a
        BLAS that sums wrong in one form would otherwise change every token)."""
        expected = functional.linear(x, weight, bias)
        scale = expected.abs().max().clamp_min(1.0)
        # Each output rounded once to its dtype, its K-term sum (in float32 at least) in another
        # order: a few ulps, and the sum's error growing as sqrt(K). A wrong product (a layout
        # read transposed) is off by the outputs' own size.
        sums = max(torch.finfo(expected.dtype).eps, torch.finfo(torch.float32).eps)
        tolerance = 4 * torch.finfo(expected.dtype).eps + 4 * sums * x.shape[-1] ** 0.5
        return bool(((out - expected).abs().max() / scale) <= tolerance)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not functional.linear:
            return func(*args, **kwargs)
        x, weight, bias = _operands(args, kwargs)
        rows = _product_rows(x)
        # Only the step's own products take its form: one of more rows (a recompute region
        # rebuilding its keys and values, batch x slots rows through the layer's projections)
        # was never measured, and there the BLAS's own form is the faster one (838 against
        # 1,102 ms at 512 rows). A rebuild that took the form of the decode rows it ran beside
        # ran 1.2-1.3x as long in a calibration as in a user's run (float32, AVX2; stops 94-95).
        if self._transposed and _plain(x, weight, bias) and rows <= self._step_rows:
            out = transposed_linear(x, weight, bias)
            self.row_kernel = self.row_kernel or by_row_kernel(rows, weight)
            if self.checked is None:
                self.checked = self.check(x, weight, bias, out)
            return out
        return func(*args, **kwargs)

    def describe(self) -> str:
        """e.g. ``weight products measured: transposed at 2 rows, 3-4 rows; standard at 1 row``
        (``transposed (row kernel)`` once a product ran by the CPU's row kernel)."""
        if self.asked != "measured":
            return f"weight products {self.asked} (asked)"
        if self.checked is False:
            return "weight products standard (the transposed form missed PyTorch's)"
        if not self.chosen:
            return "weight products measured, none settled yet"
        parts = []
        for form in (True, False):
            sizes = [_rows(key) for key in sorted(self.chosen) if self.chosen[key] is form]
            if sizes:
                name = "standard"
                if form:
                    name = "transposed (row kernel)" if self.row_kernel else "transposed"
                parts.append(f"{name} at {', '.join(sizes)}")
        return "weight products measured: " + "; ".join(parts)


def route_linears(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> int:
    """Rewrite a compiled decode step's ``F.linear`` calls of a few float32 rows as calls of the
    row kernel's operator (:data:`alisa.ops.library.weight_product`), in the graph dynamo
    traced, before inductor compiles it (a :data:`GraphPass`).

    A product is rewritten where :func:`by_row_kernel` takes it (at most
    :data:`ROW_KERNEL_ROWS` rows, float32, a contiguous weight) and its weight and bias are the
    step's inputs, plain dense tensors (a quantized or other subclassed weight keeps its own
    ``F.linear``); the others stay PyTorch's. A graph pass, not a ``TorchFunctionMode``
    around the compiled call: dynamo traces a mode's ``__torch_function__`` at every operator
    of the step, which was about 40 % of dynamo's tracing of it (docs/compile.md, 2026-12-08).

    Parameters
    ----------
    graph
        The graph dynamo traced, rewritten in place.
    inputs
        Its placeholders' tensors, in order (the model's weights among them), as dynamo hands
        them to a backend.

    Returns
    -------
    int
        How many products now call the operator.
    """
    from alisa.ops import library  # numba loads only where the kernel runs

    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    tensors = dict(zip(placeholders, inputs, strict=True))
    routed = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target is not functional.linear:
            continue
        x, weight, bias = _operands(node.args, node.kwargs)
        rows = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        real = (tensors.get(weight), None if bias is None else tensors.get(bias))
        if rows is None or real[0] is None or (bias is not None and real[1] is None):
            continue  # a product of tensors the step computes: not a model's weight
        if not all(isinstance(size, int) for size in rows.shape):
            continue  # sizes known only when it runs (X-MOD's adapters route rows by data)
        if not _plain(rows, *real, traced=True) or not by_row_kernel(_product_rows(rows), real[0]):
            continue
        # linear_by_rows's operations as nodes of torch's own (the operator, reshape, view,
        # add): a call of a Python function would make AOTAutograd's cache refuse the graph, so
        # that a warm compile traced it to aten again (about 30 s for SmolLM2-135M).
        fakes = {part: part.meta["example_value"] for part in (x, weight, bias) if part is not None}
        with graph.graph.inserting_before(node):
            out = _traced_call(graph, "reshape", (x, -1, rows.shape[-1]), fakes)
            out = _traced_call(graph, library.weight_product, (out, weight), fakes)
            if bias is not None:
                out = _traced_call(graph, operator.add, (out, bias), fakes)
            out = _traced_call(graph, "view", (out, *rows.shape[:-1], real[0].shape[0]), fakes)
        node.replace_all_uses_with(out)
        graph.graph.erase_node(node)
        routed += 1
    if routed:
        graph.recompile()
    return routed


def _traced_call(graph: torch.fx.GraphModule, target, args: tuple, fakes: dict) -> torch.fx.Node:
    """A node of ``graph`` (at its insertion point) calling ``target`` (a function, or a tensor
    method by name) on ``args``, with the value dynamo's own nodes carry (``example_value``,
    run on the arguments' fake tensors in ``fakes``, which it joins) for inductor's passes."""
    method = isinstance(target, str)
    node = graph.graph.create_node("call_method" if method else "call_function", target, args)
    values = [fakes[arg] if isinstance(arg, torch.fx.Node) else arg for arg in args]
    call = getattr(values.pop(0), target) if method else target
    fakes[node] = node.meta["example_value"] = call(*values)
    return node


def _row_kernel_weights(model: nn.Module, rows: int) -> list[torch.Tensor]:
    """The weights of ``model``'s linear modules the row kernel can multiply ``rows`` rows by
    (:func:`by_row_kernel`), each tensor once (a tied head shares the embedding's)."""
    weights: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and by_row_kernel(rows, module.weight):
            weights.setdefault(id(module.weight), module.weight)
    return list(weights.values())


def _product_rows(x: torch.Tensor) -> int:
    """The rows of a product of ``x`` (..., K): every leading dimension together."""
    return x.numel() // max(x.shape[-1], 1)


def _operands(args: tuple, kwargs: dict) -> tuple:
    """``F.linear``'s (input, weight, bias), given by position or by name."""
    named = ("input", "weight", "bias")
    values = [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(named)]
    return tuple(values)


def _plain(x, weight, bias, *, traced: bool = False) -> bool:
    """Whether the product is one the transposed form computes alike: plain dense tensors of one
    dtype (a quantized or other subclassed weight keeps its own ``F.linear``); ``traced``:
    ``x`` is a traced graph's value of the rows (of the tracer's type; the weights are real)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    real = tensors[1:] if traced else tensors
    return (
        all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in real)
        and all(t.layout is torch.strided and t.dtype is x.dtype for t in tensors)
        and weight.dim() == 2
        and x.dim() >= 1
    )


def _rows(key: int) -> str:
    """The batch sizes bucket ``key`` holds, in words: ``1 row``, ``2 rows``, ``3-4 rows``."""
    low = key // 2 + 1
    return ("1 row" if key == 1 else f"{key} rows") if low >= key else f"{low}-{key} rows"
