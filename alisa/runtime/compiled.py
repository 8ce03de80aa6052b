"""A decode step run by ``torch.compile``: one graph per batch size and cache capacity.

Caches whose decode step has fixed shapes (``is_compileable``: HF's ``StaticCache``, and an
``AlisaCache`` built with ``max_cache_len``, :mod:`alisa.kv.static`) can
run it compiled, as HF's ``generate`` does on CUDA and engines that capture the step (vLLM,
gpt-fast) do; prefill stays eager, since every prompt length would be a new graph. The padding
mask grows by one column a step, which would make every step a new shape; it is padded to the
cache's capacity instead (a zero column is a slot not written yet, which the causal mask hides
anyway), so the compiler sees one shape from the first decode step to the last. Compiling is
measured, not assumed: the seconds of each shape's first compiled step (tracing and code
generation included) add up in :attr:`CompiledDecode.compile_s`. See issue 65 and
https://pytorch.org/docs/stable/torch.compiler.html.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from alisa.checks import check_int
from alisa.kv.attention import route_to_alisa
from alisa.kv.cache import AlisaCache
from alisa.model.loading import context_length
from alisa.ops import COMPILE
from alisa.ops.backends import compile_mode, compiles_by_default
from alisa.ops.products import GraphPass
from alisa.settings import IgnoredSettingWarning

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CompileChoice:
    """Whether decode steps run compiled, as asked and as settled.

    Attributes
    ----------
    asked
        ``"auto"``, ``"on"`` or ``"off"``.
    compiled
        Whether the steps run through :class:`CompiledDecode`.
    reason
        Why (``"asked"``, or what ``"auto"`` read: the device, a mode without a static step).
    settled
        ``"auto"`` would have compiled on this device, and the cache or the batching made it
        eager (:meth:`eager`): worth saying where the device's default goes unsaid.
    """

    asked: str
    compiled: bool
    reason: str
    settled: bool = False

    def describe(self) -> str:
        """``on (asked)``, ``off (auto: a CPU, ...)``: for ``--show-config`` and the results."""
        return f"{'on' if self.compiled else 'off'} ({self.reason})"

    def eager(self, why: str) -> CompileChoice:
        """``"auto"`` settled eager because of ``why`` (a cache without a static step)."""
        return replace(self, compiled=False, reason=f"auto: {why}", settled=True)


# The smallest capacity of a compiled step's static cache, in tokens per row.
SMALLEST_CAPACITY = 128


def compiled_capacity(tokens: int, context: int | None) -> int:
    """Tokens per row the static cache of a compiled run holds when its longest row needs
    ``tokens`` (prompt, padding and new tokens): the next of 2^k and 3 * 2^(k-1) at or above
    it, at least :data:`SMALLEST_CAPACITY`, at most ``context`` (the model's, None: unknown)
    unless ``tokens`` is more.

    A compiled step has one graph per batch size and capacity; rounding up by at most half
    lets calls and batches of nearby lengths replay one graph instead of compiling their own
    (15-240 s each on a CPU, about a minute on an H200: docs/compile.md, docs/gpu.md; and
    torch.compile stops compiling a function after 8 shapes), for at most half again the
    slots of the exact size.
    """
    capacity = SMALLEST_CAPACITY
    while capacity < tokens:  # 2^k -> 3 * 2^(k-1) -> 2^(k+1)
        capacity = capacity * 3 // 2 if capacity & (capacity - 1) == 0 else capacity * 4 // 3
    return capacity if context is None else max(min(capacity, context), tokens)


def static_capacity(model: nn.Module, tokens: int | None) -> int:
    """Tokens per row of the static caches of a compiled run whose rows need at most ``tokens``
    (prompt, padding and new tokens): its capacity bucket (:func:`compiled_capacity`); None:
    the model's context.

    Raises
    ------
    ValueError
        ``tokens`` not an integer >= 1, or None for a model whose context is not known
        (naming ``max_cache_len``).
    """
    known = context_length(model)
    context = None if known is None else known[0]
    if tokens is None:
        if context is None:
            raise ValueError(
                "max_cache_len=None: the model's context is not known, so a compiled step's "
                "static caches need their length: give max_cache_len"
            )
        tokens = context
    check_int("max_cache_len", tokens, minimum=1)
    return compiled_capacity(tokens, context)


def static_row_note(max_cache_len: int) -> str:
    """Why a row of compiled continuous batching needs more than its length would: what a
    refusal quotes (:mod:`alisa.runtime.continuous`)."""
    return (
        f"compiled steps hold each row in a static cache of max_cache_len={max_cache_len} "
        "tokens whatever its length; compile off sizes rows by their own length"
    )


def rows_capacity(model: nn.Module, choice: CompileChoice, max_cache_len: int | None) -> int | None:
    """Tokens per row of the static caches of a continuous-batching run (``stream_generate``,
    the server) whose decode steps settled as ``choice``: :func:`static_capacity`, or None
    where the steps run eager over growing caches.

    A ``max_cache_len`` is checked either way, and one given to eager steps, which never read
    it, is said with an :class:`~alisa.settings.IgnoredSettingWarning` (a setting accepted
    and ignored is a silent wrong result to its user).
    """
    if max_cache_len is not None:
        check_int("max_cache_len", max_cache_len, minimum=1)
    if choice.compiled:
        return static_capacity(model, max_cache_len)
    if max_cache_len is not None:
        warnings.warn(
            f"max_cache_len={max_cache_len} has no effect: the decode steps run eager over "
            f"growing caches (compile {choice.describe()}), and only compiled steps' static "
            "caches take their length from it",
            IgnoredSettingWarning,
            stacklevel=3,
        )
    return None


def batch_bucket(rows: int, most: int | None = None) -> int:
    """Rows of the compiled step that runs ``rows`` running rows: the next power of two at or
    above it, at most ``most`` (the rows the admission rule allows; None: no bound). Continuous
    batching fills the difference with copies of its last row (their tokens are not read), so
    a batch whose rows come and go replays a few graphs (one per bucket, as nano-vllm's
    captured batch sizes) instead of compiling one per size, for at most twice the rows'
    compute and KV (which admission counts).
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be an integer >= 1")
    bucket = 1 << (rows - 1).bit_length()
    return bucket if most is None else max(rows, min(bucket, most))


def compiled_decode(model: nn.Module, choice: CompileChoice | None) -> CompiledDecode | None:
    """The model's decode step compiled as ``choice`` settled (its device's mode:
    :func:`alisa.ops.backends.compile_mode`), or None where it runs eager (or ``choice`` is
    None)."""
    if choice is None or not choice.compiled:
        return None
    return CompiledDecode(model, compile_mode(next(model.parameters()).device), choice)


# compile="on", as asked: what a caller that compiles regardless of the device passes.
ASKED_ON = CompileChoice(asked="on", compiled=True, reason="asked")


def check_compile(compile: object) -> None:
    """Refuse a ``compile`` setting other than ``"auto"``, ``"on"``, ``"off"``, naming it
    (``generate``'s argument, ``BatchJob.compile``)."""
    if not isinstance(compile, str) or compile not in COMPILE:
        raise ValueError(f"compile={compile!r} must be one of {', '.join(map(repr, COMPILE))}")


def choose_compile(compile: str, device: torch.device | str) -> CompileChoice:
    """``compile`` resolved for ``device``: ``"on"`` and ``"off"`` as asked, ``"auto"`` by
    :func:`alisa.ops.backends.compiles_by_default`.

    Raises
    ------
    ValueError
        ``compile`` is not one of ``"auto"``, ``"on"``, ``"off"`` (naming it).
    """
    check_compile(compile)
    if compile != "auto":
        return CompileChoice(asked=compile, compiled=compile == "on", reason="asked")
    compiled, reason = compiles_by_default(device)
    return CompileChoice(asked=compile, compiled=compiled, reason=reason)


def check_compileable(cache) -> None:
    """Refuse a cache whose decode step cannot be compiled, naming it.

    Raises
    ------
    ValueError
        The cache says ``is_compileable = False`` (``DynamicCache`` grows every step;
        ``AlisaCache``'s step is not yet static).
    """
    if not cache.is_compileable:
        raise ValueError(
            f"compile='on': {type(cache).__name__}'s decode step cannot be compiled (its shapes "
            "change from step to step); use compile='off', an AlisaCache built with "
            "max_cache_len, or an HF StaticCache as past_key_values"
        )


def settle_compile(choice: CompileChoice, cache) -> CompileChoice:
    """``choice`` for the cache the steps run over: ``"auto"`` runs eager over a cache that
    cannot be compiled (naming why), ``"on"`` refuses it (:func:`check_compileable`)."""
    if not choice.compiled or cache.is_compileable:
        return choice
    if choice.asked == "auto":
        return choice.eager(f"{type(cache).__name__}'s step changes shape")
    check_compileable(cache)
    return choice


def last_logits(
    forward: Callable,
    feed: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    cache,
    **options,
) -> torch.Tensor:
    """(B, V) last-position logits of a forward pass (the model's, eager or compiled) feeding
    ``feed`` (B, q) at ``positions`` (B, q) over ``cache``; ``options`` reach attention."""
    return forward(
        input_ids=feed,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **options,
    ).logits[:, -1, :]


class CompiledDecode:
    """The model's forward for decode steps, compiled once per shape (``fullgraph=True``).

    Parameters
    ----------
    model
        An HF causal LM; its ``forward`` is wrapped, the model is not changed.
    mode
        ``torch.compile``'s mode (:func:`alisa.ops.backends.compile_mode` of the model's
        device).
    choice
        What was asked (:func:`choose_compile`): under ``"auto"`` a model whose step the
        compiler cannot trace runs eager with one warning; under ``"on"`` it is refused.

    Attributes
    ----------
    compile_s
        Seconds of the first compiled step of each shape (rows and cache capacity: a new
        graph, tracing and code generation included), added up; None before the first.
    choice
        As given, or settled eager (``choice.compiled`` False, the reason said) once the
        compiler could not trace the step under ``"auto"``.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        choice: CompileChoice | None = None,
        *,
        backend: str = "inductor",
    ) -> None:
        self.model, self.mode, self.backend = model, mode, backend
        self.choice = choice or ASKED_ON
        self.compile_s: float | None = None
        self._shapes: set[tuple[int, int, bool]] = set()  # (rows, capacity, pass) of the graphs
        self._forwards: dict[GraphPass | None, Callable] = {}  # compiled forward by graph pass
        # Whether torch.compile's recompile limit was reached (said once; see __call__).
        self.limited = False

    def forward(self, graph_pass: GraphPass | None = None) -> Callable:
        """The model's forward compiled, made at its first use: ``torch.compile`` with
        ``fullgraph=True``, static shapes and this decode step's mode, or with ``graph_pass``
        rewriting each graph dynamo traces before the backend compiles it. Dynamo keeps a graph
        to the backend that made it, so a batch size compiled both with a pass and without one
        keeps both graphs, and neither is replayed for the other.

        Raises
        ------
        ValueError
            A ``graph_pass`` under CUDA graphs (``mode="reduce-overhead"``): the passes are the
            CPU's (:func:`alisa.ops.products.route_linears`).
        """
        forward = self._forwards.get(graph_pass)
        if forward is not None:
            return forward
        if graph_pass is None:
            options = {"mode": self.mode} if self.backend == "inductor" else {}
            backend = self.backend
        elif self.mode != "default":
            raise ValueError(f"a graph pass runs under mode='default', not {self.mode!r}")
        else:
            options = {}
            backend = partial(_rewritten, graph_pass, torch._dynamo.lookup_backend(self.backend))
        forward = torch.compile(
            self.model.forward, backend=backend, fullgraph=True, dynamic=False, **options
        )
        self._forwards[graph_pass] = forward
        return forward

    def __call__(
        self,
        feed: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache,
        clock: Callable[[], float],
        graph_pass: GraphPass | None = None,
        **options,
    ) -> torch.Tensor:
        """(B, V) last-position logits of one decode step.

        Parameters
        ----------
        feed, positions
            (B, 1) the rows' next token ids and their positions.
        mask
            (B, L) padding mask of the L positions fed so far, or None (no padding).
        cache
            A compileable cache (:func:`check_compileable`) that holds the rows' past.
        clock
            Seconds after the device caught up (times the first, compiling step).
        graph_pass
            A rewrite of the graph dynamo traces, before it is compiled
            (:meth:`alisa.ops.products.WeightProducts.graph_pass`); None: none.
        options
            Extra model keyword arguments (they reach attention).

        Raises
        ------
        ValueError
            The cache is not compileable, or the compiler cannot trace the model in one graph
            and ``compile="on"`` was asked.
        """
        check_compileable(cache)
        if isinstance(cache, AlisaCache):  # the host's half of its step (no hook runs here)
            cache.begin_forward(feed.shape[0], feed.shape[1], mask, model=self.model)
            route_to_alisa(self.model)
        if mask is not None:
            mask = nn.functional.pad(mask, (0, cache.get_max_length() - mask.shape[1]))

        def eager() -> torch.Tensor:
            """The same forward, eager: the host's half is done, and no hook runs."""
            return last_logits(self.model.forward, feed, positions, mask, cache, **options)

        if not self.choice.compiled:  # "auto" found the step untraceable: eager from then on
            return eager()
        shape = (feed.shape[0], cache.get_max_length(), graph_pass is not None)
        start = clock() if shape not in self._shapes else None
        if start is not None:  # minutes on a CPU: say why the first step is slow
            logger.info(
                "compiling the decode step for %d rows of %d slots (the first step of each "
                "shape; 15-240 s on a 2-core CPU, less from torch's compile cache)",
                *shape[:2],
            )
        forward = self.forward(graph_pass)
        try:
            logits = last_logits(forward, feed, positions, mask, cache, **options)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # A new shape past torch.compile's limit of graphs per function (8 by default;
            # fullgraph=True makes it an error): this step runs eager, with the same tokens,
            # and the run goes on.
            if not self.limited:
                self.limited = True
                warnings.warn(
                    "compile: torch.compile's recompile limit "
                    f"({torch._dynamo.config.recompile_limit} shapes of the decode step) is "
                    "reached: steps of new batch sizes and capacities run eager from here (the "
                    "same tokens); raise torch._dynamo.config.recompile_limit to compile more",
                    RuntimeWarning,
                    stacklevel=2,
                )
            logits = eager()
        except torch._dynamo.exc.Unsupported as error:
            name = type(self.model).__name__
            why = f"torch.compile cannot trace {name}'s decode step in one graph"
            first = str(error).splitlines()[0]
            if self.choice.asked != "auto":
                raise ValueError(
                    f"compile={self.choice.asked!r}: {why} ({first}); use compile='off'"
                ) from error
            # "auto" asked for speed, not for compiling: eager, now and for the rest of the
            # run, said once.
            warnings.warn(
                f"compile='auto': {why} ({first}); its decode steps run eager",
                RuntimeWarning,
                stacklevel=2,
            )
            self.choice = self.choice.eager(why)
            return eager()
        if start is not None:
            self._shapes.add(shape)
            self.compile_s = (self.compile_s or 0.0) + clock() - start
        return logits


def _rewritten(
    graph_pass: GraphPass, compiler: Callable, graph: torch.fx.GraphModule, inputs: list
) -> Callable:
    """A ``torch.compile`` backend: ``graph_pass`` over the graph dynamo traced, then
    ``compiler`` (a backend by name, ``torch._dynamo.lookup_backend``) over the result."""
    graph_pass(graph, inputs)
    return compiler(graph, inputs)
