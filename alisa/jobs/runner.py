"""Run a file of prompts through one device under a byte budget, batch by batch, resumably."""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import psutil
from tqdm.auto import tqdm

from alisa.checks import check_field_types
from alisa.config import AlisaConfig
from alisa.jobs.continuous import continuous_results, recorded
from alisa.jobs.io import (
    ROW_OPTIONS,
    STDIN,
    OutputLog,
    Request,
    check_failures_file,
    input_name,
    read_requests,
    same_file,
    warn_ignored_sampling,
)
from alisa.jobs.lock import output_lock
from alisa.jobs.parts import merge_parts
from alisa.jobs.sizing import BatchMemory, ring_refusal_note, running_memory
from alisa.jobs.static import planned_batches, run_static
from alisa.jobs.stream import over_budget
from alisa.memory import PeakMemory
from alisa.model.adapter import check_model_and_tokenizer, model_shape
from alisa.model.loading import chat_prompt, context_length, prompt_length_error
from alisa.planning.spec import model_spec
from alisa.runtime.compiled import (
    CompileChoice,
    check_compile,
    check_compileable,
    choose_compile,
    static_capacity,
    static_row_note,
)
from alisa.runtime.generate import SamplingOptions, new_cache, rows_compile, run_notes
from alisa.runtime.requests import (
    PREFILL_TOKENS,
    TOKENIZER_HINT,
    StepRecord,
    past_vocabulary,
    vocabulary_size,
)
from alisa.settings import IgnoredSettingWarning, check_host_admission, check_untiered
from alisa.sizes import format_bytes, parse_budget, parse_bytes


@dataclass(frozen=True, kw_only=True)
class BatchJob:
    """What to run.

    Parameters
    ----------
    input, output
        JSONL paths: rows ``{"id", "prompt", ...options}`` in; results appended out.
    config
        KV policy and storage for every batch.
    gpu_memory
        Device byte budget for weights, KV and activations (``"8GiB"``); ``None``: no limit.
    kv_memory
        Byte budget for the KV cache alone (the comparison the paper makes: the same KV bytes
        for every system); ``None``: only ``gpu_memory`` limits the batches.
    max_new_tokens
        Default tokens per prompt (a row's ``max_new_tokens`` overrides it).
    max_batch
        Upper bound on the batch size whatever the budget allows.
    stop_at_eos
        False: every prompt generates exactly its ``max_new_tokens`` (benchmarks).
    chat
        Send each prompt as a user turn in the model's chat template (a row's ``"chat"``
        overrides it).
    static
        Static batches (sorted by length, each run until its last row finishes) instead of
        continuous batching (rows join as others finish; :mod:`alisa.runtime.continuous`).
    reserve_tokens
        Continuous batching: admit a row with room for this many new tokens rather than all
        its ``max_new_tokens``; rows that outgrow it are paused in host memory and resumed,
        token-identically (:class:`~alisa.jobs.stream.ByteBudget`). None: reserve them all.
    prefill_tokens
        Continuous batching: padded prompt tokens (rows x longest) of one prefill forward at
        most (:class:`~alisa.runtime.continuous.ContinuousScheduler`); None: no bound.
        Static batches prefill each batch in one forward: they take only the default or None.
    mixed_forwards
        Continuous batching: prefill a newcomer inside the running rows' next decode step
        where the model allows it (:func:`~alisa.runtime.continuous.packs`); False: in a
        forward of its own. The tokens are the same either way.
    sampling
        The sampling of rows that do not say: each of a row's own ``do_sample``,
        ``temperature``, ``top_k``, ``top_p`` and ``seed`` overrides the one here. With a
        seed every row draws from its own generator, so its tokens do not depend on what
        shares its batch.
    compile
        Decode steps through ``torch.compile``: static batches' (:mod:`alisa.jobs.static`) or
        continuous batching's, over static caches that rows join and leave, one graph per
        bucket of rows (:mod:`alisa.runtime.continuous`). ``"auto"`` compiles where that pays
        on the model's device (CUDA) and the mode has a static step, ``"on"`` forces it
        (refused for a mode without one), ``"off"`` never. The tokens are the same either way;
        ``JobSummary.compile`` says what ran and why.
    """

    input: str | Path
    output: str | Path
    config: AlisaConfig = field(default_factory=AlisaConfig)
    gpu_memory: int | str | None = None
    kv_memory: int | str | None = None
    max_new_tokens: int = 64
    max_batch: int = 64
    stop_at_eos: bool = True
    progress: bool = True
    chat: bool = False
    static: bool = False
    reserve_tokens: int | None = None
    prefill_tokens: int | None = PREFILL_TOKENS
    mixed_forwards: bool = True
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    compile: str = "auto"

    def __post_init__(self) -> None:
        check_field_types(self)  # None or a wrong type fails here, naming the field
        check_compile(self.compile)
        check_untiered(self.config, "a batch job", "BatchJob(gpu_memory=...)")
        # Path("") is ".": the messages of an empty name would speak of a directory.
        if self.input == "":
            raise ValueError("input='' is empty; give a JSONL file path, or '-' for stdin")
        if self.output == "":
            raise ValueError("output='' is empty; give a file path, e.g. 'out.jsonl'")
        if self.output == STDIN:  # "-" reads stdin; an output is a file a re-run resumes
            raise ValueError(
                f"output={STDIN!r} (-o {STDIN}): the output must be a file, which a re-run "
                "resumes; stdout cannot be: give a file path, e.g. 'out.jsonl'"
            )
        for name in ("gpu_memory", "kv_memory"):
            if getattr(self, name) is not None:
                parse_budget(getattr(self, name), field=name)
        for name in ("max_new_tokens", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens={self.prefill_tokens!r} must be an integer >= 1")
        if self.reserve_tokens is not None and self.reserve_tokens < 0:
            raise ValueError(f"reserve_tokens={self.reserve_tokens!r} must be an integer >= 0")
        check_host_admission(self.config, self.reserve_tokens)
        if self.reserve_tokens is not None and self.static:
            raise ValueError(
                f"reserve_tokens={self.reserve_tokens!r} applies to continuous batching; static "
                "batches reserve every row's max_new_tokens"
            )
        if self.prefill_tokens not in (None, PREFILL_TOKENS) and self.static:
            raise ValueError(
                f"prefill_tokens={self.prefill_tokens!r} applies to continuous batching; static "
                "batches prefill each batch in one forward"
            )
        if not self.mixed_forwards and self.static:
            raise ValueError(
                "mixed_forwards=False applies to continuous batching; static batches prefill "
                "every batch apart"
            )

    def row_defaults(self) -> dict:
        """The options a row takes from the job when it does not set them (those of
        :attr:`sampling` that differ from greedy decoding's)."""
        return {
            item.name: getattr(self.sampling, item.name)
            for item in fields(self.sampling)
            if getattr(self.sampling, item.name) != item.default
        }


# What a job's peak memory counts, by device type (see alisa.memory.PeakMemory).
PEAK_COUNTS = {
    "cuda": "torch's allocations on the device: weights, KV, activations",
    "cpu": "the whole process's resident memory: Python, libraries, weights, KV, activations",
}


@dataclass(kw_only=True)
class JobSummary:
    """What a job did and what it cost."""

    prompts: int = 0
    already_done: int = 0
    completed: int = 0
    did_not_fit: list = field(default_factory=list)
    # Prompts that, with their new tokens, are longer than the model's context.
    too_long: list = field(default_factory=list)
    batches: list = field(default_factory=list)  # sizes of the batches run
    generated_tokens: int = 0
    seconds: float = 0.0
    peak_kv_bytes: int = 0
    peak_memory_bytes: int = 0
    peak_memory_counts: str = PEAK_COUNTS["cpu"]  # what peak_memory_bytes counts
    budget_bytes: int | None = None
    budget_name: str = ""  # where budget_bytes comes from: "--gpu-memory 8GiB", ...
    kv_budget_bytes: int | None = None
    kv_budget_name: str = ""
    host_budget_bytes: int | None = None  # the host regions of retention="host"
    host_budget_name: str = ""
    # Time to first token of each prompt, from the job's start (the wait for its batch or
    # its admission included).
    ttfts_s: list = field(default_factory=list)
    errors: dict = field(default_factory=dict)  # id -> error row of every failed prompt
    max_rows: int = 0  # continuous batching: the most rows that ran together
    preemptions: int = 0  # continuous batching: rows paused in host memory and resumed
    progress: dict = field(default_factory=dict)  # continuous batching: the progress bar's
    torn_bytes: int = 0  # a torn last row an interrupted run left in the output, cut off
    compile: CompileChoice | None = None  # whether the decode steps ran compiled, and why
    compile_s: float = 0.0  # seconds of every batch's first compiled step (compiling included)

    @property
    def failed(self) -> list:
        """Ids that failed this run: kept out of the output, so a re-run retries them."""
        return self.did_not_fit + self.too_long

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttfts_s) / len(self.ttfts_s) if self.ttfts_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        batching = f"{len(self.batches)} batches (sizes {min(self.batches, default=0)}-"
        batching += f"{max(self.batches, default=0)})"
        if self.max_rows:
            batching = f"continuous batching, up to {self.max_rows} rows"
            if self.preemptions:
                batching += f", {self.preemptions} pauses"
        torn = ""
        if self.torn_bytes:
            torn = (
                f"cut off the output's torn last line ({self.torn_bytes} bytes: a row an "
                "interrupted run was writing, redone if still pending); "
            )
        if self.compile is not None and self.compile.compiled:
            batching += f", decode steps compiled (first steps {self.compile_s:.1f} s)"
        elif self.compile is not None and self.compile.settled:
            batching += f", decode steps eager ({self.compile.reason})"
        return (
            f"{torn}{self.completed} prompts done ({self.already_done} already done before), "
            f"{len(self.did_not_fit)} did not fit, {len(self.too_long)} longer than the context, "
            f"{batching}; {self.generated_tokens} tokens in {self.seconds:.1f} s = "
            f"{self.tokens_per_s:.1f} tok/s; peak KV {format_bytes(self.peak_kv_bytes)}; "
            f"{self._memory_text()}"
        )

    def _memory_text(self) -> str:
        """The peak and the budgets, each saying what it counts: on a CPU the peak is the whole
        process, the budget only what batches are sized for (so the peak may exceed it)."""
        text = f"peak memory {format_bytes(self.peak_memory_bytes)} ({self.peak_memory_counts}); "
        if self.budget_bytes:
            text += (
                f"batches sized to fit {format_bytes(self.budget_bytes)} of weights + KV + "
                f"activations ({self.budget_name or 'device budget'})"
            )
        else:
            text += "no device budget"
        if self.kv_budget_bytes is not None:
            text += (
                f" and {format_bytes(self.kv_budget_bytes)} of KV "
                f"({self.kv_budget_name or 'KV budget'})"
            )
        if self.host_budget_bytes is not None:
            text += (
                f"; host regions within {format_bytes(self.host_budget_bytes)} "
                f"({self.host_budget_name or 'host budget'})"
            )
        return text


RESULT_KEYS = ("id", "finish_reason")  # what every row of a batch output has


def check_job(job: BatchJob) -> None:
    """Refuse anything but a :class:`BatchJob` (a dict, None) before its fields are read.

    Raises
    ------
    ValueError
        Naming the value and the class to build.
    """
    if not isinstance(job, BatchJob):
        raise ValueError(
            f"job={job!r} must be a BatchJob, e.g. BatchJob(input='in.jsonl', output='out.jsonl')"
        )


def open_job(job: BatchJob) -> tuple[list[Request], OutputLog]:
    """Validated requests and the reopened output log (:func:`read_requests`, then
    :func:`open_output`)."""
    check_job(job)
    requests = read_requests(job.input)
    return requests, open_output(job, requests)


def open_output(job: BatchJob, requests: Sequence[Request] = ()) -> OutputLog:
    """The reopened output log, every output check done before any model work.

    Parts left by a killed multi-process run of the same output are merged in first. A done
    row of ``requests`` made with other settings of its own than this job gives it is refused
    here too (:func:`own_settings`).

    Raises
    ------
    ValueError
        ``output`` naming the input file, or an output (or its failures file) that alisa did
        not write (left untouched) or cannot write.
    """
    if same_file(job.input, job.output):
        raise ValueError(
            f"the output {job.output!r} is the input file; results go to a file of their own"
        )
    check_failures_file(job.output)
    log = OutputLog(job.output, keys=RESULT_KEYS)
    try:
        merge_parts(log)
        _check_made_with(log, job_settings(job), job, requests)  # the model: once it is loaded
    except ValueError:
        log.close()
        raise
    return log


# Settings that decide where KV lives, which kernels run and how rows are batched: each is exact
# (offload, recompute and the kernel backends never change a token), so resuming across them
# mixes nothing.
PLACEMENT_FIELDS = ("gpu_memory", "host_memory", "recompute", "profile", "kernels")


def job_settings(job: BatchJob) -> dict:
    """What decides the tokens of every row of a job (a plain JSON object, recorded in every
    row beside the row's :func:`own_settings`): stopping at EOS and the cache settings that
    differ from the defaults, placement aside (:data:`PLACEMENT_FIELDS`)."""
    default = AlisaConfig()
    cache = {
        item.name: getattr(job.config, item.name)
        for item in fields(AlisaConfig)
        if item.name not in PLACEMENT_FIELDS
        and getattr(job.config, item.name) != getattr(default, item.name)
    }
    settings = {"stop_at_eos": job.stop_at_eos, "cache": cache}
    return json.loads(json.dumps(settings, default=str))  # as a row reads back


# What decides a row's tokens that is the row's own: :func:`own_settings`' keys.
OWN_SETTINGS = ("prompt_sha256", "max_new_tokens", "chat", "sampling")


def own_settings(job: BatchJob, request: Request) -> dict:
    """What decides a row's tokens that is the row's own, as a row reads back: a digest of its
    prompt as the input gives it (an edited prompt is another row's work), and what the row may
    set itself (``max_new_tokens``, ``chat``, sampling), the job's where it does not (a row of
    ``examples/prompts.jsonl`` asking ``"chat": true, "max_new_tokens": 48`` records those)."""
    options = {**job.row_defaults(), **request.options}
    sampling = {
        key: options[key]
        for key in ROW_OPTIONS
        if key != "max_new_tokens" and options.get(key) not in (None, False)
    }
    own = {
        "prompt_sha256": hashlib.sha256(request.prompt.encode()).hexdigest(),
        "max_new_tokens": options.get("max_new_tokens", job.max_new_tokens),
        "chat": job.chat if request.chat is None else request.chat,
        "sampling": sampling,
    }
    return json.loads(json.dumps(own, default=str))


def model_settings(model) -> dict:
    """What a job's rows were made with of the model: its identity and its weights' dtype
    (``--dtype`` decides tokens: bfloat16 changed 4 of 8 rows' text against float32)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"model": model_identity(model), "dtype": dtype}


def model_identity(model) -> str:
    """The model a job's rows were made with: its class and where it was loaded from (a
    directory resolved, so that two spellings of one path are one model)."""
    source = str(getattr(model.config, "_name_or_path", "") or "")
    if source and Path(source).exists():
        source = str(Path(source).resolve())
    return f"{type(model).__name__} ({source or 'built in memory'})"


def _check_made_with(
    log: OutputLog, settings: dict, job: BatchJob, requests: Sequence[Request]
) -> None:
    """Refuse to resume an output whose finished rows were made with other ``settings`` (of
    those named: the model is known only once loaded), or a done row of ``requests`` with
    other settings of its own than ``job`` gives it now: the output would mix rows of two runs
    as if of one (a re-run with another --max-new-tokens reported its rows done). A row that
    sets its own ``max_new_tokens`` reads no ``--max-new-tokens``: changing it is no reason.
    What an older alisa's rows did not record (a prompt's digest, the dtype) is not compared."""
    for request in requests:
        made = log.made.get(request.id)
        if made is None:
            continue
        there = {key: made[key] for key in OWN_SETTINGS if key in made}
        now = {key: value for key, value in own_settings(job, request).items() if key in there}
        if there != now:
            _refuse_resume(log, there, now, f"row id={request.id!r}: ")
    others = [
        made
        for made in log.made_with
        if any(name in made and made[name] != value for name, value in settings.items())
    ]
    if not others:
        return
    # Only the settings compared (the model is not known yet when a resume is checked) and
    # recorded, a cache setting left out of a record by its default value.
    there = {name: others[0][name] for name in settings if name in others[0]}
    defaults = json.loads(json.dumps(asdict(AlisaConfig()), default=str))
    there["cache"] = {**defaults, **(there.get("cache") or {})}
    now = {name: settings[name] for name in there}
    now["cache"] = {**defaults, **settings["cache"]}
    _refuse_resume(log, there, now)


def _refuse_resume(log: OutputLog, there: dict, now: dict, row: str = "") -> None:
    """Refuse a resume whose finished rows were made with ``there`` settings, naming what
    differs from ``now`` (a prompt by its digest: edited since)."""
    differences = "; ".join(
        "prompt: edited since (its digest differs)"
        if name == "prompt_sha256"
        else f"{name}: {old} there, {new} now"
        for name, (old, new) in _differences(there, now).items()
    )
    raise ValueError(
        f"the output {str(log.path)!r} holds finished rows made with other settings "
        f"({row}{differences}); resuming would mix them with this run's rows: give the same "
        "settings to finish it, or another output (nothing was changed)"
    )


def _differences(there: dict, now: dict, prefix: str = "") -> dict[str, tuple]:
    """``{name: (there, now)}`` of the settings that differ, nested ones as ``cache.policy``."""
    found = {}
    for name in sorted(set(there) | set(now)):
        old, new = there.get(name), now.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            found.update(_differences(old, new, f"{prefix}{name}."))
        elif old != new:
            found[f"{prefix}{name}"] = (old, new)
    return found


def run_batch(
    model,
    tokenizer,
    job: BatchJob,
    *,
    cache_factory: Callable | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> JobSummary:
    """Generate for every pending prompt of ``job.input``, appending results to ``job.output``.

    The input is read once, before the output is locked (a pipe is read as it comes, with no
    output held meanwhile). Rows run by continuous batching (or, with ``job.static``, in
    batches formed per generation-option group from prompts sorted by length), as many at
    once as the predicted peak memory allows under ``job.gpu_memory`` / ``job.kv_memory``
    (see ``alisa.jobs.sizing``). ``cache_factory`` replaces the ALISA cache (e.g.
    ``DynamicCache`` for a baseline; it runs static batches, sized as a dense cache).
    ``on_step`` is told every decode step's :class:`~alisa.runtime.requests.StepRecord`
    (static batches: once each batch ends, from its step times), for timelines.

    Raises
    ------
    ValueError
        ``job`` not a :class:`BatchJob`, bad input rows (file and line), an unwritable output,
        another run writing the same output (see :func:`alisa.jobs.lock.output_lock`), or a
        budget below the weights.
    """
    check_model_and_tokenizer(model, tokenizer)
    check_job(job)
    for name, value in (("cache_factory", cache_factory), ("on_step", on_step)):
        if value is not None and not callable(value):
            raise ValueError(f"{name}={value!r} must be callable or None")
    requests = read_requests(job.input)
    with output_lock(job.output) as held:
        log = open_output(job, requests)
        try:
            summary = run_opened_job(
                model, tokenizer, job, requests, log, cache_factory=cache_factory, on_step=on_step
            )
        finally:
            log.close()
        held.keep()
        return summary


def run_opened_job(
    model,
    tokenizer,
    job: BatchJob,
    requests: list[Request],
    log: OutputLog,
    *,
    cache_factory: Callable | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> JobSummary:
    """:func:`run_batch` for a caller that read ``requests`` (``job.input``'s) and opened
    ``log`` (:func:`open_output`) under ``output_lock(job.output)`` (the CLI does, to check
    every file before loading the model); ``log`` stays open. An output whose finished rows
    another model made is refused here (``ValueError``), before any row is written."""
    made_with = {**job_settings(job), **model_settings(model)}
    _check_made_with(log, made_with, job, requests)  # before any row: nothing changed if refused
    log.record(made_with)
    pending = [r for r in requests if r.id not in log.done]
    bar = tqdm(total=len(pending), unit="prompt", disable=not job.progress, desc="alisa batch")
    summary = run_requests(model, tokenizer, job, pending, log, bar, cache_factory, on_step=on_step)
    summary.prompts, summary.already_done = len(requests), len(requests) - len(pending)
    summary.torn_bytes = log.cut_bytes
    return summary


def _with_defaults(request: Request, defaults: dict) -> Request:
    """``request`` with the job's ``defaults`` for the options it does not set itself."""
    return replace(request, options={**defaults, **request.options}) if defaults else request


def _in_template(request: Request, tokenizer, chat: bool) -> Request:
    """``request`` with its prompt in the chat template when it (or else the job) asks."""
    wanted = chat if request.chat is None else request.chat
    return replace(request, prompt=chat_prompt(tokenizer, request.prompt)) if wanted else request


@dataclass(frozen=True, kw_only=True)
class _Budgets:
    """The byte limits batches are sized under, and how to name each in a message."""

    device: int | None
    device_name: str
    kv: int | None
    kv_name: str
    host: int | None = None
    host_name: str = ""


def _budgets(model, job: BatchJob, spec, host_share: int) -> _Budgets:
    budget = parse_bytes(job.gpu_memory, field="gpu_memory") if job.gpu_memory is not None else None
    kv_budget = parse_bytes(job.kv_memory, field="kv_memory") if job.kv_memory is not None else None
    if budget is not None and budget <= spec.total_weight_bytes:
        raise ValueError(
            f"gpu_memory={job.gpu_memory!r} (--gpu-memory, {budget} bytes), the device "
            f"budget, is smaller than the weights ({spec.total_weight_bytes} bytes)"
        )
    name = f"--gpu-memory {job.gpu_memory}"
    if next(model.parameters()).device.type == "cpu":
        # On a CPU the device is host memory: never plan past what is free (weights are loaded).
        # Processes sharing this host (torchrun ranks) split what is free evenly.
        free = spec.total_weight_bytes + int(0.9 * psutil.virtual_memory().available) // host_share
        if budget is None or free < budget:
            budget, name = free, "free host memory"
    host = job.config.host_memory  # the host regions of retention="host", batch by batch
    return _Budgets(
        device=budget,
        device_name=name,
        kv=kv_budget,
        kv_name=f"--kv-memory {job.kv_memory}",
        host=job.config.host_memory_bytes,
        host_name=f"--host-memory {host}",
    )


def run_requests(
    model,
    tokenizer,
    job: BatchJob,
    pending: list[Request],
    log: OutputLog,
    bar,
    cache_factory: Callable | None = None,
    host_share: int = 1,
    *,
    on_step: Callable[[StepRecord], None] | None = None,
) -> JobSummary:
    """Generate for ``pending`` (requests not done yet), appending each finished row to ``log``.

    Failed prompts (too long for the context, or too large for the budget even alone) are not
    written: they land in ``summary.errors`` and a re-run retries them. ``bar`` is a tqdm-like
    progress bar updated per batch; ``host_share`` is how many processes share this host's free
    memory (CPU budgets only); ``on_step`` as in :func:`run_batch`.
    """
    shape = model_shape(model)
    spec = model_spec(model, shape)
    sizing = None if cache_factory is not None else job.config
    budgets = _budgets(model, job, spec, host_share)
    device = next(model.parameters()).device
    summary = JobSummary(prompts=len(pending), budget_bytes=budgets.device)
    summary.budget_name, summary.kv_budget_name = budgets.device_name, budgets.kv_name
    summary.kv_budget_bytes = budgets.kv
    summary.host_budget_bytes, summary.host_budget_name = budgets.host, budgets.host_name
    summary.peak_memory_counts = PEAK_COUNTS.get(device.type, PEAK_COUNTS["cpu"])
    own = {request.id: own_settings(job, request) for request in pending}  # as the input has it
    defaults = job.row_defaults()  # once: the same for every row
    pending = [_with_defaults(request, defaults) for request in pending]
    warn_ignored_sampling(pending, job.input)
    pending = [_in_template(request, tokenizer, job.chat) for request in pending]
    encoded = tokenizer([r.prompt for r in pending])["input_ids"] if pending else []
    prompt_ids = {r.id: list(ids) for r, ids in zip(pending, encoded, strict=True)}
    _check_vocabulary(pending, prompt_ids, vocabulary_size(model), job.input)
    lengths = {key: len(ids) for key, ids in prompt_ids.items()}
    context = context_length(model, tokenizer)
    pending = _drop_too_long(pending, lengths, context, summary, job.max_new_tokens)
    bar.update(len(summary.too_long))
    if sizing is not None and pending:  # a cache_factory's caches do not read the config
        # As generate warns (a floor or ring covering every token, a model of sliding layers
        # only): said once for the longest row, for which it holds only if it holds for all.
        longest = max(lengths[r.id] + _new_tokens(r, job) for r in pending)
        for note in run_notes(model, sizing, shape, longest):
            warnings.warn(note, IgnoredSettingWarning, stacklevel=2)
    # Settled before any row runs: a refusal of compile='on' loses nothing.
    asked = choose_compile(job.compile, device)
    compiled = summary.compile = job_compile(asked, model, job, cache_factory)

    def held(tokens: int) -> int:
        """Tokens per row the cache of a batch whose longest row needs ``tokens`` holds."""
        return static_capacity(model, tokens) if compiled.compiled else tokens

    started = time.perf_counter()
    with PeakMemory(device) as memory:
        limits = (budgets.device, budgets.kv, budgets.host)
        if job.static or cache_factory is not None:
            plan = planned_batches(
                pending,
                lengths,
                job,
                spec,
                sizing,
                limits,
                lambda r, m: _too_large(r, m, budgets, _ring_hint(spec, sizing, r, lengths, job)),
                held,
            )
            batches = run_static(
                model,
                tokenizer,
                job,
                plan,
                log,
                summary,
                sampling=_sampling,
                factory=cache_factory,
                started_s=started,
                own=own,
                on_step=on_step,
                compiled=compiled,
            )
        else:
            longest = max((lengths[r.id] + _new_tokens(r, job) for r in pending), default=1)
            static = held(longest) if compiled.compiled else None
            rows = continuous_results(
                model,
                tokenizer,
                job,
                pending,
                prompt_ids,
                spec,
                limits[:2],  # the host regions' budget is the config's: ByteBudget reads it
                _sampling,
                started_s=started,
                on_step=on_step,
                compiled=compiled,
                max_cache_len=static,
            )
            batches = recorded(
                rows,
                log,
                summary,
                lambda r: _refused(r, lengths[r.id], spec, job, budgets, static),
                own,
            )
        for batch in batches:
            if len(batch) == 1 and isinstance(batch[0], dict):  # did not fit even alone
                summary.errors[batch[0]["id"]] = batch[0]
                summary.did_not_fit.append(batch[0]["id"])
            bar.update(len(batch))
            rate = summary.generated_tokens / (time.perf_counter() - started)
            bar.set_postfix(tok_s=f"{rate:.1f}", **(summary.progress or {"batch": len(batch)}))
    bar.close()
    summary.seconds = time.perf_counter() - started
    summary.peak_memory_bytes = memory.peak_bytes
    return summary


def job_compile(
    choice: CompileChoice,
    model,
    job: BatchJob,
    cache_factory: Callable | None,
) -> CompileChoice:
    """``choice`` (:attr:`BatchJob.compile` for the model's device) settled for ``job``'s
    batching and mode, before any row runs: ``"auto"`` runs a mode without a static step
    (or, batched continuously, one whose static rows cannot change) and a factory's caches
    that cannot compile eager, saying why.

    Raises
    ------
    ValueError
        ``compile="on"`` for such a mode, or a ``cache_factory`` whose caches cannot be
        compiled (the cache's message).
    """
    if not choice.compiled:
        return choice
    if cache_factory is None:  # as generate builds each batch's cache (the smallest bucket)
        if not job.static:
            return rows_compile(choice, model, job.config, job.max_new_tokens)
        with warnings.catch_warnings():  # said by the job's run notes and each batch
            warnings.simplefilter("ignore")
            return new_cache(model, job.config, job.max_new_tokens, 1, choice)[1]
    try:
        check_compileable(cache_factory())
    except ValueError as refusal:
        if choice.asked != "auto":
            raise
        return choice.eager(str(refusal).split(": ")[0])
    return choice


def _drop_too_long(pending, lengths, context, summary: JobSummary, new_tokens: int) -> list:
    """Record prompts that, with the tokens they are to generate (a row's ``max_new_tokens``,
    else ``new_tokens``), do not fit the model's context as failed; return the others."""
    kept = []
    for request in pending:
        wanted = request.options.get("max_new_tokens", new_tokens)
        error = prompt_length_error(lengths[request.id], context, wanted)
        if error is None:
            kept.append(request)
            continue
        alone = context is not None and lengths[request.id] > context[0]
        reason = "prompt_too_long" if alone else "context_exceeded"
        summary.errors[request.id] = _failed_row(request, reason, error)
        summary.too_long.append(request.id)
    return kept


def _check_vocabulary(pending: list[Request], prompt_ids: dict, size: int, source) -> None:
    """Refuse the job (before any work) at the first row whose prompt the tokenizer turned into
    an id the model cannot embed: every row would, the tokenizer being another model's."""
    for request in pending:
        found = past_vocabulary(prompt_ids[request.id], size)
        if found is not None:
            raise ValueError(
                f"{input_name(source)}:{request.line}: id {request.id!r}: the prompt tokenizes to "
                f"id {found[1]}, past the model's vocabulary of {size} tokens: {TOKENIZER_HINT}"
            )


def _sampling(options: dict) -> SamplingOptions:
    keys = ("do_sample", "temperature", "top_k", "top_p", "seed")
    return SamplingOptions(**{k: options[k] for k in keys if k in options})


def _failed_row(request: Request, reason: str, error: str) -> dict:
    row = {"id": request.id, "text": None, "tokens": 0, "finish_reason": reason, "error": error}
    return {**row, "line": request.line}  # where the row is in the input file


def _new_tokens(request: Request, job: BatchJob) -> int:
    """The tokens ``request`` is to generate: its own ``max_new_tokens``, else the job's."""
    return request.options.get("max_new_tokens", job.max_new_tokens)


def _refused(
    request: Request,
    length: int,
    spec,
    job: BatchJob,
    budgets: _Budgets,
    static: int | None = None,
) -> dict:
    """The error row of a request (``length`` prompt tokens) that continuous batching could not
    admit even alone; ``static``: the ``max_cache_len`` of its compiled steps' static caches,
    whose slot space a row holds whatever its length (None: growing caches)."""
    shape = (length, _new_tokens(request, job))
    if static is not None:
        need = running_memory(spec, job.config, [(static, 0)])
        return _too_large(request, need, budgets, static_row_note(static))
    hint = ring_refusal_note(spec, job.config, *shape)
    return _too_large(request, running_memory(spec, job.config, [shape]), budgets, hint)


def _ring_hint(spec, config: AlisaConfig | None, request: Request, lengths: dict, job) -> str:
    """:func:`~alisa.jobs.sizing.ring_refusal_note` of a static batch's row (none for a
    ``cache_factory``'s caches, ``config`` None, which do not code KV)."""
    if config is None:
        return ""
    return ring_refusal_note(spec, config, lengths[request.id], _new_tokens(request, job))


def _too_large(request: Request, need: BatchMemory, budgets: _Budgets, hint: str = "") -> dict:
    """The error row of a prompt that fits no budget alone, quoting the budget it exceeds and
    ``hint`` (why the config made it need more: :func:`~alisa.jobs.sizing.ring_refusal_note`)."""
    over = over_budget(
        need,
        budgets.device,
        budgets.device_name,
        budgets.kv,
        budgets.kv_name,
        budgets.host,
        budgets.host_name,
    )
    error = f"needs about {over} even alone"
    return _failed_row(request, "did_not_fit", f"{error}: {hint}" if hint else error)
