"""Which kernels a cache runs: one backend, chosen once from the device, the dtype and the machine.

Host retention's decode step (ALISA's token selection, https://arxiv.org/abs/2403.17312, §IV)
has three implementations of the same rule:

``reference``
    PyTorch operators everywhere: the definitions the others are tested against.
``cpu``
    the weights' products of decode steps in the form measured faster per batch size
    (:mod:`alisa.ops.products`); numba-compiled kernels for the choice, the slot swap, the
    history and the host fetch, and for dropping's eviction and attention sums; for a float32
    model the key sketch's product compiled too and the whole selection in one compiled call
    per layer, on every CPU; for a 16-bit model the product compiled unless oneDNN multiplies
    bfloat16 natively (AVX-512 BF16, AMX, Arm BF16), where PyTorch's is faster.
``cuda``
    Triton kernels: the device reads the chosen host rows itself and places them in one launch.

:func:`choose_ops` is the only code that reads the device type, the CPU's bfloat16 support or
whether Triton is installed to decide what runs; everything downstream reads the :class:`Ops`
it returns.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from alisa.ops import KERNELS, reference
from alisa.ops.products import FORMS

# How the key sketch's product runs (alisa.kv.ranking): PyTorch in bfloat16, PyTorch on the
# sketch widened to float32, or the compiled CPU kernel.
PRODUCTS = ("bfloat16", "float32", "compiled")


@dataclass(frozen=True, kw_only=True)
class Ops:
    """The kernels one cache runs (:func:`choose_ops`).

    Attributes
    ----------
    name
        ``"reference"``, ``"cpu"`` or ``"cuda"``.
    device
        The device type the kernels run on.
    product
        How the key sketch's product runs, one of :data:`PRODUCTS`.
    compiled
        The choice, swap, history and host fetch, and dropping's eviction and attention sums,
        run as compiled CPU kernels (numba).
    fused
        The selection runs as one compiled call per layer where the layout allows it.
    mapped
        The device reads the chosen rows from page-locked host memory itself (Triton).
    placing
        The choice and the slot placement run as one Triton kernel.
    pinned
        Host buffers are page-locked (the device is CUDA): copies to the device run
        asynchronously, and a kernel on the device can read host rows.
    branches
        A traced step may branch on a device number (``torch.cond``, which reads it on the
        host): on a CPU, where that read is free; a CUDA graph replays no branch, so there
        every alternative is computed and one selected.
    feature
        What decided the product on a CPU (its bfloat16 support), for the record; else ``""``.
    products
        How decode steps multiply the model's weights (:mod:`alisa.ops.products`):
        ``"measured"`` on a CPU (both forms tried per batch size, the faster kept), else
        ``"standard"`` (as the model calls them).
    parts
        The compiled selection (:attr:`select`), the host fetch and the attention history
        split each call's rows into this many parts, run in parallel (a test asks for more
        than the machine's threads); None, the default: the count
        :func:`~alisa.ops.cpu.kernel_parts` picks from torch's threads. Only with ``compiled``.
    operators
        A static (compiled) decode step calls the CPU's compiled kernels as PyTorch operators
        (:mod:`alisa.ops.library`): its attention over a float32 region, dropping's choice
        of victims and host retention's choice, swap and fetch; False: the compiler traces
        PyTorch's (:mod:`alisa.ops.reference`).
    traced
        The choices of a static cache, whose decode step ``torch.compile`` may trace (a CPU
        backend's step then runs no numba kernel but through :attr:`operators` and the weights'
        product operator).
    select
        Host retention's selection of one layer, ``select(step: SelectionStep) -> Selected``
        (:mod:`alisa.ops.reference`): a plain function bound once from the choices above, so a
        decode step runs it without asking which kernels to use.
    evict
        Dropping's choice of one layer's victims, ``evict(step: Eviction) -> (slots, taken)``
        (:func:`alisa.ops.reference.evict`), bound once as :attr:`select` is: compiled with
        ``compiled``.
    add_sums
        Dropping's attention sums of one layer, ``add_sums(total, probabilities, keep,
        head_max)`` (:func:`alisa.ops.reference.add_sums`), bound as :attr:`evict` is.
    evict_static
        A static step's choice, ``evict_static(scores, positions, first, seen, recent, sinks)
        -> (B, Hs, 1) slots`` (:func:`alisa.ops.reference.evict_one`), every number a device
        tensor: the operator with ``operators``.
    """

    name: str
    device: str
    product: str
    compiled: bool
    fused: bool
    mapped: bool
    placing: bool
    feature: str = ""
    products: str = "standard"
    parts: int | None = None
    operators: bool = False
    traced: bool = False
    pinned: bool = field(init=False)
    branches: bool = field(init=False)
    select: Callable[[reference.SelectionStep], reference.Selected] = field(
        init=False, repr=False, compare=False
    )
    evict: Callable[[reference.Eviction], tuple[torch.Tensor, torch.Tensor]] = field(
        init=False, repr=False, compare=False
    )
    add_sums: Callable[[torch.Tensor, torch.Tensor, np.ndarray | None, bool], None] = field(
        init=False, repr=False, compare=False
    )
    evict_static: Callable[..., torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.name not in KERNELS[1:]:
            raise ValueError(f"name={self.name!r} must be one of {', '.join(KERNELS[1:])}")
        if self.product not in PRODUCTS:
            raise ValueError(f"product={self.product!r} must be one of {', '.join(PRODUCTS)}")
        if self.product == "compiled" and self.device != "cpu":
            raise ValueError(f"product='compiled' runs on a CPU; the ops run on {self.device}")
        if self.compiled and self.device != "cpu":
            raise ValueError(f"compiled=True runs CPU kernels; the ops run on {self.device}")
        if self.fused and not (self.compiled and self.product == "compiled"):
            raise ValueError("fused=True needs compiled=True and product='compiled'")
        if self.placing and not self.mapped:
            raise ValueError("placing=True needs mapped=True (it places rows the device reads)")
        if self.mapped and self.device == "cuda" and not triton_installed():
            raise ValueError("mapped=True on CUDA reads host rows by a Triton kernel: no Triton")
        if self.products not in FORMS:
            raise ValueError(f"products={self.products!r} must be one of {', '.join(FORMS)}")
        if self.products != "standard" and self.device != "cpu":
            raise ValueError(f"products={self.products!r} runs on a CPU, not {self.device}")
        if self.operators and (self.device != "cpu" or self.compiled or not self.traced):
            raise ValueError(
                "operators=True runs a static step's CPU kernels as operators: a CPU, "
                "traced=True and compiled=False (the eager step's kernels are not traced)"
            )
        if self.parts is not None and not self.compiled:
            raise ValueError(f"parts={self.parts!r} needs compiled=True (it splits kernel rows)")
        if self.parts is not None and (
            isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1
        ):
            raise ValueError(f"parts={self.parts!r} must be a whole number of at least 1 or None")
        object.__setattr__(self, "pinned", self.device == "cuda")
        object.__setattr__(self, "branches", self.device == "cpu")
        object.__setattr__(self, "select", self._bound_select())
        evict, add_sums = reference.evict, reference.add_sums
        if self.compiled:
            from alisa.ops import cpu

            evict = functools.partial(cpu.evict, parts=self.parts)
            add_sums = functools.partial(cpu.add_sums, parts=self.parts)
        object.__setattr__(self, "evict", evict)
        object.__setattr__(self, "add_sums", add_sums)
        evict_static = reference.evict_one
        if self.operators:
            from alisa.ops import library  # numba loads only where its kernels run

            evict_static = library.evict_one
        object.__setattr__(self, "evict_static", evict_static)

    def _bound_select(self) -> Callable[[reference.SelectionStep], reference.Selected]:
        """The selection these choices make, composed once from the backends' functions."""
        choose = reference.select_rule
        alone = functools.partial(reference.swapped, choose=choose)
        if self.compiled:
            from alisa.ops import cpu  # numba loads only where its kernels run

            choose, alone = cpu.select_rule, cpu.fused if self.fused else cpu.swapped
            if self.parts is not None:  # bound here: the default path gets no extra call
                choose = functools.partial(choose, parts=self.parts)
                alone = functools.partial(alone, parts=self.parts)
        if not self.mapped:
            return alone
        fetch = reference.fetch_placed
        place = functools.partial(reference.chosen_then_placed, choose=choose)
        if self.device == "cuda" or self.placing:
            from alisa.ops import cuda  # Triton loads on first launch only

            fetch = cuda.fetch_placed if self.device == "cuda" else fetch
            place = cuda.choose_and_place if self.placing else place
        return functools.partial(
            reference.placed, choose_and_place=place, fetch=fetch, otherwise=alone
        )

    def check_device(self, device: torch.device) -> None:
        """Refuse a model on another device than the one these kernels were chosen for."""
        if torch.device(device).type != self.device:
            raise ValueError(
                f"kernels={self.name!r} were chosen for {self.device}; the model is on {device}"
            )

    def describe(self, products: str | None = None) -> str:
        """One line naming the backend and its choices, e.g. ``cpu (numba): sketch product
        compiled (AVX2, no oneDNN bfloat16), selection in one call, weight products measured``;
        ``products``: what the weights' products settled on, said in place of ``weight products
        measured`` (:meth:`alisa.ops.products.WeightProducts.describe`, after a run)."""
        engine = {"reference": "pytorch", "cpu": "numba", "cuda": "triton"}[self.name]
        weights = "" if self.products == "standard" else f", weight products {self.products}"
        if products is not None:
            weights = f", {products}"
        if self.traced and self.name == "cpu":
            feature = f" ({self.feature})" if self.feature else ""
            static = "a static step's attention, eviction and host selection as operators"
            if not self.operators:
                static = "a static step's attention and eviction by PyTorch's operators"
            return f"{self.name} ({engine}): {static}{feature}{weights}"
        product = f"sketch product {self.product}"
        if self.feature:
            product += f" ({self.feature})"
        if self.fused:
            selection = "selection in one call"
        elif self.placing:
            selection = "choice and placement in one kernel"
        else:
            selection = "selection in separate calls"
        fetch = ", device-read fetch" if self.mapped else ""
        return f"{self.name} ({engine}): {product}, {selection}{fetch}{weights}"


def model_ops(model: torch.nn.Module, kernels: str = "auto", *, traced: bool = False) -> Ops:
    """:func:`choose_ops` for a model's cache: its weights' device and dtype (its KV's).

    ``traced``: the cache's decode step runs under ``torch.compile`` (a static cache,
    :mod:`alisa.kv.static`), as :func:`choose_ops` takes it.
    """
    weight = next(model.parameters())
    return choose_ops(weight.device, weight.dtype, kernels, traced=traced)


def compile_mode(device: torch.device | str) -> str:
    """``torch.compile``'s mode for a decode step on ``device``: ``"reduce-overhead"`` (CUDA
    graphs: on a GPU the step's cost is launching its kernels) on CUDA, else ``"default"`` (on
    a CPU ``reduce-overhead`` measured 6.6x slower a step than ``default``, SmolLM2-135M fp32,
    B = 8 x 1,024: it guards and copies for graphs a CPU never records)."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "default"


def compiles_by_default(device: torch.device | str) -> tuple[bool, str]:
    """What ``compile="auto"`` picks for decode steps on ``device``, and why (issue 65).

    On CUDA a step is launch-bound (docs/gpu.md: the device busy 12-15 ms of a 60-100 ms eager
    step), which capturing it as a graph removes, as HF's ``generate`` does for a
    ``StaticCache``. On a CPU the compiled step measured 1.2-1.8x faster, but its first step
    took 15-240 s to compile (SmolLM2-135M, 2 cores; docs/compile.md): more than one
    ``generate`` call saves, so ``"auto"`` runs eager there and ``"on"`` is the user's call.
    """
    if torch.device(device).type == "cuda":
        return True, "auto: CUDA, where a captured step saves the kernel launches"
    return False, "auto: a CPU, where compiling the first step (15-240 s) outweighs what it saves"


def bands_match_sdpa(device: torch.device | str) -> bool:
    """Whether a sliding-window prefill by bands of 512 keys (:mod:`alisa.kv.banded`) gives
    SDPA's full call bit for bit on ``device``: on a CPU, whose flash kernel adds a row's keys
    in blocks of 512; not on CUDA, whose kernels split keys by other rules (on an H200 the
    bfloat16 outputs differed in 3 % of elements: docs/gpu.md, sixth run)."""
    return torch.device(device).type == "cpu"


def triton_installed() -> bool:
    """Whether Triton can be imported here (CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None


def available_ops() -> tuple[str, ...]:
    """The backends this machine can run: ``reference`` and ``cpu`` always, ``cuda`` with a
    CUDA device and Triton."""
    cuda = torch.cuda.is_available() and triton_installed()
    return ("reference", "cpu", "cuda") if cuda else ("reference", "cpu")


@functools.cache
def cpu_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (AVX-512 BF16, AMX, Arm BF16).

    Without it a bfloat16 product falls back to a slow path: on an AVX2-only AMD EPYC the
    sketch product of SmolLM2-135M's shapes took 3-7 times as long as widening to float32, where
    an AVX-512 BF16 CPU ran bfloat16 2.2 times faster than float32 (docs/host-speed.md).
    """
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_feature() -> str:
    """This CPU's capability as torch reports it, and its bfloat16 support (for the record)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability}, {'oneDNN bfloat16' if cpu_bfloat16() else 'no oneDNN bfloat16'}"


def choose_ops(
    device: torch.device | str, dtype: torch.dtype, kernels: str = "auto", *, traced: bool = False
) -> Ops:
    """The kernels a cache on ``device`` with ``dtype`` keys runs.

    Parameters
    ----------
    device
        The model's device.
    dtype
        The model's (keys') dtype: the one compiled selection call takes float32 keys only.
    kernels
        ``"auto"`` (``cuda`` on a CUDA device with Triton, ``cpu`` on a CPU, else
        ``reference``), or a backend name of :data:`KERNELS` to force it.
    traced
        The decode step runs under ``torch.compile`` (a static cache), which cannot trace
        numba's kernels: ``cpu`` then runs the step's attention and eviction as registered
        operators (:attr:`Ops.operators`) and PyTorch's operators for the rest; ``auto`` traces
        PyTorch's operators for the step on a CPU, which inductor compiles into faster code at
        one sequence (SmolLM2-135M, B = 1 x 2,048, SWA r = 0.2: 56 against 61 ms a step) and
        as fast at sixteen (docs/compile.md). Both take the weights' products by the row
        kernel's operator where measured faster (:attr:`Ops.products`).

    Returns
    -------
    Ops
        The backend and its choices.

    Raises
    ------
    ValueError
        An unknown name, or a backend this device or machine cannot run (the message names
        the field, the value and what this machine runs).
    """
    device = torch.device(device)
    runs = ", ".join(available_ops())
    if kernels not in KERNELS:
        raise ValueError(
            f"kernels={kernels!r} must be one of {', '.join(KERNELS)} (this machine runs {runs})"
        )
    name = kernels
    if kernels == "auto":
        if device.type == "cuda" and triton_installed():
            name = "cuda"
        elif device.type == "cpu":
            name = "cpu"
        else:
            name = "reference"
    if name in ("cpu", "cuda") and device.type != name:
        raise ValueError(
            f"kernels={kernels!r} runs on a {'CUDA device' if name == 'cuda' else 'CPU'}; the "
            f"model is on {device} (this machine runs {runs})"
        )
    if name == "cuda" and not triton_installed():
        raise ValueError(
            f"kernels='cuda' needs Triton, which is not installed (this machine runs {runs})"
        )
    if name == "cpu" and traced:
        return Ops(
            name=name,
            device="cpu",
            product="float32",
            compiled=False,
            fused=False,
            mapped=False,
            placing=False,
            feature=cpu_feature(),
            # "auto" traces PyTorch's operators for the step's attention and eviction (see
            # traced); either way the weights' products take the row kernel where measured
            # faster (alisa.ops.products.WeightProducts.graph_pass).
            operators=kernels == "cpu",
            traced=True,
            products="measured",
        )
    if name == "cpu":
        # A float32 model's selection in one call beats PyTorch's bfloat16 product in separate
        # calls even where oneDNN has it (an AVX-512 BF16 EPYC, stop 81: host retention 1.32x
        # the fastest HF cache against 1.11-1.12x, docs/host-speed.md).
        one_call = dtype == torch.float32
        product = "bfloat16" if cpu_bfloat16() and not one_call else "compiled"
        fused = product == "compiled" and one_call
        return Ops(
            name=name,
            device="cpu",
            product=product,
            compiled=True,
            fused=fused,
            mapped=False,
            placing=False,
            feature=cpu_feature(),
            # Which form of the weights' product a BLAS runs faster differs by CPU, BLAS and
            # batch size, by up to 3.7x (alisa.ops.products): measured, never assumed.
            products="measured",
        )
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        product = "bfloat16"
    else:  # the bfloat16 elements widen exactly: only the sum's rounding differs
        product = "float32"
    cuda = name == "cuda"
    return Ops(
        name=name,
        device=device.type,
        product=product,
        compiled=False,
        fused=False,
        mapped=cuda,
        placing=cuda,
        feature=cpu_feature() if device.type == "cpu" else "",
        traced=traced,
    )
