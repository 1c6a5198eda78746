"""RequestError: the engine refusing one request's input (the HTTP side turns it into a 400)."""
from __future__ import annotations


class RequestError(ValueError):
    """Bad input for one request. `param` uses the engine's names ("prompt", "max_new_tokens");
    the frontend maps them to the names its API used."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
