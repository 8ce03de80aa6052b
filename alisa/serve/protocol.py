"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, read and checked.

Every field is checked before any work: a wrong type, a value out of range, an unknown field or
one this server cannot honour is a 400 naming the field (:class:`~alisa.serve.errors.APIError`).
A field the OpenAI reference defines but alisa cannot compute (``echo``, ``logprobs``,
penalties, tools) is accepted only at the value that asks for nothing, so a client is never
given an answer that silently ignored what it asked.

Sampling follows the OpenAI reference: ``temperature`` 0 is greedy (argmax, token-identical to
``alisa generate``); anything else, including leaving it out, samples, and fields left out take
the model's generation config (``SamplingOptions``' defaults, as ``alisa generate --do-sample``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields

from alisa.checks import check_text
from alisa.config import AlisaConfig
from alisa.runtime.sampling import SamplingOptions
from alisa.serve.errors import APIError, bad_request

# The cache settings a request may choose for itself (``"alisa": {...}``): every AlisaConfig
# field but the memory budgets and tiers, which belong to the whole server.
SERVER_ONLY_FIELDS = ("gpu_memory", "host_memory", "recompute", "profile")
REQUEST_CACHE_FIELDS = tuple(
    item.name for item in fields(AlisaConfig) if item.init and item.name not in SERVER_ONLY_FIELDS
)
ROLES = ("system", "user", "assistant")
MAX_STOP = 16  # stop strings per request (each is searched in the text at every token)
# A JSON escape of half a UTF-16 pair (\ud800-\udfff): only a body holding one can give a lone
# surrogate, so only such a body has its strings checked (a pair, as in an escaped emoji, is fine).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class _NoOp:
    """A field of the OpenAI reference alisa cannot honour, and the value that asks for nothing.

    ``kind`` is the JSON type the reference gives the field (as :func:`_kind` words it; None:
    several), so that a value of another type is told its type is wrong (``"0"`` is no number)
    rather than that it is not the no-op value it may look like.
    """

    allowed: Callable[[object], bool]
    value: str
    reason: str
    kind: str | None


def _number(target: int) -> Callable[[object], bool]:
    """Whether a value is the number ``target`` (JSON's ``true`` is no number, though Python's
    ``True == 1``)."""
    return lambda value: not isinstance(value, bool) and value == target


def _empty(value) -> bool:
    return value in ({}, [])


# Fields of the OpenAI reference alisa cannot honour: accepted only at the value that asks for
# nothing (null always passes), else refused naming the field and why.
PENALTY = "penalties are not implemented"
UNSUPPORTED = {
    "frequency_penalty": _NoOp(_number(0), "0", PENALTY, "a number"),
    "presence_penalty": _NoOp(_number(0), "0", PENALTY, "a number"),
    "logit_bias": _NoOp(_empty, "{}", "logit bias is not implemented", "an object"),
}
COMPLETION_UNSUPPORTED = {
    "echo": _NoOp(lambda value: value is False, "false", "the prompt is not echoed", "a boolean"),
    "logprobs": _NoOp(lambda value: False, "null", "log-probabilities are not returned", None),
    "best_of": _NoOp(_number(1), "1", "one completion per request", "a number"),
    "suffix": _NoOp(lambda value: value == "", '""', "insertion is not supported", "a string"),
}
CHAT_UNSUPPORTED = {
    "logprobs": _NoOp(
        lambda value: value is False, "false", "log-probabilities are not returned", "a boolean"
    ),
    "top_logprobs": _NoOp(_number(0), "0", "log-probabilities are not returned", "a number"),
    "tools": _NoOp(_empty, "[]", "tool calls are not supported", "an array"),
    # A string or an object naming a function in the reference.
    "tool_choice": _NoOp(
        lambda value: value == "none", '"none"', "tool calls are not supported", None
    ),
    "response_format": _NoOp(
        lambda value: value == {"type": "text"},
        '{"type": "text"}',
        "structured output is not supported",
        "an object",
    ),
}
COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "alisa",
    "return_token_ids",
    "ignore_eos",
)
COMPLETION_FIELDS = ("prompt", *COMMON_FIELDS, *UNSUPPORTED, *COMPLETION_UNSUPPORTED)
CHAT_FIELDS = (
    "messages",
    "max_completion_tokens",
    *COMMON_FIELDS,
    *UNSUPPORTED,
    *CHAT_UNSUPPORTED,
    "parallel_tool_calls",  # any boolean: without tools it asks for nothing
)


# The response header that names the request's fields that changed nothing
# (GenerationRequest.ignored).
IGNORED_HEADER = "X-Alisa-Ignored"


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One parsed request body, before its prompt is tokenized.

    Parameters
    ----------
    chat
        True for ``/v1/chat/completions`` (``messages``), False for ``/v1/completions``
        (``prompt``).
    prompt
        Completions: the prompt text, or its token ids. Chat: None.
    messages
        Chat: the conversation as ``(role, text)`` pairs. Completions: empty.
    model
        The model the client named (None: not named).
    max_tokens
        Tokens to generate at most (None: the server's default, clipped to the context).
    sampling
        Greedy for ``temperature`` 0, else sampling.
    stop
        Strings that end the answer (not included in it).
    stream, include_usage
        Server-sent events; a last chunk with the token counts.
    cache
        The request's own cache settings (``"alisa"`` field), as (field, value) pairs.
    return_token_ids
        Add the prompt's and the answer's token ids to the response (vLLM's extension).
    ignore_eos
        Generate ``max_tokens`` whatever the model says (vLLM's extension, for benchmarks of
        equal work): EOS does not end the answer.
    ignored
        Sampling fields the body sets that change nothing (``top_p``, ``top_k``, ``seed`` at
        ``temperature`` 0, which is greedy decoding). Accepted, as OpenAI's API and vLLM do
        (clients such as lm-evaluation-harness send a seed with temperature 0), and said: the
        response's :data:`IGNORED_HEADER` names them, and the server logs each field once.
    """

    chat: bool
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] = ()
    model: str | None = None
    max_tokens: int | None = None
    sampling: SamplingOptions = SamplingOptions()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache: tuple[tuple[str, object], ...] = ()
    return_token_ids: bool = False
    ignore_eos: bool = False
    ignored: tuple[str, ...] = ()

    @property
    def prompt_field(self) -> str:
        """The body field a prompt that is too long is blamed on."""
        return "messages" if self.chat else "prompt"


class _LongInteger:
    """An integer of more digits than Python reads (its int-string limit guards against slow
    conversions), kept as its digit count so that the field holding it can be named."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def read_json(raw: bytes) -> dict:
    """The body as a JSON object.

    Raises
    ------
    APIError
        400: not UTF-8, not JSON (or nested too deeply to read), not an object, or a string
        holding a lone surrogate or an integer of more digits than Python reads (naming the
        field that holds it).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8", code="invalid_json") from None
    try:
        body, marked = _parse(text)
    except json.JSONDecodeError as error:
        raise bad_request(
            f"the request body is not valid JSON: {error.msg} at line {error.lineno} column "
            f"{error.colno}",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise bad_request(
            "the request body nests arrays or objects too deeply to read (no field of this API "
            "nests more than a few levels)",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json"
        )
    if marked or SURROGATE_ESCAPE.search(text):
        _check_values(body)
    return body


def _parse(text: str) -> tuple[object, bool]:
    """The JSON value of ``text``, and whether it holds a :class:`_LongInteger`."""
    try:
        return json.loads(text, object_pairs_hook=_unique), False
    except json.JSONDecodeError:
        raise
    except ValueError:  # the int-string limit, raised bare: read again, marking such integers
        return json.loads(text, parse_int=_integer, object_pairs_hook=_unique), True


def _unique(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once: ``{"max_tokens": 2, "max_tokens": 3}``
    would otherwise be read as its last value, a setting silently dropped (as
    :mod:`alisa.jsonl` refuses such a row)."""
    body = dict(pairs)
    if len(body) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise bad_request(
            f"the request body gives the field {twice!r} more than once; give each field once",
            param=twice,
            code="invalid_json",
        )
    return body


def _integer(text: str) -> int | _LongInteger:
    try:
        return int(text)
    except ValueError:
        return _LongInteger(text)


def _check_values(body: dict) -> None:
    """Refuse a string (or a field name) holding a lone surrogate, which no tokenizer and no
    UTF-8 response can take, and a :class:`_LongInteger`: a 400 naming the field."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        try:
            if isinstance(value, dict):
                for key in value:
                    check_text(key, f"a field name in {path or 'the body'}")
                items = [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
                stack.extend(reversed(items))  # the first field at fault is the one named
            elif isinstance(value, list):
                stack.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(value)]))
            elif isinstance(value, str):
                check_text(value, path)
        except ValueError as error:
            raise bad_request(str(error), path or None) from None
        if isinstance(value, _LongInteger):
            raise bad_request(
                f"{path} is an integer of {value.digits} digits, past any value a field takes "
                f"(this server reads integers of at most {sys.get_int_max_str_digits()} digits)",
                path,
            )


def parse_completion(body: dict) -> GenerationRequest:
    """A ``/v1/completions`` body (``prompt``: a string, a list of one string, token ids or a
    list of one list of token ids).

    Raises
    ------
    APIError
        400 naming the field at fault.
    """
    _check_fields(body, COMPLETION_FIELDS, {**UNSUPPORTED, **COMPLETION_UNSUPPORTED})
    if body.get("prompt") is None:
        raise bad_request("prompt is required", "prompt", "missing_field")
    return GenerationRequest(
        chat=False, prompt=_prompt(body["prompt"]), **_common(body, _optional_tokens(body))
    )


def parse_chat(body: dict) -> GenerationRequest:
    """A ``/v1/chat/completions`` body (``messages``: system, user and assistant turns whose
    ``content`` is a string or a list of text parts).

    Raises
    ------
    APIError
        400 naming the field at fault.
    """
    _check_fields(body, CHAT_FIELDS, {**UNSUPPORTED, **CHAT_UNSUPPORTED})
    _optional_bool(body, "parallel_tool_calls")
    if body.get("messages") is None:
        raise bad_request("messages is required", "messages", "missing_field")
    tokens = _optional_tokens(body)
    newer = _optional_int(body, "max_completion_tokens", 1)
    if newer is not None and tokens is not None and newer != tokens:
        raise bad_request(
            f"max_tokens={tokens} and max_completion_tokens={newer} disagree; give one",
            "max_completion_tokens",
        )
    max_tokens = newer if newer is not None else tokens
    return GenerationRequest(
        chat=True, messages=_messages(body["messages"]), **_common(body, max_tokens)
    )


def _check_fields(body: dict, known: tuple[str, ...], unsupported: dict[str, _NoOp]) -> None:
    """Refuse unknown fields, and fields alisa cannot honour set to anything but a no-op."""
    for name, value in body.items():
        if name not in known:
            raise bad_request(
                f"unknown field {name!r}; this endpoint takes: {', '.join(sorted(set(known)))}",
                name,
                "unknown_field",
            )
        if name in unsupported and value is not None and not unsupported[name].allowed(value):
            raise _not_a_no_op(name, value, unsupported[name])


def _not_a_no_op(name: str, value: object, no_op: _NoOp) -> APIError:
    """The 400 of a field alisa cannot honour set to ``value``: of the wrong JSON type (a
    client's type error), or of the right type but asking for what is not implemented."""
    if no_op.kind is not None and _kind(value) != no_op.kind:
        return bad_request(
            f"{name}={_show(value)} must be {no_op.kind} ({no_op.value}: {no_op.reason})", name
        )
    return bad_request(
        f"{name}={_show(value)} is not supported: it must be {no_op.value} ({no_op.reason})",
        name,
        "unsupported_value",
    )


def _common(body: dict, max_tokens: int | None) -> dict:
    """The fields both endpoints share, as :class:`GenerationRequest` keywords."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model={_show(model)} must be a string", "model")
    n = _optional_int(body, "n", 1)
    if n not in (None, 1):
        raise bad_request(f"n={n} is not supported: one completion per request (n=1)", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"user={_show(user)} must be a string", "user")
    stream = _optional_bool(body, "stream") or False
    sampling, ignored = _sampling(body)
    return {
        "model": model,
        "max_tokens": max_tokens,
        "sampling": sampling,
        "ignored": ignored,
        "stop": _stop(body.get("stop")),
        "stream": stream,
        "include_usage": _stream_options(body.get("stream_options"), stream),
        "cache": _cache(body.get("alisa")),
        "return_token_ids": _optional_bool(body, "return_token_ids") or False,
        "ignore_eos": _optional_bool(body, "ignore_eos") or False,
    }


def _optional_tokens(body: dict) -> int | None:
    return _optional_int(body, "max_tokens", 1)


def _prompt(value) -> str | tuple[int, ...]:
    """A prompt string or token ids; a list of several prompts is refused (n=1, one answer)."""
    if value in ("", []):
        raise bad_request("prompt is empty", "prompt")
    if isinstance(value, list) and not isinstance(value[0], str | list | dict):
        # Token ids, as its first item says: an item of another kind is a bad id, not a prompt.
        return _token_ids(value, "prompt")
    if isinstance(value, list):
        if len(value) != 1:
            raise bad_request(
                f"prompt is a list of {len(value)} prompts; this server completes one prompt "
                "per request (send them as separate requests, concurrently)",
                "prompt",
            )
        value = value[0]
        if isinstance(value, list):
            return _token_ids(value, "prompt[0]")
        if not isinstance(value, str):
            raise bad_request(
                f"prompt[0]={_show(value)} must be a string or a list of token ids", "prompt[0]"
            )
    if not isinstance(value, str):
        raise bad_request(
            f"prompt={_show(value)} must be a string, a list of one string, or token ids",
            "prompt",
        )
    if not value:
        raise bad_request("prompt[0] is empty", "prompt[0]")
    return value


def _token_ids(value: list, field: str) -> tuple[int, ...]:
    if not value:
        raise bad_request(f"{field} is an empty list of token ids", field)
    for index, item in enumerate(value):
        if not _is_int(item) or item < 0:
            raise bad_request(
                f"{field}[{index}]={_show(item)} must be a token id (an integer >= 0)",
                f"{field}[{index}]",
            )
    return tuple(value)


def _messages(value) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise bad_request(
            f"messages={_show(value)} must be a non-empty list of "
            '{"role": ..., "content": ...} objects',
            "messages",
        )
    turns = []
    for index, message in enumerate(value):
        field = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{field}={_show(message)} must be an object", field)
        for key in message:
            if key not in ("role", "content", "name"):
                raise bad_request(
                    f"{field} has an unknown field {key!r}; a message takes role, content, name",
                    f"{field}.{key}",
                    "unknown_field",
                )
        for key in ("role", "content"):
            if key not in message:  # not sent, which a null would claim it was
                raise bad_request(f"{field}.{key} is required", f"{field}.{key}", "missing_field")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{field}.role={_show(role)} must be one of {', '.join(ROLES)}", f"{field}.role"
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{field}.name={_show(name)} must be a string", f"{field}.name")
        turns.append((role, _content(message.get("content"), f"{field}.content")))
    return tuple(turns)


def _content(value, field: str) -> str:
    """A message's text: a string, or text parts joined by newlines (as vLLM joins them)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{field}={_show(value)} must be a string or a list of text parts", field)
    texts = []
    for index, part in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(
                f'{where}={_show(part)} must be a text part {{"type": "text", "text": ...}} '
                "(images and audio are not supported)",
                where,
            )
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise bad_request(f'{where} must hold "type" and a string "text" only', where)
        texts.append(part["text"])
    return "\n".join(texts)


def _sampling(body: dict) -> tuple[SamplingOptions, tuple[str, ...]]:
    """The request's sampling, and the fields it sets that change nothing (greedy decoding at
    ``temperature`` 0 reads no ``top_p``, ``top_k`` or ``seed``; a ``top_p`` of 1 and a
    ``top_k`` of -1 or 0, no limit, change nothing anyway and are not named)."""
    temperature = _optional_number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad_request(f"temperature={temperature} must be >= 0", "temperature")
    top_p = _optional_number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_request(f"top_p={top_p} must be in (0, 1]", "top_p")
    top_k = _optional_int(body, "top_k", -1)
    seed = _optional_int(body, "seed", 0)
    if seed is not None and seed >= 2**64:
        raise bad_request(f"seed={seed} must be below 2**64", "seed")
    if temperature == 0:  # greedy: the other options have no effect
        given = {"top_p": top_p not in (None, 1), "top_k": top_k not in (None, -1, 0)}
        given["seed"] = seed is not None
        return SamplingOptions(), tuple(name for name, set_ in given.items() if set_)
    sampling = SamplingOptions(
        do_sample=True,
        temperature=None if temperature is None else float(temperature),
        top_k=None if top_k is None else max(top_k, 0),  # -1 (vLLM) and 0 both mean no limit
        top_p=None if top_p is None else float(top_p),
        seed=seed,
    )
    return sampling, ()


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or len(strings) > MAX_STOP:
        raise bad_request(
            f"stop={_show(value)} must be a string or a list of at most {MAX_STOP} strings",
            "stop",
        )
    for index, item in enumerate(strings):
        if not isinstance(item, str) or not item:
            raise bad_request(f"stop[{index}]={_show(item)} must be a non-empty string", "stop")
    return tuple(strings)


def _stream_options(value, stream: bool) -> bool:
    """``include_usage`` of ``stream_options`` (only with ``stream``, as the reference says)."""
    if value is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(value, dict):
        raise bad_request(f"stream_options={_show(value)} must be an object", "stream_options")
    for key in value:
        if key != "include_usage":
            raise bad_request(
                f"stream_options has an unknown field {key!r}; it takes include_usage",
                f"stream_options.{key}",
                "unknown_field",
            )
    return _optional_bool(value, "include_usage", "stream_options.") or False


def _cache(value) -> tuple[tuple[str, object], ...]:
    """The ``"alisa"`` field: cache settings of this request, checked by name and JSON type
    here (their values are checked when the config is built)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(
            f'alisa={_show(value)} must be an object of cache settings, e.g. {{"policy": '
            '"swa", "caching_ratio": 0.2}',
            "alisa",
        )
    for key, item in value.items():
        if key not in REQUEST_CACHE_FIELDS:
            why = (
                "the memory budgets and tiers are the server's (its command-line flags)"
                if key in SERVER_ONLY_FIELDS
                else f"valid: {', '.join(REQUEST_CACHE_FIELDS)}"
            )
            raise bad_request(
                f"alisa.{key} is not a cache setting a request may choose; {why}",
                f"alisa.{key}",
                "unknown_field",
            )
        if isinstance(item, list | dict):
            raise bad_request(f"alisa.{key}={_show(item)} must be a single value", f"alisa.{key}")
    return tuple(sorted(value.items()))


def _optional_int(body: dict, name: str, minimum: int, prefix: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise bad_request(
            f"{prefix}{name}={_show(value)} must be an integer >= {minimum}", prefix + name
        )
    return value


def _optional_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{name}={_show(value)} must be a finite number", name)
    return value


def _optional_bool(body: dict, name: str, prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{prefix}{name}={_show(value)} must be true or false", prefix + name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value) -> str:
    names: dict[type, str] = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
    }
    return names.get(type(value), "a number" if isinstance(value, int | float) else "null")


def _show(value, limit: int = 60) -> str:
    """``value`` as the client wrote it (JSON), cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."
