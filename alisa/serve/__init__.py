"""``alisa serve``: an OpenAI-compatible HTTP server on the continuous scheduler.

One process: uvicorn's event loop answers HTTP (:mod:`~alisa.serve.app`) while one engine
thread (:mod:`~alisa.serve.engine`) runs the model through continuous schedulers under the
server's byte budget. Requests are read and checked first (:mod:`~alisa.serve.protocol`,
:mod:`~alisa.serve.prepare`); answers are decoded as they come (:mod:`~alisa.serve.text`);
``/metrics`` is Prometheus' (:mod:`~alisa.serve.metrics`); :mod:`~alisa.serve.server` runs it
all and drains on SIGTERM.
"""

from alisa.serve.server import AlisaServer, bind
from alisa.serve.settings import ServeSettings

__all__ = ["AlisaServer", "ServeSettings", "bind"]
