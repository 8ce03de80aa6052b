"""The HTTP side: Starlette routes in the OpenAI API's shapes, answered from the engine thread.

A request is read and checked here (:mod:`~alisa.serve.protocol`, :mod:`~alisa.serve.prepare`),
queued to the engine, and answered from the events the engine hands back to this event loop:
at once as one JSON body, or as server-sent events ending in ``data: [DONE]``. A client that
leaves, streaming or not, has its request cancelled. Every error is an OpenAI-style JSON body.
Whatever goes wrong while a request's body is read and checked is the client's: a 400 (a client
that hangs up before sending its whole body is no error at all). Only a failure of the server's
own work is a 500, which tells the client no Python detail (the server's log has the traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from alisa.serve.engine import Delta, Event, Failed, Finished, Job, ServeEngine
from alisa.serve.errors import APIError, bad_request, internal_error
from alisa.serve.metrics import ServeMetrics
from alisa.serve.prepare import Prepared, Preparer
from alisa.serve.protocol import (
    IGNORED_HEADER,
    GenerationRequest,
    parse_chat,
    parse_completion,
    read_json,
)

logger = logging.getLogger("alisa.serve")
MAX_BODY_BYTES = 32 * 1024 * 1024  # far above any context's worth of text or token ids


class ServeState:
    """What the routes share: the engine, the request checks, the metrics, and whether the
    server is draining (then new requests are refused with 503)."""

    def __init__(self, engine: ServeEngine, preparer: Preparer, metrics: ServeMetrics) -> None:
        self.engine, self.preparer, self.metrics = engine, preparer, metrics
        self.settings = engine.settings
        self.draining = False
        self.created = int(time.time())
        self.said: set[str] = set()  # request fields whose having no effect was logged


def create_app(state: ServeState) -> Starlette:
    """The ASGI app of one server.

    Parameters
    ----------
    state
        The engine (started by the caller), checks and metrics the routes use.

    Returns
    -------
    Starlette
        Routes ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
        ``GET /v1/models/{name}``, ``GET /health``, ``GET /metrics``.
    """

    async def completions(request: Request) -> Response:
        return await _generate(request, state, parse_completion)

    async def chat(request: Request) -> Response:
        return await _generate(request, state, parse_chat)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    async def model(request: Request) -> Response:
        # The OpenAI reference's retrieve-model route (``client.models.retrieve``).
        name = request.path_params["name"]
        if name != state.settings.model_name:
            raise _not_served(name, state.settings.model_name, param=None)
        return JSONResponse(_model_card(state))

    async def health(request: Request) -> Response:
        if not state.engine.alive:
            raise APIError(status=503, message="the engine is not running", code="engine_stopped")
        if state.draining:
            raise APIError(status=503, message="the server is shutting down", code="draining")
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, error: APIError) -> Response:
        state.metrics.rejected.labels(status=str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status)

    async def http_error(request: Request, error: HTTPException) -> Response:
        status = error.status_code if error.status_code in (404, 405, 413) else 400
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(APIError(status=status, message=message).body(), status_code=status)

    async def server_error(request: Request, error: Exception) -> Response:
        # Starlette raises the error again once this answered, so that uvicorn logs it.
        return JSONResponse(internal_error("the request").body(), status_code=500)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            # :path: a served name may hold slashes (owner/name, the --model directory).
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            APIError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )


async def _generate(
    request: Request, state: ServeState, parse: Callable[[dict], GenerationRequest]
) -> Response:
    """Check, queue and answer one completion or chat request."""
    arrival = time.perf_counter()
    if state.draining:
        raise APIError(
            status=503, message="the server is shutting down; retry elsewhere", code="draining"
        )
    try:
        parsed, prepared = await _read(request, state, parse)
    except ClientDisconnect:  # routine: nobody is left to answer
        logger.info("a client disconnected before sending its whole request body")
        return Response(status_code=499)
    events: asyncio.Queue[Event] = asyncio.Queue()
    job = Job(
        prepared=prepared,
        sampling=parsed.sampling,
        stop=parsed.stop,
        stream=parsed.stream,
        ignore_eos=parsed.ignore_eos,
        deliver=_deliverer(asyncio.get_running_loop(), events),
        arrival_s=arrival,
    )
    state.engine.submit(job)
    reply = _Reply(parsed, state.settings.model_name, len(prepared.prompt_ids))
    said = _ignored(parsed, prepared.notes, state)
    if parsed.stream:
        return StreamingResponse(
            _stream(state.engine, job, events, reply),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **said},
        )
    event = await _final_event(request, state.engine, job, events)
    if event is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if isinstance(event, Failed):
        return JSONResponse(event.error.body(), status_code=event.error.status)
    return JSONResponse(reply.whole(event, prepared.prompt_ids), headers=said)


def _ignored(parsed: GenerationRequest, notes: tuple[str, ...], state: ServeState) -> dict:
    """The response header naming the request's fields that change nothing (a client is
    never shown a warning, and refusing fields OpenAI's API accepts would break clients) and
    what its own cache settings change nothing by at its length (``notes``,
    :attr:`~alisa.serve.prepare.Prepared.notes`), and one log line per field for the server's
    operator, the first time a request sets it."""
    said = []
    if parsed.ignored:
        text = f"{', '.join(parsed.ignored)}: no effect at temperature=0 (greedy decoding)"
        said.append((text, list(parsed.ignored)))
    said += [(note, [note.split("=", 1)[0]]) for note in notes]  # by its field
    for text, names in said:
        if new := [name for name in names if name not in state.said]:
            state.said.update(new)
            logger.warning(
                "a request set %s; said once per field here, and in every response's %s header",
                text,
                IGNORED_HEADER,
            )
    return {IGNORED_HEADER: "; ".join(text for text, _ in said)} if said else {}


async def _read(
    request: Request, state: ServeState, parse: Callable[[dict], GenerationRequest]
) -> tuple[GenerationRequest, Prepared]:
    """The request read from its body and checked, ready to queue.

    Raises
    ------
    APIError
        400 (404 for a model not served here) naming the field at fault. Any other failure
        while reading and checking is the body's fault too: a 400 rather than a 500, and one
        line in the server's log instead of a traceback.
    ClientDisconnect
        The client hung up before sending its whole body.
    """
    try:
        parsed = parse(read_json(await _body(request)))
        name = state.settings.model_name
        if parsed.model is not None and parsed.model != name:
            raise _not_served(parsed.model, name)
        return parsed, state.preparer.prepare(parsed)
    except (APIError, ClientDisconnect):
        raise
    except Exception as error:  # noqa: BLE001 - a body no check foresaw
        text = " ".join(str(error).split())
        logger.warning("refused a request no check foresaw: %s: %s", type(error).__name__, text)
        raise bad_request(f"the request could not be read: {text or 'no detail'}") from None


def _model_card(state: ServeState) -> dict:
    """The served model as the OpenAI reference's model object (with vLLM's context length)."""
    context = state.preparer.context
    return {
        "id": state.settings.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "alisa",
        "max_model_len": context[0] if context is not None else None,
    }


def _not_served(name: str, served: str, param: str | None = "model") -> APIError:
    """The 404 of a model name this server does not serve (``param``: the body field naming
    it; None: the request's path)."""
    return APIError(
        status=404,
        message=f"model={name!r} is not served here; this server serves {served!r}",
        param=param,
        code="model_not_found",
    )


async def _body(request: Request) -> bytes:
    """The request body, refused past :data:`MAX_BODY_BYTES` before it is all read (at once
    when its ``Content-Length`` says so: the client may be waiting to send it), and refused
    when its ``Content-Type`` says it is not JSON (as FastAPI-based servers refuse it: a
    client's wrong header would otherwise go unnoticed); a body without one is read as JSON."""
    _check_json_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _check_json_type(declared: str | None) -> None:
    """Refuse a ``Content-Type`` other than ``application/json`` (or a ``+json`` type) with a
    415 naming it; None (no header) passes."""
    if declared is None:
        return
    kind, _, subtype = declared.split(";")[0].strip().lower().partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    raise APIError(
        status=415,
        message=f"Content-Type {declared!r} is not JSON: send the body as application/json "
        "(curl: -H 'Content-Type: application/json')",
        code="unsupported_media_type",
    )


def _too_large() -> APIError:
    return APIError(
        status=413,
        message=f"the request body is larger than {MAX_BODY_BYTES} bytes",
        code="body_too_large",
    )


def _deliverer(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[Event], None]:
    """What the engine thread calls to hand an event to this request's queue."""

    def deliver(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it
            loop.call_soon_threadsafe(events.put_nowait, event)

    return deliver


async def _final_event(
    request: Request, engine: ServeEngine, job: Job, events: asyncio.Queue
) -> Finished | Failed | None:
    """The job's end, or None if the client disconnected first (the job is then cancelled)."""
    left = asyncio.ensure_future(_disconnected(request))
    ended = False
    try:
        while True:
            event = asyncio.ensure_future(events.get())
            await asyncio.wait({event, left}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                return None
            if isinstance(event.result(), Finished | Failed):
                ended = True
                return event.result()
    finally:
        left.cancel()
        if not ended:  # the client left, or the server is stopping this handler
            engine.cancel(job)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    engine: ServeEngine, job: Job, events: asyncio.Queue, reply: _Reply
) -> AsyncIterator[str]:
    """Server-sent events of one job; a client that leaves cancels it (Starlette cancels this
    generator when the connection closes)."""
    ended = False
    try:
        if reply.parsed.chat:
            yield _sse(reply.chunk({"role": "assistant", "content": ""}, None, ()))
        while not ended:
            event = await events.get()
            if isinstance(event, Delta):
                if event.text or reply.parsed.return_token_ids:  # no empty chunks
                    yield _sse(reply.chunk(event.text, None, event.token_ids))
            elif isinstance(event, Finished):
                ended = True
                rest = event.token_ids[reply.sent_tokens :]  # each step's came in a Delta
                yield _sse(reply.chunk(event.delta, event.finish_reason, rest))
                if reply.parsed.include_usage:
                    yield _sse(reply.usage_chunk(event))
            else:
                ended = True
                yield _sse(event.error.body())
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            engine.cancel(job)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Reply:
    """The response bodies of one request, in its endpoint's shape."""

    def __init__(self, parsed: GenerationRequest, model: str, prompt_tokens: int) -> None:
        self.parsed, self.model, self.prompt_tokens = parsed, model, prompt_tokens
        prefix = "chatcmpl" if parsed.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_tokens = 0

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, event: Finished, prompt_ids: tuple[int, ...]) -> dict:
        """The one JSON body of a request that is not streamed."""
        if self.parsed.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": event.text}}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": event.text}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason=event.finish_reason)
        if self.parsed.return_token_ids:
            choice.update(prompt_token_ids=list(prompt_ids), token_ids=list(event.token_ids))
        body.update(choices=[choice], usage=self.usage(event))
        return body

    def chunk(self, delta: str | dict, reason: str | None, token_ids: tuple[int, ...]) -> dict:
        """One streamed chunk: new text (or a chat delta), and the finish reason at the end."""
        self.sent_tokens += len(token_ids)
        if self.parsed.chat:
            if isinstance(delta, str):
                delta = {"content": delta} if delta else {}
            choice = {"index": 0, "delta": delta}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": delta}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason=reason)
        if self.parsed.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body["choices"] = [choice]
        if self.parsed.include_usage:
            body["usage"] = None  # the reference's shape: usage only on the last chunk
        return body

    def usage_chunk(self, event: Finished) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the counts."""
        kind = "chat.completion.chunk" if self.parsed.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(event)}

    def usage(self, event: Finished) -> dict:
        generated = len(event.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.prompt_tokens + generated,
        }
