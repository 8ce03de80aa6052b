"""From a parsed request to what the engine runs: token ids, cache settings and a length that
fit the model's context and the server's budget, or a 400 saying which does not and by how much.

Every check that depends on the model is here, before the request is queued: the scheduler
would refuse such a request too, but only once it reached the head of the queue.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from alisa.config import AlisaConfig
from alisa.jobs.sizing import ring_refusal_note, running_memory
from alisa.jobs.stream import ByteBudget
from alisa.kv.cache import AlisaCache
from alisa.model.adapter import model_shape
from alisa.model.loading import context_length, prompt_length_error
from alisa.planning.spec import model_spec
from alisa.runtime.generate import run_notes
from alisa.runtime.requests import TOKENIZER_HINT, RowShape, past_vocabulary, vocabulary_size
from alisa.serve.errors import APIError, bad_request
from alisa.serve.protocol import GenerationRequest
from alisa.serve.settings import ServeSettings
from alisa.settings import IgnoredSettingWarning, ignored_settings
from alisa.sizes import format_bytes

CHECKED_CONFIGS = 256  # distinct per-request cache settings remembered as valid for the model


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A request ready to queue.

    Parameters
    ----------
    prompt_ids
        The prompt's tokens (the chat template applied, for chat).
    max_tokens
        Tokens to generate at most.
    config
        Its cache settings (the server's, with the request's own on top).
    notes
        What the request's own cache settings change nothing by at its length (a floor that
        keeps every token, ...: :func:`~alisa.runtime.generate.run_notes`, in the request's
        words), for the response's ``X-Alisa-Ignored`` header.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    config: AlisaConfig
    notes: tuple[str, ...] = ()


class Preparer:
    """Tokenizes and sizes requests for one model and server.

    Parameters
    ----------
    model, tokenizer
        The served model.
    settings
        The server's settings (default length, cache settings, budgets).
    """

    def __init__(self, model, tokenizer, settings: ServeSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.context = context_length(model, tokenizer)
        self.shape = model_shape(model)
        self.spec = model_spec(model, self.shape)
        self.vocab_size = vocabulary_size(model)
        self._valid: set[AlisaConfig] = {settings.config}
        # A text longer than this cannot fit the context however it is tokenized: refused
        # before tokenizing, which runs on the event loop (30 MiB of one letter held it, and
        # every other request, for minutes). Twice the bound: a normalizer may shorten text.
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        self.longest_token = max(longest, 1)
        self.max_text_chars = (
            None if self.context is None else 2 * self.context[0] * self.longest_token
        )

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Token ids, length and config of ``request``.

        Raises
        ------
        APIError
            400 naming the field: a bad cache setting, a chat the model has no template for,
            an empty prompt or a token id past the vocabulary, a prompt (with ``max_tokens``)
            past the context, or one the budget cannot hold even alone.
        """
        config = self.config(request)
        ids = self.prompt_ids(request)
        max_tokens = self._length(request, len(ids))
        self._check_budget(len(ids), max_tokens, config, request.prompt_field)
        notes = ()
        if request.cache:  # the server's own settings are its operator's, not the client's
            found = run_notes(self.model, config, self.shape, len(ids) + max_tokens)
            notes = tuple(_in_request_words(note) for note in found)
        return Prepared(prompt_ids=ids, max_tokens=max_tokens, config=config, notes=notes)

    def config(self, request: GenerationRequest) -> AlisaConfig:
        """The server's cache settings with the request's ``"alisa"`` ones on top, checked
        against the model (a layer count it lacks, a policy its attention cannot run); a
        setting the request gives that would change nothing is refused too (the CLI warns, but
        a client is never shown a warning)."""
        if not request.cache:
            return self.settings.config
        given = dict(request.cache)
        try:
            with warnings.catch_warnings():  # refused below, in the request's words
                warnings.simplefilter("ignore", IgnoredSettingWarning)
                config = self.settings.config.with_overrides(**given)
                if config.retention != "host" and config.host_memory is not None:
                    # The server's host budget bounds host regions; this request keeps none.
                    config = config.with_overrides(host_memory=None)
            notes = ignored_settings(config, typed=given)
            if config not in self._valid:
                # What the engine will build, built once here: its checks need the model. (Its
                # attach() is a no-op: the engine thread attached the model before serving.)
                # What it says a setting changes nothing on this model counts too.
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", IgnoredSettingWarning)
                    AlisaCache(self.model, config)
                for seen in caught:  # others go on to the log, as they would have
                    if seen.category is IgnoredSettingWarning:
                        notes.append(str(seen.message))
                    else:
                        warnings.warn_explicit(
                            seen.message, seen.category, seen.filename, seen.lineno
                        )
            unread = [note for note in notes if note.split("=")[0] in given]
            if unread:
                raise ValueError(unread[0])
            if config not in self._valid and len(self._valid) < CHECKED_CONFIGS:
                self._valid.add(config)
        except ValueError as error:
            raise _config_error(str(error), given) from None
        return config

    def prompt_ids(self, request: GenerationRequest) -> tuple[int, ...]:
        """The prompt's tokens: given, tokenized, or the chat template's text tokenized (as
        ``alisa generate --chat`` does, so the same conversation gives the same tokens)."""
        if isinstance(request.prompt, tuple):
            found = past_vocabulary(request.prompt, self.vocab_size)
            if found is not None:
                index, token = found
                raise bad_request(
                    f"prompt[{index}]={token} is past the model's vocabulary of "
                    f"{self.vocab_size} tokens",
                    f"prompt[{index}]",
                )
            return request.prompt
        text = self._chat_text(request) if request.chat else request.prompt
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise bad_request(
                f"{request.prompt_field} has {len(text)} characters, more than any tokenization "
                f"of them fits in the model's context of {self.context[0]} tokens (its longest "
                f"token has {self.longest_token} characters)",
                request.prompt_field,
                code="context_length_exceeded",
            )
        ids = tuple(self.tokenizer(text)["input_ids"])
        if not ids:
            raise bad_request(f"{request.prompt_field} gives no tokens", request.prompt_field)
        found = past_vocabulary(ids, self.vocab_size)
        if found is not None:  # the server's tokenizer and model disagree: refused, not run
            raise bad_request(
                f"{request.prompt_field} tokenizes to id {found[1]}, past the model's vocabulary "
                f"of {self.vocab_size} tokens (the server's tokenizer: {TOKENIZER_HINT})",
                request.prompt_field,
            )
        return ids

    def _chat_text(self, request: GenerationRequest) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                "this model's tokenizer has no chat template (a base model?); send the text to "
                "/v1/completions instead",
                "messages",
                "no_chat_template",
            )
        messages = [{"role": role, "content": text} for role, text in request.messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as error:  # the template's own checks (jinja2 raise_exception)
            message = " ".join(str(error).split())
            raise bad_request(
                f"the model's chat template refused the messages: {message}", "messages"
            ) from None

    def _length(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """``max_tokens``, or the server's default clipped to the context; past the context
        (positions there are garbage) a 400."""
        field = request.prompt_field
        if self.context is not None and prompt_tokens >= self.context[0]:
            limit, source = self.context
            raise bad_request(
                f"the prompt has {prompt_tokens} tokens, which leaves no room for a token to "
                f"generate in the model's context of {limit} tokens ({source}); shorten the "
                f"{field}",
                field,
                "context_length_exceeded",
            )
        if request.max_tokens is None:
            room = self.settings.max_tokens
            if self.context is not None:
                room = min(room, self.context[0] - prompt_tokens)
            return room
        error = prompt_length_error(prompt_tokens, self.context, request.max_tokens)
        if error is not None:
            raise bad_request(
                error.replace("max_new_tokens", "max_tokens") + "; lower max_tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        return request.max_tokens

    def _check_budget(
        self, prompt_tokens: int, max_tokens: int, config: AlisaConfig, field: str
    ) -> None:
        """A request the budget cannot hold even alone would never start: a 400 with its size
        and the budget (the field blamed: ``max_tokens`` when fewer tokens would fit)."""
        settings = self.settings
        host = config.host_memory if config.retention == "host" else None
        if settings.kv_bytes is None and settings.device_bytes is None and host is None:
            return
        budget = ByteBudget(
            spec=self.spec,
            config=config,
            device_bytes=settings.device_bytes,
            kv_bytes=settings.kv_bytes,
            max_rows=1,
        )
        if budget.admits([], [RowShape(prompt_tokens, max_tokens)]):
            return
        memory = running_memory(self.spec, config, [], [(prompt_tokens, max_tokens)])
        limits = [
            f"{flag} {format_bytes(value)}"
            for flag, value in (
                ("--kv-memory", settings.kv_bytes),
                ("--gpu-memory", settings.device_bytes),
                ("--host-memory", budget.host_bytes if memory.host else None),
            )
            if value is not None
        ]
        param = "max_tokens" if budget.admits([], [RowShape(prompt_tokens, 1)]) else field
        fix = f"lower max_tokens or shorten the {field}"
        # A ring covering the whole request makes coded KV the larger: say the setting first.
        hint = ring_refusal_note(self.spec, config, prompt_tokens, max_tokens)
        if hint:
            fix = f"{hint}; or {fix}"
        host_note = f" and {format_bytes(memory.host)} of host region" if memory.host else ""
        raise APIError(
            status=400,
            message=(
                f"a prompt of {prompt_tokens} tokens with max_tokens={max_tokens} needs "
                f"{format_bytes(memory.kv)} of KV ({format_bytes(memory.total)} with the "
                f"weights and activations){host_note}, more than the server's budget of "
                f"{' and '.join(limits)} even alone; {fix}"
            ),
            param=param,
            code="exceeds_budget",
        )


def _in_request_words(note: str) -> str:
    """A run note as a client reads it: ``min_budget_tokens=64 ...`` names the request's field,
    ``alisa.min_budget_tokens=64 ...``, on one line (a response header holds no line break)."""
    note = f"alisa.{note}" if re.match(r"\w+=", note) else note
    return " ".join(note.split()).encode("ascii", "replace").decode()  # a header is latin-1


def _config_error(message: str, given: dict) -> APIError:
    """A cache setting's error, naming the ``alisa.<field>`` it is about (and saying when that
    field is the server's, not the request's)."""
    message = re.sub(r" \(--[\w-]+\)", "", " ".join(message.split()))  # no CLI flags here
    name = message.split("=", 1)[0] if "=" in message else ""
    if name in given:
        return bad_request(f"alisa.{message}", f"alisa.{name}")
    if name:
        message += f" (the server's {name} applies unless the request sets alisa.{name})"
    return bad_request(f"alisa: {message}", "alisa")
