"""One server: the engine, the app, and uvicorn serving it on a socket until drained.

The model computes on the thread that calls :meth:`AlisaServer.run` (the main thread of ``alisa
serve``, which loaded it: one OpenMP pool, :mod:`alisa.serve.engine`), uvicorn's event loop on a
thread of its own. SIGTERM (or Ctrl-C) drains: the socket stays open and new requests get 503,
every request already accepted runs to its end, then uvicorn closes the connections and
:meth:`AlisaServer.run` returns (``alisa serve`` exits 0). A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn

from alisa.ops.backends import model_ops
from alisa.serve.app import ServeState, create_app
from alisa.serve.engine import ServeEngine
from alisa.serve.metrics import ServeMetrics
from alisa.serve.prepare import Preparer
from alisa.serve.settings import ServeSettings

LOG = logging.getLogger("uvicorn.error")  # uvicorn's own lines: where a server's operator looks
GRACEFUL_S = 30  # after the drain, seconds uvicorn waits for responses still being written


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first signal instead of closing the socket.

    A signal is only noted where it lands (:meth:`handle_exit`, on the main thread, which may be
    inside the engine's step holding its lock) and acted on at uvicorn's next tick, every 0.1 s.
    """

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state
        self.stopped_by: int | None = None  # the second signal, which stopped it at once
        self._signals: deque[int] = deque()  # noted, not yet acted on (appends are atomic)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)

    def _act_on(self, sig: int) -> None:
        running = self.state.engine.open_requests
        if self.state.draining:  # a second signal: stop now
            if self.stopped_by is not None:
                return  # already stopping
            LOG.warning(
                "a second signal: stopping now, %d request(s) still running dropped (their "
                "clients get no answer); the process exits with the signal's status",
                running,
            )
            # Not uvicorn's own handle_exit: its forced exit cancels the running requests'
            # tasks (a traceback in the log and a 500 to each client) and raises the signal
            # again once the loop has stopped. The next tick hangs up on the clients instead:
            # each request sees its client gone and is cancelled, as any disconnect is.
            self.stopped_by = sig
            return
        LOG.warning(
            "draining: %d request(s) running finish, new ones get 503; a second signal stops "
            "at once, dropping them",
            running,
        )
        # Not recorded as uvicorn's captured signal: it would raise it again once the server
        # has stopped, and the process would die of it instead of exiting 0 after the drain.
        self.state.draining = True

    async def on_tick(self, counter: int) -> bool:
        while self._signals:
            self._act_on(self._signals.popleft())
        if self.stopped_by is not None and not self.should_exit:
            for connection in list(self.server_state.connections):
                connection.transport.close()  # its client gets no answer
            self.should_exit = True
        if self.state.draining and self.state.engine.open_requests == 0:
            self.should_exit = True
        return await super().on_tick(counter)


class AlisaServer:
    """An OpenAI-compatible server of one model.

    Parameters
    ----------
    model, tokenizer
        The model to serve (loaded; its attention is routed through alisa while serving).
    settings
        Cache settings, budgets and limits.
    log_level
        uvicorn's log level (``"info"`` logs each request).
    """

    def __init__(
        self, model, tokenizer, settings: ServeSettings, *, log_level: str = "info"
    ) -> None:
        kernels = model_ops(model, settings.config.kernels).describe()  # "auto" resolved
        self.metrics = ServeMetrics(settings.config, settings.budgets, settings.model_name, kernels)
        self.engine = ServeEngine(model, tokenizer, settings, self.metrics)
        self.state = ServeState(self.engine, Preparer(model, tokenizer, settings), self.metrics)
        self.app = create_app(self.state)
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_level=log_level,
            timeout_graceful_shutdown=GRACEFUL_S,
        )
        self.server = _DrainingServer(config, self.state)

    def run(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound; see :func:`bind`) until drained or stopped; blocks.

        The model computes on the calling thread, which should be the one that loaded it;
        uvicorn runs on another. SIGINT and SIGTERM drain only when called from the main thread
        (where signals land), as uvicorn does.
        """
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                self.server.run(sockets=[sock])
            except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
                failed.append(error)
            finally:
                self.engine.stop()  # the engine's loop on the caller's thread ends

        http = threading.Thread(target=serve, name="alisa-http", daemon=True)
        with self._signals():
            self.engine.run(ready=http.start)
            if http.ident is None:  # the engine failed before it could take a request
                raise RuntimeError(f"the engine did not start: {self.engine.failure}")
            http.join()  # an engine that failed later: HTTP answers 503 until a signal
        if failed:
            raise failed[0]

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM drain while serving, on the main thread; the handlers before come
        back after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.server.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def drain(self) -> None:
        """Start draining, as SIGTERM does (from any thread)."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        """Stop serving now (from any thread); open requests fail with 503."""
        self.server.should_exit = True

    @property
    def started(self) -> bool:
        return self.server.started

    @property
    def stopped_by(self) -> int | None:
        """The second signal that stopped serving at once, dropping what ran; None when it
        drained (or was stopped by :meth:`stop`)."""
        return self.server.stopped_by


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port), bound before the model
    loads so that a port in use fails at once.

    Raises
    ------
    OSError
        The address cannot be bound (in use, not this machine's, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def base_url(host: str, port: int) -> str:
    """The ``http://HOST:PORT/v1`` address clients are given for a listening ``host``:``port``,
    an IPv6 address in brackets (``http://[::1]:8000/v1``: bare, its colons read as the port's)."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"
