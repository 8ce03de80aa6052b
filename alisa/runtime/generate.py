"""``alisa.runtime.generate``: batched prefill + decode with the ALISA cache, timed step by step."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import fields

import torch
from torch import nn
from transformers.cache_utils import Cache

from alisa.checks import check_bool, check_int, check_text, unordered
from alisa.config import AlisaConfig, config_or_default
from alisa.kv.attention import attached
from alisa.kv.cache import AlisaCache, static_rows_refusal
from alisa.memory import PeakMemory
from alisa.model.adapter import ModelShape, check_model_and_tokenizer
from alisa.model.loading import chat_prompt, check_prompt_length, context_length
from alisa.runtime.compiled import (
    CompileChoice,
    choose_compile,
    compiled_capacity,
    settle_compile,
)
from alisa.runtime.engine import DecodeState, Engine, GenerationOutput, cache_kv_bytes
from alisa.runtime.requests import TOKENIZER_HINT, past_vocabulary, vocabulary_size
from alisa.runtime.sampling import RepeatedPrompts, SamplingOptions, sampling_or_default
from alisa.settings import (
    IgnoredSettingWarning,
    evicts_nothing_note,
    full_precision_note,
    long_stride_note,
    no_evicting_layer_note,
)


@torch.inference_mode()
def generate(
    model: nn.Module,
    tokenizer,
    prompts: str | Sequence[str],
    config: AlisaConfig | None = None,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingOptions | None = None,
    past_key_values=None,
    prune_finished: bool = False,
    stop_at_eos: bool = True,
    chat: bool = False,
    compile: str = "auto",
) -> GenerationOutput:
    """Generate completions for a batch of prompts with the ALISA cache.

    Parameters
    ----------
    model, tokenizer
        From :func:`alisa.load_model` or any HF causal LM and its tokenizer.
    prompts
        One prompt or a list; different lengths are left-padded into one batch.
    config
        KV policy and storage (default: dense, every token kept).
    max_new_tokens
        Tokens to generate per prompt (>= 0); a sequence also stops at EOS.
    sampling
        Greedy by default; see :class:`SamplingOptions`.
    past_key_values
        A ready, empty cache to use instead of a new ``AlisaCache`` (e.g. HF ``DynamicCache`` to
        compare); its own config applies, so ``config`` is refused unless it is the cache's.
        To continue a filled cache (a second chat turn), call the model's ``generate`` with
        ``input_ids`` of the whole conversation and the cache, as with HF's own caches.
    stop_at_eos
        False generates exactly ``max_new_tokens`` per prompt (benchmarks of equal work).
    prune_finished
        Drop sequences from the batch once they emit EOS (faster for batch jobs; the remaining
        rows then run in a smaller batch, which can change float rounding).
    chat
        Send each prompt as a user turn in the model's chat template (instruct models, such as
        the built-in SmolLM2-135M-Instruct, answer it; a plain prompt is continued instead).
    compile
        ``"on"`` runs the decode steps through ``torch.compile`` (one graph per batch size and
        cache capacity; :mod:`alisa.runtime.compiled`), for a cache that says it can: the
        ``AlisaCache`` built here is then static (``max_cache_len`` = the longest prompt plus
        ``max_new_tokens``; a mode without a static step is refused naming why), or HF's
        ``StaticCache`` passed as ``past_key_values``. ``"off"``: eager. ``"auto"`` (default):
        compiled where that pays on the model's device
        (:func:`alisa.ops.backends.compiles_by_default`: CUDA yes, a CPU no) and the cache can
        be, else eager; ``GenerationOutput.compile`` says which ran and why. Each new batch
        size and length compiles again: for many calls of other shapes, pass ``"off"``.

    Returns
    -------
    GenerationOutput
        Texts, token ids, TTFT, per-step times, KV bytes and peak memory.

    Raises
    ------
    ValueError
        An empty prompt or one holding a lone surrogate (``"\\ud800"``), prompts in a dict or a
        set, a bad ``max_new_tokens``, an argument of the wrong type (naming it; the flags must
        be True or False), the longest prompt plus ``max_new_tokens`` past the model's context
        (both numbers named), a ``past_key_values`` that is not an empty cache, a ``config`` it
        would ignore, or ``compile="on"`` with a cache that cannot be compiled.
    """
    check_model_and_tokenizer(model, tokenizer)
    prompt_list = _check_prompts(prompts)
    for name, flag in (
        ("chat", chat),
        ("stop_at_eos", stop_at_eos),
        ("prune_finished", prune_finished),
    ):
        check_bool(name, flag)
    if chat:
        prompt_list = [chat_prompt(tokenizer, prompt) for prompt in prompt_list]
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    max_new_tokens = int(max_new_tokens)  # numpy's int64(2) too: range() and torch take ints
    sampling = sampling_or_default(sampling)
    repeats = RepeatedPrompts(sampling.seed if sampling.do_sample else None)
    for index, prompt in enumerate(prompt_list):
        repeats.see(prompt, index)
    device = next(model.parameters()).device
    choice = choose_compile(compile, device)
    # Left-padded whatever the tokenizer's own padding_side (AutoTokenizer's is often right):
    # a batch decodes each row from its last prompt token.
    batch = tokenizer(prompt_list, return_tensors="pt", padding=True, padding_side="left")
    _check_vocabulary(model, batch["input_ids"])  # on the host: before it reaches the model
    batch = batch.to(device)
    check_prompt_length(model, tokenizer, batch["input_ids"].shape[-1], new_tokens=max_new_tokens)
    if prune_finished and choice.compiled:
        if choice.asked != "auto":
            raise ValueError(
                f"compile={choice.asked!r} runs one static batch, and prune_finished=True drops "
                "finished rows from it: pass one of the two"
            )
        choice = choice.eager("prune_finished drops rows, and a compiled step keeps its batch")
    cache = past_key_values
    longest = batch["input_ids"].shape[-1] + max_new_tokens  # the most a row holds
    if cache is None:
        cache, choice = new_cache(model, config, max_new_tokens, longest, choice)
    else:
        _check_cache(cache, config)
        room = cache.max_cache_len if isinstance(cache, AlisaCache) else None
        if room is not None and longest > room:  # refused before the prefill, not mid-run
            raise ValueError(
                f"past_key_values has max_cache_len={room}: the longest prompt "
                f"({longest - max_new_tokens} tokens, padding included) plus "
                f"max_new_tokens={max_new_tokens} needs {longest}; build the cache with "
                f"max_cache_len={longest} or more"
            )
    choice = settle_compile(choice, cache)
    if isinstance(cache, AlisaCache):  # as the CLI warns: an evicting policy that keeps all
        for note in run_notes(model, cache.config, cache.shape, longest):
            warnings.warn(note, IgnoredSettingWarning, stacklevel=3)  # past inference_mode
    engine = Engine(model, tokenizer, sampling, stop_at_eos=stop_at_eos, compile=choice)
    state = DecodeState.start(batch["input_ids"], batch["attention_mask"])
    with attached(model), PeakMemory(device) as memory:  # the model's attention is restored
        result = engine.run(state, cache, max_new_tokens, prune=prune_finished)
    result.peak_memory_bytes = memory.peak_bytes
    # As it ran: "auto" settles eager for a model the compiler cannot trace.
    result.compile = engine.compiled.choice if engine.compiled is not None else choice
    return result


def new_cache(
    model: nn.Module,
    config: AlisaConfig | None,
    max_new_tokens: int,
    longest: int,
    choice: CompileChoice,
) -> tuple[AlisaCache, CompileChoice]:
    """The ``AlisaCache`` a ``generate`` call builds: static when its steps run compiled,
    ``max_cache_len`` the ``longest`` row (prompt, padding and every new token) rounded up to
    a capacity bucket (:func:`~alisa.runtime.compiled.compiled_capacity`: calls of nearby
    lengths replay one compiled step), else growing.

    ``compile="on"`` with a mode that has no static step is refused (the cache's message);
    ``"auto"`` then settles eager, naming the mode's reason, since the user asked for no
    compilation in particular. A bad setting is refused either way: the growing cache checks
    it again.
    """
    if choice.compiled:
        try:
            known = context_length(model)
            capacity = compiled_capacity(longest, None if known is None else known[0])
            cache = AlisaCache(model, config, max_new_tokens=max_new_tokens, max_cache_len=capacity)
        except ValueError as refusal:
            if choice.asked != "auto":
                raise  # the cache names the setting without a static step
            choice = choice.eager(str(refusal).split(": ")[0])
        else:
            return cache, choice
    return AlisaCache(model, config, max_new_tokens=max_new_tokens), choice


def rows_compile(
    choice: CompileChoice, model: nn.Module, config: AlisaConfig | None, max_new_tokens: int
) -> CompileChoice:
    """``choice`` settled for continuous batching over ``config`` (rows joining and leaving
    static caches, :mod:`alisa.runtime.continuous`): ``"auto"`` runs eager, naming why, a mode
    without a static step or whose static rows cannot change; ``"on"`` refuses it.

    Raises
    ------
    ValueError
        ``compile="on"`` for such a mode, naming the setting.
    """
    if not choice.compiled:
        return choice
    why = static_rows_refusal(config_or_default(config))
    if why is not None:
        if choice.asked != "auto":
            raise ValueError(
                f"compile={choice.asked!r} with continuous batching: {why}; use compile='off'"
            )
        return choice.eager(why)
    with warnings.catch_warnings():  # the run's own notes say what the config ignores
        warnings.simplefilter("ignore")
        return new_cache(model, config, max_new_tokens, 1, choice)[1]


def _check_vocabulary(model, input_ids: torch.Tensor) -> None:
    """Refuse a prompt the tokenizer turned into an id the model cannot embed (a tokenizer of
    another model), naming the prompt and the id, instead of the embedding's ``IndexError``."""
    size = vocabulary_size(model)
    for row, ids in enumerate(input_ids.tolist()):
        found = past_vocabulary(ids, size)
        if found is not None:
            raise ValueError(
                f"prompts[{row}] tokenizes to id {found[1]}, past the model's vocabulary of "
                f"{size} tokens (ids 0..{size - 1}): {TOKENIZER_HINT}"
            )


def _check_cache(cache, config: AlisaConfig | None) -> None:
    """A given cache must be empty (the prompts are prefilled into it, never appended to what
    it holds) and keep KV by ``config``, when one is given too: a setting accepted and ignored
    would be a silent wrong result."""
    if not isinstance(cache, Cache):
        raise ValueError(
            f"past_key_values={type(cache).__name__} must be a transformers Cache (an "
            "AlisaCache, a DynamicCache, ...) or None"
        )
    held = cache.get_seq_length()
    if held:
        raise ValueError(
            f"past_key_values already holds {held} tokens per sequence: generate() prefills "
            "its prompts into an empty cache and never continues one; pass a new cache, or "
            "continue with model.generate(input_ids=<the whole conversation>, "
            "past_key_values=cache) as with HF's own caches"
        )
    if config is None:
        return
    config = config_or_default(config)
    if not isinstance(cache, AlisaCache):
        raise ValueError(
            f"config and past_key_values={type(cache).__name__} were both given, and that cache "
            "keeps every token whatever the config says: pass config alone (generate builds "
            "its AlisaCache) or the cache alone"
        )
    differing = [
        f"{item.name}={getattr(config, item.name)!r} (the cache's: "
        f"{getattr(cache.config, item.name)!r})"
        for item in fields(config)
        if getattr(config, item.name) != getattr(cache.config, item.name)
    ]
    if differing:
        raise ValueError(
            f"config differs from past_key_values' own config in {', '.join(differing)}: the "
            "cache keeps KV by its own config; pass config alone (generate builds its "
            "AlisaCache) or the cache alone"
        )


def _check_prompts(prompts: str | Sequence[str]) -> list[str]:
    if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, str | Iterable):
        raise ValueError(f"prompts={prompts!r} must be a string or a list of strings")
    kind = unordered(prompts)
    if kind is not None:
        raise ValueError(f"prompts={prompts!r} must be a string or a list of strings, not {kind}")
    prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompt_list:
        raise ValueError("prompts=[] is empty; give at least one prompt")
    for index, prompt in enumerate(prompt_list):
        check_prompt(prompt, index)
    return prompt_list


def check_prompt(prompt: object, index: int) -> None:
    """Refuse ``prompt`` unless it is text a tokenizer can encode.

    Parameters
    ----------
    prompt
        One prompt as given.
    index
        Its place among the prompts, which the message names (``prompts[1]``).

    Raises
    ------
    ValueError
        Naming ``prompts[index]``: not a string, blank, or holding a lone surrogate
        (:func:`alisa.checks.check_text`; the tokenizer would raise a ``TypeError`` of its own).
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompts[{index}]={prompt!r} is empty or not a string")
    check_text(prompt, f"prompts[{index}]")


__all__ = ["GenerationOutput", "SamplingOptions", "cache_kv_bytes", "generate", "run_notes"]


def run_notes(model: nn.Module, config: AlisaConfig, shape: ModelShape, longest: int) -> list[str]:
    """What a run of ``config`` on ``model`` changes nothing by, when its rows hold at most
    ``longest`` tokens each (prompt, padding included, and new tokens): the one rule behind
    ``generate``'s and ``run_batch``'s :class:`~alisa.settings.IgnoredSettingWarning`.

    A note that holds for the longest row holds for every shorter one (a floor, sinks or a ring
    that cover ``longest`` tokens cover fewer), so a job of rows of many lengths is told once.

    Parameters
    ----------
    model
        The model the run's caches are built for (its context bounds the ring).
    config
        The run's cache config.
    shape
        The model's shape (:func:`alisa.model.adapter.model_shape`): its layers' windows.
    longest
        The most tokens one row of the run holds.

    Returns
    -------
    list[str]
        :func:`~alisa.settings.no_evicting_layer_note` (a model of sliding layers only),
        :func:`~alisa.settings.evicts_nothing_note`,
        :func:`~alisa.settings.long_stride_note` and
        :func:`~alisa.settings.full_precision_note`, those that hold, in that order. The last
        is left out when ``residual_tokens`` covers the model's whole context: the cache says
        that itself when it is built.
    """
    notes = [
        no_evicting_layer_note(config, shape.windows),
        evicts_nothing_note(config, shape.num_layers, longest),
        long_stride_note(config, longest),
    ]
    known = context_length(model)
    if known is None or config.residual_tokens < known[0]:
        notes.append(full_precision_note(config, longest))
    return [note for note in notes if note is not None]
