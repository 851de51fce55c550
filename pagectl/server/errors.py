"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from aiohttp import web


class APIError(Exception):
    """An error answered to the client; raised anywhere inside a handler.

    Its ``type`` is OpenAI's: ``server_error`` for a 5xx status, else ``invalid_request_error``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = "server_error" if status >= 500 else "invalid_request_error"
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """The error object, as sent in a response body or as an SSE event."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        resp = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.headers and self.headers.get("Connection") == "close":
            resp.force_close()  # e.g. a body that timed out: the connection is unusable
        return resp


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
