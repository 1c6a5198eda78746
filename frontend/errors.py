"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` with a fitting HTTP status."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a client caused or must wait out; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {
            "message": self.message,
            "type": _ERROR_TYPES.get(self.status, "error"),
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def param_from_message(message: str, names: dict[str, str]) -> str | None:
    """Guess which parameter a ValueError message is about: the first known name it starts with.

    `names` maps internal names (SamplingParams fields) to the names the client used.
    """
    head = message.split(" ", 1)[0].strip(":,")
    if head in names:
        return names[head]
    for internal, public in names.items():
        if internal in message:
            return public
    return None
