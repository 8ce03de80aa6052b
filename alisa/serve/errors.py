"""Errors a client is told, in the OpenAI API's shape: ``{"error": {"message", "type", "param",
"code"}}`` with an HTTP status. Nothing else ever reaches a client: no traceback, no repr."""

from __future__ import annotations

# The OpenAI reference's error types, by HTTP status (what its clients map to exceptions).
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request the server answers with an error instead of a completion.

    Parameters
    ----------
    status
        HTTP status: 400 a bad request, 404 an unknown model or path, 503 the queue is full or
        the server is draining, 500 a failure of the server itself.
    message
        One line for the user, naming the field and its value where one is at fault.
    param
        The body field at fault (``"max_tokens"``, ``"messages[0].content"``,
        ``"alisa.caching_ratio"``), or None.
    code
        A short machine-readable reason (``"context_length_exceeded"``, ``"queue_full"``), or
        None.
    """

    # Not a frozen dataclass: Python and pytest set attributes on exceptions (__notes__).
    def __init__(
        self, *, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        if status not in ERROR_TYPES:
            raise ValueError(f"status={status!r} is not one of {sorted(ERROR_TYPES)}")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The JSON body of the response."""
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES[self.status],
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming ``param``."""
    return APIError(status=400, message=message, param=param, code=code)


def internal_error(what: str) -> APIError:
    """A 500: the server's own work failed at ``what``. The client is told no Python detail (an
    exception's type and text mean nothing to it); the server's log has the traceback."""
    return APIError(
        status=500,
        message=f"{what} failed inside the server (not a fault of the request); the server's log "
        "has the details",
        code="internal_error",
    )
