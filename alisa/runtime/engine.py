"""The one decode loop: prefill, step, pick, output.

``generate``, both parallel decodes (local and sharded) and the profiler's step timing all run
their forward passes through :class:`Engine`, so every path builds masks and positions, picks
tokens, stops at EOS and times steps (device synchronised before the clock is read) alike.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from alisa.checks import check_int, check_number
from alisa.kv.cache import TIERS, AlisaCache
from alisa.memory import tensor_bytes
from alisa.ops.products import SETTLING, WeightProducts
from alisa.runtime.compiled import CompileChoice, CompiledDecode, compiled_decode, last_logits
from alisa.runtime.sampling import SamplingOptions, TokenPicker


@dataclass(kw_only=True)
class GenerationOutput:
    """What one ``generate`` call produced and what it cost.

    Attributes
    ----------
    texts
        Decoded completions (prompt excluded, stopped at EOS).
    token_ids
        Generated token ids per prompt, EOS included when emitted.
    prompt_tokens
        Prompt length in tokens per prompt (padding excluded).
    finish_reasons
        ``"stop"`` (EOS) or ``"length"`` (max_new_tokens reached) per prompt.
    ttft_s
        Time to first token: prefill plus picking the first token, seconds.
    step_times_s
        Wall time of each later decode step, seconds.
    kv_bytes, peak_kv_bytes
        KV bytes the cache held at the end, and at most after any step.
    kv_tier_bytes
        KV bytes at the end per tier: ``device`` (what the model's device holds, the key
        sketch of ``retention="host"`` included) and ``host`` (host region or host tier);
        ``recompute`` when tiers recompute. Foreign caches count all on the device.
    peak_memory_bytes
        Peak resident memory of the process (CPU) or peak CUDA allocation (GPU) during the call.
    kernels
        The kernels the cache ran (:meth:`alisa.ops.backends.Ops.describe`, e.g. ``cpu
        (numba): sketch product compiled (AVX2, no oneDNN bfloat16), selection in one call``)
        and, where measured, the form the weights' products settled on per batch size
        (:meth:`alisa.ops.products.WeightProducts.describe`); ``"none (not an AlisaCache)"``
        for another cache.
    compile_s
        Seconds of the first compiled decode step (tracing and code generation included;
        :mod:`alisa.runtime.compiled`); None when the steps ran eager.
    compile
        Whether the decode steps ran compiled, as asked and why
        (:class:`~alisa.runtime.compiled.CompileChoice`; ``describe()`` gives e.g. ``off
        (auto: a CPU, ...)``); None where the caller did not choose (the engine alone).
    """

    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: list[int]
    finish_reasons: list[str]
    ttft_s: float
    step_times_s: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    peak_kv_bytes: int = 0
    kv_tier_bytes: dict[str, int] = field(default_factory=dict)
    peak_memory_bytes: int = 0
    kernels: str = ""
    compile_s: float | None = None
    compile: CompileChoice | None = None

    def __post_init__(self) -> None:
        # Built by hand too (it is exported; callers and tests assemble one): a bad value would
        # surface later as an unrelated TypeError in ``total_s`` or a wrong count.
        _check_list("token_ids", self.token_ids, list)
        rows = len(self.token_ids)
        for name, kind in (("texts", str), ("prompt_tokens", int), ("finish_reasons", str)):
            _check_list(name, getattr(self, name), kind, rows=rows)
        for i, ids in enumerate(self.token_ids):
            _check_list(f"token_ids[{i}]", ids, int)
        _check_list("step_times_s", self.step_times_s, float)
        for i, reason in enumerate(self.finish_reasons):
            if reason not in FINISH_REASONS:
                raise ValueError(f"finish_reasons[{i}]={reason!r} must be one of {FINISH_REASONS}")
        for name in ("ttft_s", "kv_bytes", "peak_kv_bytes", "peak_memory_bytes"):
            _check_amount(name, getattr(self, name))
        if self.compile_s is not None:
            _check_amount("compile_s", self.compile_s)
        if not isinstance(self.kv_tier_bytes, dict):
            raise ValueError(f"kv_tier_bytes={self.kv_tier_bytes!r} must be a dict of bytes")
        for tier, size in self.kv_tier_bytes.items():
            if tier not in TIERS:
                raise ValueError(f"kv_tier_bytes has tier {tier!r}; the tiers are {TIERS}")
            _check_amount(f"kv_tier_bytes[{tier!r}]", size)
        if not isinstance(self.kernels, str):
            raise ValueError(f"kernels={self.kernels!r} must be a string")
        if self.compile is not None and not isinstance(self.compile, CompileChoice):
            raise ValueError(f"compile={self.compile!r} must be a CompileChoice or None")

    @property
    def generated_tokens(self) -> int:
        """Tokens generated over all prompts."""
        return sum(len(ids) for ids in self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the decode steps after the first token (all sequences)."""
        decode_time = sum(self.step_times_s)
        later_tokens = self.generated_tokens - len(self.token_ids)
        return later_tokens / decode_time if decode_time > 0 else 0.0

    @property
    def total_s(self) -> float:
        """Prefill plus decode time."""
        return self.ttft_s + sum(self.step_times_s)


FINISH_REASONS = ("stop", "length")  # what a row of GenerationOutput may end with


def _check_list(name: str, value: object, kind: type, *, rows: int | None = None) -> None:
    """``value`` is a list of ``kind`` (``rows`` long when given); numbers finite and >= 0."""
    if not isinstance(value, list):
        raise ValueError(f"{name}={value!r} must be a list")
    if rows is not None and len(value) != rows:
        raise ValueError(f"{name} has {len(value)} rows but token_ids has {rows}: one per prompt")
    for i, item in enumerate(value):
        if type(item) is kind and (item >= 0 if kind is int else kind is not float):
            continue  # the common case, cheap: a long generation has many token ids
        if kind is int:
            check_int(f"{name}[{i}]", item, minimum=0)
        elif kind is float:
            _check_amount(f"{name}[{i}]", item)
        elif not isinstance(item, kind):
            raise ValueError(f"{name}[{i}]={item!r} must be a {kind.__name__}")


def _check_amount(name: str, value: object) -> None:
    """``value`` is a finite number >= 0 (a time, a byte count)."""
    check_number(name, value)
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0")


def cache_kv_bytes(cache) -> int:
    """KV bytes held by an ALISA cache or any HF cache (quantized layers' packed data included)."""
    if isinstance(cache, AlisaCache):
        return cache.kv_bytes()
    # A foreign HF cache: its layer classes differ (dynamic, quanto, hqq, ...), so read what
    # each one has.
    total = 0
    for layer in getattr(cache, "layers", []):
        total += tensor_bytes((layer.keys, layer.values))
        for name in ("_quantized_keys", "_quantized_values"):
            total += _nested_bytes(getattr(layer, name, None))
    return total


def cache_kernels(cache) -> str:
    """The kernels ``cache`` runs, in words (:attr:`GenerationOutput.kernels`)."""
    if isinstance(cache, AlisaCache):
        return cache.ops.describe()
    return "none (not an AlisaCache)"


def cache_tier_bytes(cache, device: torch.device) -> dict[str, int]:
    """KV bytes per tier (:attr:`GenerationOutput.kv_tier_bytes`) of an ALISA cache, or of any
    other cache by where its tensors are (:func:`foreign_tier_bytes`)."""
    if isinstance(cache, AlisaCache):
        return cache.tier_bytes()
    return foreign_tier_bytes(cache, device)  # foreign or sharded caches


def foreign_tier_bytes(cache, device: torch.device) -> dict[str, int]:
    """``{"device": ..., "host": ...}`` KV bytes of an HF cache by where its tensors are (HF's
    offloaded cache keeps layers in CPU memory between uses)."""
    total = cache_kv_bytes(cache)
    host = 0
    if device.type != "cpu":
        for layer in getattr(cache, "layers", []):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if isinstance(keys, torch.Tensor) and keys.device.type == "cpu":
                host += tensor_bytes((keys, values))
    return {"device": total - host, "host": host}


def _nested_bytes(value, depth: int = 3) -> int:
    """Bytes of the tensors inside a backend's quantized object (quanto/hqq/fp8 layouts differ)."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value.nbytes
    # Tensor subclasses (quanto's QTensor) report their logical size: count what they wrap.
    if depth == 0 or value is None:
        return 0
    if isinstance(value, tuple | list):
        return sum(_nested_bytes(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return sum(_nested_bytes(v, depth - 1) for v in value.values())
    inner = getattr(value, "__dict__", None)
    return sum(_nested_bytes(v, depth - 1) for v in inner.values()) if inner else 0


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device has finished its queued work (CUDA is async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(kw_only=True)
class DecodeState:
    """The rows being decoded and what the next forward pass feeds them.

    Attributes
    ----------
    prompt_ids
        (B, L) prompt token ids (sampling processors read them).
    attention_mask
        (B, L + tokens fed so far) padding mask, or ``None`` for unpadded rows.
    feed
        (B, q) token ids of the next forward pass: the prompt, then one token per step.
    positions
        (B, q) positions of ``feed`` (left padding excluded from the count).
    active
        (B,) original batch row of each row (rows leave when finished ones are pruned).
    finished
        (B,) bool: the row has emitted EOS.
    generators
        One random generator per row when sampling is seeded (a row's draws are its own,
        whatever shares its batch), else None; set at the first pick.
    """

    prompt_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    feed: torch.Tensor
    positions: torch.Tensor
    active: torch.Tensor
    finished: torch.Tensor
    generators: list[torch.Generator] | None = None

    @classmethod
    def start(
        cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> DecodeState:
        """The state before prefill of ``input_ids`` (B, L), left-padded where the mask is 0."""
        batch, length = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            positions = torch.arange(length, device=device).expand(batch, length)
        else:
            positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        return cls(
            prompt_ids=input_ids,
            attention_mask=attention_mask,
            feed=input_ids,
            positions=positions,
            active=torch.arange(batch, device=device),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def prompt_tokens(self) -> list[int]:
        """Prompt length per row, padding excluded (call before the first :meth:`advance`)."""
        if self.attention_mask is None:
            return [self.prompt_ids.shape[1]] * self.prompt_ids.shape[0]
        return [int(n) for n in self.attention_mask.sum(dim=1).tolist()]

    def advance(self, tokens: torch.Tensor) -> None:
        """Feed ``tokens`` (B,) next, one position after the last fed one."""
        if self.attention_mask is not None:
            ones = self.attention_mask.new_ones(self.attention_mask.shape[0], 1)
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        self.feed, self.positions = tokens[:, None], self.positions[:, -1:] + 1

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows)."""
        self.prompt_ids, self.positions = self.prompt_ids[rows], self.positions[rows]
        self.active, self.finished = self.active[rows], self.finished[rows]
        self.feed = self.feed[rows]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[rows]
        if self.generators is not None:
            self.generators = [self.generators[row] for row in rows.tolist()]

    def filled(self, rows: int, *, mask: bool = True) -> DecodeState:
        """This state for a forward over ``rows`` rows, its last row repeated after the others
        (the copies a compiled step's bucket holds: :func:`~alisa.runtime.compiled.
        batch_bucket`), without its padding mask unless ``mask``; this state is unchanged."""
        count = self.feed.shape[0]
        if rows == count and (mask or self.attention_mask is None):
            return self
        index = torch.arange(rows, device=self.feed.device).clamp(max=count - 1)
        view = copy.copy(self)
        view.generators = None  # the copies draw nothing: only the rows' logits are read
        view.keep(index)
        if not mask:
            view.attention_mask = None
        return view

    def take(self, rows: torch.Tensor) -> DecodeState:
        """Rows ``rows`` leave into a state of their own (no padding mask: they are past their
        prefill); this state keeps the others, in order."""
        taken = copy.copy(self)
        taken.keep(rows)
        taken.attention_mask = None
        chosen = set(rows.tolist())
        rest = [row for row in range(len(self.active)) if row not in chosen]
        self.keep(torch.tensor(rest, device=rows.device, dtype=torch.long))
        return taken

    def extend(self, other: DecodeState, pad: int = 0) -> None:
        """Append ``other``'s rows (both past their prefill, one token to feed each).

        The merged state carries no padding mask: after prefill the ALISA attention masks by
        slot positions alone (each row's cache knows where its tokens are), and RoPE reads each
        row's own ``positions``, so rows of different lengths need no common width. Prompts
        are left-padded with ``pad`` to a common width (sampling processors read them).
        """
        width = max(self.prompt_ids.shape[1], other.prompt_ids.shape[1])
        prompts = [
            torch.nn.functional.pad(ids, (width - ids.shape[1], 0), value=pad)
            for ids in (self.prompt_ids, other.prompt_ids)
        ]
        self.prompt_ids = torch.cat(prompts)
        self.attention_mask = None
        self.feed = torch.cat([self.feed, other.feed])
        self.positions = torch.cat([self.positions, other.positions])
        self.active = torch.cat([self.active, other.active])
        self.finished = torch.cat([self.finished, other.finished])
        if self.generators is not None and other.generators is not None:
            self.generators = self.generators + other.generators


class Engine:
    """Runs decode steps of one model: forward, pick, stop at EOS, time, assemble the output.

    Parameters
    ----------
    model
        Any HF causal LM (its device and generation config are read once).
    tokenizer
        Decodes the output texts and supplies EOS/pad when the model's config lacks them;
        ``None`` is enough for :meth:`step` (profiling).
    sampling
        Greedy by default; see :class:`~alisa.runtime.sampling.SamplingOptions`.
    stop_at_eos
        False never stops a row early (benchmarks of equal work).
    compile
        Run decode steps compiled where it says so (:class:`~alisa.runtime.compiled.
        CompiledDecode`, which may settle ``"auto"`` eager for a model it cannot trace; the
        cache must be compileable); prefill stays eager. None: eager.
    products
        A measurement of the weights' product form to go on with (a server keeps one across
        the schedulers it starts, :mod:`alisa.serve.engine`); None: this engine measures its
        own once a decode step needs it.
    compiled
        A compiled decode step to go on with instead of ``compile`` (a server and a batch job
        keep one across the schedulers they start, whose graphs then compile once).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        sampling: SamplingOptions | None = None,
        *,
        stop_at_eos: bool = True,
        compile: CompileChoice | None = None,
        products: WeightProducts | None = None,
        compiled: CompiledDecode | None = None,
    ) -> None:
        if compile is not None and compiled is not None:
            raise ValueError("an Engine takes compile or compiled, not both")
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.compiled = compiled if compiled is not None else compiled_decode(model, compile)
        # The form of the weights' products, measured over this engine's decode steps where the
        # cache's kernels ask for it (alisa.ops.products); None until a step needs it.
        self.products = products
        self.pick = TokenPicker(model, sampling or SamplingOptions())
        eos = model.generation_config.eos_token_id
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_ids = eos_ids if stop_at_eos else []
        self.eos = torch.tensor(eos_ids, device=self.device, dtype=torch.long)
        self.eos_ids = frozenset(eos_ids)
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)

    def clock(self) -> float:
        """Seconds, read after the model's device has caught up."""
        return device_clock(self.device)

    def forward(self, state: DecodeState, cache, **options) -> torch.Tensor:
        """(B, V) last-position logits of feeding ``state.feed``; ``options`` reach attention."""
        feed, positions, mask = state.feed, state.positions, state.attention_mask
        # A decode step only: a one-token prompt's prefill feeds one token too, but writes an
        # empty cache (eager: its slots are laid out then, which a traced step cannot branch on).
        decode = feed.shape[1] == 1 and cache.get_seq_length() > 0
        products = self._products(cache) if decode else None
        if self.compiled is not None and decode:
            rewrite = None if products is None else products.graph_pass(feed.shape[0], self.model)
            return self.compiled(feed, positions, mask, cache, self.clock, rewrite, **options)
        if products is not None:
            with products.step(feed.shape[0], self.model):
                return last_logits(self.model, feed, positions, mask, cache, **options)
        return last_logits(self.model, feed, positions, mask, cache, **options)

    def _products(self, cache) -> WeightProducts | None:
        """The weights' product form of ``cache``'s decode steps, where its kernels ask for one
        (made, or remade for another ask, here); None: PyTorch's form, unmeasured."""
        if not isinstance(cache, AlisaCache) or cache.ops.products == "standard":
            return None
        if self.products is None or self.products.asked != cache.ops.products:
            self.products = WeightProducts(cache.ops.products)
        return self.products

    def settled(self, rows: int) -> bool:
        """Whether this engine's decode steps of ``rows`` rows run one weight-product form from
        now on (:meth:`WeightProducts.settled`; True before any step measured one): timings
        that compare steps are taken only then, never over steps that alternate forms."""
        return self.products is None or self.products.settled(rows)

    def settle(self, rows: int, step: Callable[[], None]) -> None:
        """Run ``step`` (one decode step of ``rows`` rows) until their weight-product form
        settles, :data:`~alisa.ops.products.SETTLING` steps at most: a warm-up before steps are
        timed in turns, which would otherwise each get one form."""
        for _ in range(SETTLING):
            if self.settled(rows):
                return
            step()

    def kernels(self, cache) -> str:
        """The kernels ``cache`` ran and, where they were measured, the weights' product form
        (:attr:`GenerationOutput.kernels`)."""
        if self.products is None or not isinstance(cache, AlisaCache):
            return cache_kernels(cache)
        return cache.ops.describe(products=self.products.describe())

    def forward_packed(
        self, running: DecodeState, newcomer: DecodeState, cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Last-position logits of a mixed forward (:mod:`alisa.kv.packed`): the running rows'
        next tokens and one newcomer's prompt fed as one (1, B + T) sequence.

        Parameters
        ----------
        running
            B rows past their prefill, one token each to feed (their padding mask is not
            read: after its prefill an ALISA cache masks by slot positions).
        newcomer
            One unpadded prompt (1, T) before its prefill.
        cache
            A :class:`~alisa.kv.cache.PackedCache` of the two rows' caches.

        Returns
        -------
        tuple
            ((B, V) the running rows' logits, (1, V) the newcomer's).
        """
        rows = running.feed.shape[0]
        if running.feed.shape[1] != 1:
            raise ValueError("a mixed forward takes running rows past their prefill")
        if newcomer.feed.shape[0] != 1 or newcomer.attention_mask is not None:
            raise ValueError("a mixed forward prefills one unpadded prompt")
        feed = torch.cat([running.feed.view(1, rows), newcomer.feed], dim=1)
        positions = torch.cat([running.positions.view(1, rows), newcomer.positions], dim=1)
        keep = torch.arange(rows + 1, device=feed.device)
        keep[-1] = feed.shape[1] - 1  # the newcomer's last prompt token
        logits = self.model(
            input_ids=feed,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        ).logits[0]
        return logits[:rows], logits[rows:]

    def choose(self, state: DecodeState, logits: torch.Tensor) -> torch.Tensor:
        """(B,) next tokens from ``logits`` (B, V); finished rows get pad, EOS finishes a row."""
        if state.generators is None:
            state.generators = self.pick.row_generators(logits.shape[0])
        tokens = self.pick(state.prompt_ids, logits, state.generators)
        tokens = torch.where(state.finished, self.pad, tokens)
        state.finished |= torch.isin(tokens, self.eos)
        return tokens

    def step(self, state: DecodeState, cache, **options) -> torch.Tensor:
        """One forward pass and pick: (B,) the tokens chosen (``state`` is not advanced)."""
        return self.choose(state, self.forward(state, cache, **options))

    def run(
        self,
        state: DecodeState,
        cache,
        max_new_tokens: int,
        *,
        prune: bool = False,
        prefill_logits: torch.Tensor | None = None,
        prefill_s: float = 0.0,
        kv_bytes: Callable[[], int] | None = None,
        announce: Callable[[bool], None] | None = None,
        observe: Callable[[torch.Tensor], None] | None = None,
        **options,
    ) -> GenerationOutput:
        """Prefill (unless ``prefill_logits`` (B, V) are given) and decode up to ``max_new_tokens``.

        Parameters
        ----------
        state
            From :meth:`DecodeState.start`; advanced in place.
        cache
            ``past_key_values`` of every forward pass.
        prune
            Drop finished rows from the batch (and the cache) before the next step.
        prefill_logits, prefill_s
            Logits and seconds of a prefill already run elsewhere (parallel prefill).
        kv_bytes
            Reads the KV bytes held (default: :func:`cache_kv_bytes` of ``cache``).
        announce
            Told before each later forward pass whether one follows (sharded decode workers).
        observe
            Shown each step's (B, V) logits before its tokens are chosen (diagnostics such as
            ``probes.ruler_probe``; nothing in the loop waits on it).
        options
            Extra model keyword arguments of every forward pass (they reach attention).
        """
        kv_bytes = kv_bytes or partial(cache_kv_bytes, cache)
        prompt_tokens = state.prompt_tokens()
        generated = torch.full(
            (state.feed.shape[0], max_new_tokens), self.pad, dtype=torch.long, device=self.device
        )
        times, peak_kv, steps = [], 0, 0
        for step in range(max_new_tokens):
            start = self.clock()
            if step == 0 and prefill_logits is not None:
                logits = prefill_logits
            else:
                logits = self.forward(state, cache, **options)
            if observe is not None:
                observe(logits)
            tokens = self.choose(state, logits)
            generated[state.active, step] = tokens
            times.append(self.clock() - start)
            steps, peak_kv = step + 1, max(peak_kv, kv_bytes())
            more = steps < max_new_tokens and not bool(state.finished.all())
            if announce is not None:
                announce(more)
            if not more:
                break
            if prune and bool(state.finished.any()):
                tokens = _drop_finished(state, cache, tokens)
            state.advance(tokens)
        ttft = prefill_s + (times[0] if times else 0.0)
        result = self.output(
            generated[:, :steps], prompt_tokens, ttft, times[1:], kv_bytes(), peak_kv
        )
        result.kv_tier_bytes = cache_tier_bytes(cache, self.device)
        result.kernels = self.kernels(cache)
        result.compile_s = self.compiled.compile_s if self.compiled is not None else None
        return result

    def output(
        self,
        generated: torch.Tensor,
        prompt_tokens: list[int],
        ttft: float,
        step_times: list[float],
        kv_bytes: int,
        peak_kv: int,
    ) -> GenerationOutput:
        """Texts, ids and finish reasons of ``generated`` (B, steps), cut after each row's EOS."""
        token_ids, texts, reasons = [], [], []
        for row in generated.tolist():
            stop = next((i for i, token in enumerate(row) if token in self.eos_ids), None)
            kept = row if stop is None else row[: stop + 1]
            token_ids.append(kept)
            text_ids = kept if stop is None else kept[:-1]
            texts.append(self.tokenizer.decode(text_ids, skip_special_tokens=True))
            reasons.append("stop" if stop is not None else "length")
        return GenerationOutput(
            texts=texts,
            token_ids=token_ids,
            prompt_tokens=prompt_tokens,
            finish_reasons=reasons,
            ttft_s=ttft,
            step_times_s=step_times,
            kv_bytes=kv_bytes,
            peak_kv_bytes=peak_kv,
        )


def _drop_finished(state: DecodeState, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Keep only unfinished rows in ``state`` and ``cache``; their ``tokens`` (B',).

    Later steps then compute only for the rows still generating.
    """
    rows = (~state.finished).nonzero(as_tuple=True)[0]
    cache.batch_select_indices(rows)
    state.keep(rows)
    return tokens[rows]
