"""Flags shared by the subcommands; the cache flags are generated from ``AlisaConfig``'s fields.

Every ``AlisaConfig`` field becomes a flag (``caching_ratio`` -> ``--caching-ratio``) with the
type of its annotation, its default, and the help text of its entry in the class docstring's
``Parameters`` section, so a new field is a new flag with nothing else to edit.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import types
import typing
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import Field, fields
from pathlib import Path

from alisa.checks import too_large
from alisa.config import AlisaConfig
from alisa.model.builtin import BUILTIN_MODELS, DEFAULT_MODEL
from alisa.model.dtypes import DTYPES
from alisa.ops import COMPILE
from alisa.settings import (
    TIER_FIELDS,
    UNTIERED,
    IgnoredSettingWarning,
    field_default,
    full_precision_note,
    ignored_settings,
    unread_kernels_note,
)

if typing.TYPE_CHECKING:
    from alisa.runtime.sampling import SamplingOptions

T = typing.TypeVar("T")
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ROWS_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what `cmd | head` reports of a tool the pipe ended


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code 1, no traceback."""


def flag_name(field_name: str) -> str:
    """The CLI flag of a config field: ``caching_ratio`` -> ``--caching-ratio``."""
    return "--" + field_name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> description from a numpy-style docstring's ``Parameters`` section.

    An entry line ``a, b`` documents both names; ````literal```` markup is dropped.
    """
    lines = (cls.__doc__ or "").splitlines()
    docs: dict[str, list[str]] = {}
    current: list[str] = []
    inside = False
    for index, line in enumerate(lines):
        stripped = line.strip()
        underline = index + 1 < len(lines) and set(lines[index + 1].strip()) == {"-"}
        if underline:  # a section title: only Parameters is read
            inside = stripped == "Parameters"
            continue
        if not inside or set(stripped) == {"-"} or not stripped:
            continue
        if len(line) - len(line.lstrip()) <= 4:  # "    name" (class docstring indentation)
            current = []
            for name in stripped.split(","):
                docs[name.strip()] = current
        else:
            current.append(stripped)
    return {name: " ".join(" ".join(text).replace("``", "").split()) for name, text in docs.items()}


def _flag_type(annotation) -> tuple[type, str]:
    """(argparse type, metavar) of a field annotation: ``X | None`` -> X; other unions -> str.

    ``int | str`` byte sizes stay text for the config to parse; any type argparse cannot build
    from one word is read as text too.
    """
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = kinds[0] if len(kinds) == 1 else str
    if annotation not in (bool, int, float, str):
        return str, "VALUE"
    return annotation, {bool: "", int: "N", float: "X", str: "TEXT"}[annotation]


def _settable_fields(only: tuple[str, ...] | None) -> list[Field]:
    """The ``AlisaConfig`` fields a flag can set (all ``__init__`` fields, or those in ``only``)."""
    return [f for f in fields(AlisaConfig) if f.init and (only is None or f.name in only)]


# The AlisaConfig fields by what they decide, in the order ``--help`` shows them; a new field
# belongs in one group (tests/test_cli.py checks that every field is in exactly one).
CACHE_GROUPS = {
    "which tokens each sequence keeps": (
        "policy",
        "caching_ratio",
        "budget_tokens",
        "min_budget_tokens",
        "recent_fraction",
        "sink_tokens",
        "dense_layers",
        "layer_schedule",
        "preset",
    ),
    "how the policy ranks tokens": (
        "score_window",
        "score_decay",
        "head_max",
        "per_head",
        "observation_window",
        "stride",
    ),
    "how kept tokens are stored": (
        "kv_bits",
        "quant_group_size",
        "residual_tokens",
        "retention",
        "host_bits",
        "history_share",
        "reselect_every",
        "estimate_rest",
    ),
    "memory budgets and tiers": ("gpu_memory", "host_memory", "recompute", "profile"),
    "which kernels run": ("kernels",),
}


def add_cache_options(
    parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None, title: str = "KV cache"
) -> None:
    """One flag per ``AlisaConfig`` field (or per field in ``only``), typed, defaulted, helped,
    in the argument groups of :data:`CACHE_GROUPS`.

    A field without a docstring entry still gets a flag (its help then only names the field);
    ``tests/test_bad_input.py`` fails until the entry is written.
    """
    docs = field_docs(AlisaConfig)
    hints = typing.get_type_hints(AlisaConfig)
    settable = {item.name: item for item in _settable_fields(only)}
    parser.set_defaults(typed_fields=frozenset())
    for group_title, names in CACHE_GROUPS.items():
        chosen = [settable[name] for name in names if name in settable]
        if not chosen:
            continue
        group = parser.add_argument_group(f"{title}: {group_title} (AlisaConfig fields)")
        for item in chosen:
            _add_field_flag(group, item, docs.get(item.name), hints[item.name])


def _add_field_flag(group, item: Field, doc: str | None, annotation) -> None:
    """The flag of one config field in ``group``."""
    default = field_default(item)
    # A field left at None is a flag not given: say so in the flag's words.
    text = doc or f"AlisaConfig.{item.name}"
    help_text = re.sub(r"\bNone\b", "unset", text).replace("%", "%%")
    if default is not None and default is not False:
        help_text += f" (default: {default})"
    kind, metavar = _flag_type(annotation)
    if kind is bool:
        group.add_argument(flag_name(item.name), action=TypedBool, default=default, help=help_text)
    else:
        group.add_argument(
            flag_name(item.name),
            action=Typed,
            type=kind,
            default=default,
            metavar=metavar,
            help=help_text,
        )


def _note_typed(namespace: argparse.Namespace, name: str) -> None:
    # A flag typed at its default value still asks for something: a note that it does nothing
    # is owed to the user who typed it (``--host-bits 8`` without host retention).
    namespace.typed_fields = namespace.typed_fields | {name}


class Typed(argparse.Action):
    """Store a field flag's value and note that the user typed the flag."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _note_typed(namespace, self.dest)


class TypedBool(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, noting that the user typed the flag."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note_typed(namespace, self.dest)


def cache_config_from_args(
    args: argparse.Namespace, only: tuple[str, ...] | None = None, *, sizes_batches: bool = False
) -> AlisaConfig:
    """The validated ``AlisaConfig`` the generated flags describe; errors name the flag, and a
    flag that would change nothing is one warning line on stderr (:func:`ignored_settings`).

    ``sizes_batches``: the command (``alisa batch``, ``alisa serve``) reads ``--gpu-memory`` as
    the budget its batches are sized to, never as a cache's device tier: the config leaves it
    out (so no tier rule of the config refuses it: host retention and per-head selection run
    under it), and the tier fields are said to have no effect there.

    Raises
    ------
    CommandError
        A bad value (the message names the flag, then the field and value), or a ``--profile``
        file that cannot be read.
    """
    names = [item.name for item in _settable_fields(only)]
    built = [name for name in names if not (sizes_batches and name == "gpu_memory")]
    with warnings.catch_warnings():  # said below, naming the flags, in the command's words
        warnings.simplefilter("ignore", IgnoredSettingWarning)
        config = build_from_flags(
            AlisaConfig, dict.fromkeys(names), **{name: getattr(args, name) for name in built}
        )
    tiered = args.command == "plan"  # the plan places KV on the whole device by default
    typed = args.typed_fields
    untiered = UNTIERED
    if sizes_batches:
        untiered = (
            f"in alisa {args.command}, which sizes its batches to --gpu-memory and never splits "
            "a cache into device/host tiers"
        )
    notes = ignored_settings(config, tiered=tiered, typed=typed, untiered=untiered)
    for note in notes:  # said, not refused
        print(
            f"alisa {args.command}: warning: {with_flag(note, dict.fromkeys(names))}",
            file=sys.stderr,
        )
    if config.profile is not None:
        from scheduler import load_profile

        try:
            load_profile(config.profile)  # a missing profile is an error, not a silent default
        except ValueError as error:
            raise CommandError(f"--profile: {error}") from None
    return config


def build_from_flags(factory: Callable[..., T], flags: dict[str, str | None], **values) -> T:
    """``factory(**values)``; its ``ValueError`` becomes a :class:`CommandError` naming the flag.

    ``flags`` maps field names to flags, as :func:`with_flag`.
    """
    try:
        return factory(**values)
    except ValueError as error:
        raise CommandError(with_flag(str(error), flags)) from None


@contextmanager
def model_notes_said(command: str, model, config: AlisaConfig) -> Iterator[None]:
    """Say once, in the command's words, what a cache of ``config`` would warn of on ``model``
    when built (``residual_tokens`` past its context: ``kv_bits`` codes nothing; ``kernels``
    that no step on the model's device reads); the caches a run builds inside the block then
    say nothing of it (a batch or a server builds many)."""
    from alisa.model.loading import context_length

    known = context_length(model)
    note = None if known is None else full_precision_note(config, known[0], context=True)
    unread = unread_kernels_note(config, next(model.parameters()).device.type)
    for said in (note, unread):
        if said is not None:
            text = with_flag(said, {"residual_tokens": None, "kernels": None})
            print(f"alisa {command}: warning: {text}", file=sys.stderr)
    with warnings.catch_warnings():  # these, and --recompute/--profile: said with the flags
        # The ring past the context (any request's ring, for a server): a run's ring covering
        # its rows ("keeps all N tokens of each sequence") is the run's to say.
        warnings.filterwarnings("ignore", CONTEXT_RING, IgnoredSettingWarning)
        for field in ("kernels", *TIER_FIELDS):
            warnings.filterwarnings("ignore", f"{field}=", IgnoredSettingWarning)
        yield


# How full_precision_note(..., context=True) begins: the note model_notes_said says once.
CONTEXT_RING = r"residual_tokens=\d+ keeps every token of the model's"


@contextmanager
def run_notes_said(command: str, flags: dict[str, str | None] | None = None) -> Iterator[None]:
    """Inside the block, an :class:`~alisa.settings.IgnoredSettingWarning` a run gives (a
    batch's, once its rows' lengths are known: :func:`alisa.runtime.generate.run_notes`) is
    one ``alisa <command>: warning: ...`` line naming the flag, as the notes said before the
    run, instead of Python's warning with a source line; other warnings show as before.
    ``flags`` maps the fields the notes name to their flags (None: the floor settings')."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def said(message, category, filename, lineno, file=None, line=None) -> None:
            if not issubclass(category, IgnoredSettingWarning):
                shown(message, category, filename, lineno, file, line)
                return
            text = with_flag(str(message), FLOOR_FLAGS if flags is None else flags)
            print(f"alisa {command}: warning: {text}", file=sys.stderr)

        warnings.showwarning = said  # restored by catch_warnings on the way out
        yield


def with_flag(message: str, flags: dict[str, str | None]) -> str:
    """Prefix a ``field=value ...`` message with the flag that set the field.

    ``flags`` maps field names to flags; ``None`` means the field's own name as a flag.
    """
    match = re.match(r"(\w+)=", message)
    if match and match.group(1) in flags:
        name = match.group(1)
        return f"{flags[name] or flag_name(name)}: {message}"
    return message


def add_model_options(
    parser: argparse.ArgumentParser, dtype: str = "auto", model_note: str = ""
) -> None:
    """``--model`` and ``--dtype``, shared by every command that loads a model."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"built-in name ({', '.join(BUILTIN_MODELS)}), HF directory, .gguf file or hub id"
        f"{model_note} "
        f"(default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--dtype", default=dtype, help=f"weights dtype: {', '.join(DTYPES)} (default: {dtype})"
    )


SAMPLING_FLAGS = dict.fromkeys(("temperature", "top_k", "top_p", "seed"))  # field -> its flag


def add_sampling_options(
    parser: argparse.ArgumentParser, title: str = "sampling (greedy unless --do-sample)"
) -> None:
    """``--do-sample``, ``--temperature``, ``--top-k``, ``--top-p``, ``--seed`` (the fields of
    :class:`~alisa.runtime.sampling.SamplingOptions`; read them with :func:`sampling_from_args`)."""
    sampling = parser.add_argument_group(title)
    sampling.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    sampling.add_argument("--temperature", type=float, help="> 0 (default: the model's, or 1.0)")
    sampling.add_argument(
        "--top-k", type=int, help="sample among the k likeliest tokens (0: no top-k limit)"
    )
    sampling.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    sampling.add_argument("--seed", type=int, help="seed for sampling")


def sampling_from_args(args: argparse.Namespace) -> SamplingOptions:
    """The :class:`~alisa.runtime.sampling.SamplingOptions` of :func:`add_sampling_options`'s
    flags; a bad value is a :class:`CommandError` naming its flag, and flags greedy decoding
    would ignore are one warning line on stderr (and dropped)."""
    from alisa.runtime.sampling import SamplingOptions  # torch: not at the CLI's start

    sampling = build_from_flags(
        SamplingOptions,
        SAMPLING_FLAGS,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if not sampling.ignored:
        return sampling
    flags = ", ".join("--" + name.replace("_", "-") for name in sampling.ignored)
    print(
        f"alisa {args.command}: warning: {flags} ignored without --do-sample (greedy decoding)",
        file=sys.stderr,
    )
    return SamplingOptions()  # said once here, in flags: greedy, with nothing left to ignore


# The settings an evicts-nothing warning may name, as flags.
FLOOR_FLAGS = dict.fromkeys(
    ("min_budget_tokens", "sink_tokens", "budget_tokens", "residual_tokens")
)


def check_minimum(flag: str, value: int | None, minimum: int) -> None:
    """Refuse an integer flag below ``minimum``, or past :data:`~alisa.checks.LARGEST_INT`
    (argparse only checks that it is an integer)."""
    if value is None:
        return
    if value < minimum:
        raise CommandError(f"{flag}={value} must be >= {minimum}")
    if (error := too_large(flag, value)) is not None:
        raise CommandError(error)


def check_new_file(
    flag: str, path: str | Path, *, force: bool = False, make_folder: bool = False
) -> None:
    """Fail before slow work when ``path`` cannot be written (empty, a directory, a missing
    folder, a read-only place) or exists and ``force`` is not given (an existing file is never
    replaced without the user's say). ``make_folder``: a missing folder will be made (alisa's
    own default places), so only the nearest existing one must be writable."""
    if str(path) == "":  # as typed: Path("") would be ".", a directory
        raise CommandError(f"{flag} '' is empty; give a file path")
    path = Path(path)
    if path.is_dir():
        raise CommandError(f"{flag} {str(path)!r} is a directory")
    if path.exists() and not force:
        raise CommandError(f"{flag} {str(path)!r} exists; pass --force to overwrite it")
    parent = path.parent
    if not make_folder and not parent.exists():  # a mistyped folder is not made
        raise CommandError(f"{flag} {str(path)!r}: its folder {str(parent)!r} does not exist")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CommandError(f"{flag} {str(path)!r}: {str(parent)!r} is not a directory")
    # Trying is the only sure test: permissions, a read-only mount, root's exemptions all differ.
    try:
        if path.exists():
            with path.open("ab"):  # opened, not written: the file is unchanged
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".alisa-check-"):
                pass
    except OSError as error:
        raise CommandError(f"{flag} {str(path)!r} cannot be written: {error.strerror}") from None


def dtype_from_flag(value: str):
    """The torch dtype of ``--dtype`` (None for ``auto``); the error names the flag."""
    from alisa.model.loading import resolve_dtype

    try:
        return resolve_dtype(value)
    except ValueError as error:
        raise CommandError(f"--dtype: {error}") from None


def load_for_cli(spec: str, dtype: str):
    """Load a model quietly (HF's per-load bars off) after any one-time GGUF conversion."""
    from transformers.utils import logging as hf_logging

    from alisa.model.loading import load_model, resolve_model_path

    dtype_from_flag(dtype)  # fail on a bad dtype before any slow work
    path = resolve_model_path(spec)  # converts a GGUF once, with its progress bar
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return load_model(path, dtype=dtype)


def add_compile_option(parser: argparse.ArgumentParser, what: str, on: str = "") -> None:
    """``--compile auto|on|off`` for the commands whose ``what`` (their decode steps) may run
    through ``torch.compile``; ``on`` adds what forcing it needs."""
    parser.add_argument(
        "--compile",
        choices=COMPILE,
        default="auto",
        help=f"run {what} through torch.compile: auto (default) compiles where that pays on "
        "the model's device (CUDA) and the cache has a static step, and runs eager on a CPU, "
        f"where the first step takes 15-240 s to compile; on{on} / off force it",
    )


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads``, for every command that computes."""
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: OMP_NUM_THREADS if set, else the CPUs this process may "
        "use, per affinity and cgroup quota, less those other work keeps busy)",
    )


def apply_threads(command: str, threads: int | None) -> None:
    """Set torch's threads for ``--threads`` (:func:`alisa.threads.use_threads`); one warning
    line on stderr when the machine is oversubscribed."""
    from alisa.threads import use_threads

    check_minimum("--threads", threads, 1)
    try:
        choice = use_threads(threads, warn=False)  # said below, in the flag's words
    except ValueError as error:  # a bad OMP_NUM_THREADS, or more than the machine can start
        raise CommandError(with_flag(str(error), {"threads": "--threads"})) from None
    warning = choice.warning()
    if warning is not None:
        print(f"alisa {command}: {warning}", file=sys.stderr)


# The flags whose value is a byte size: a negative one ("-5GB") must reach the size check, not
# be taken by argparse for a flag (see alisa.cli.join_negative_sizes).
SIZE_FLAGS = ("--gpu-memory", "--host-memory", "--kv-memory")


def add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    """The continuous scheduler's flags that ``batch`` and ``serve`` share: ``--kv-memory``,
    ``--max-batch``, ``--reserve-tokens``, ``--prefill-tokens``."""
    from alisa.runtime.requests import PREFILL_TOKENS  # no torch: the CLI starts fast

    parser.add_argument("--kv-memory", help="byte budget of the KV cache alone, e.g. 256MiB")
    parser.add_argument(
        "--max-batch", type=int, default=64, help="upper bound on the rows run together"
    )
    parser.add_argument(
        "--reserve-tokens",
        type=int,
        help="continuous batching: admit a row with room for this many new tokens instead of "
        "all it may generate (more rows run); rows that outgrow it are paused, their KV "
        "swapped to host memory, and resumed with the same tokens",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=PREFILL_TOKENS,
        help="continuous batching: padded prompt tokens (rows x longest) prefilled in one "
        f"forward at most, bounding the compute spent on padding (default: {PREFILL_TOKENS}; a "
        "longer prompt is prefilled alone)",
    )
