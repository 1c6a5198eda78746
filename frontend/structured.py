"""The API without structured generation: a server whose engine has no xgrammar (EngineInfo.structured).

xgrammar is a base dependency only on the platforms it publishes wheels for (pyproject.toml). Elsewhere the
server still serves; what needs a grammar is handled where the request is parsed, so that a refusal names the
field the client sent (never the engine's internal ``structural_tag``):

- ``strict: true`` on a tool under ``tool_choice: "auto"``: best effort (the call is parsed, not constrained),
  as most clients send ``strict`` on every tool;
- ``tool_choice: "required"`` or a named function, ``response_format`` json_object / json_schema (the
  Responses API's ``text.format``), /generate's ``regex`` / ``json_schema`` / ``ebnf``: a 400 naming that field,
  since the output could not be guaranteed.
"""
from __future__ import annotations

import logging

from .errors import bad_request

logger = logging.getLogger(__name__)

# Where pyproject's marker installs xgrammar with radixserve (its wheels, and apache-tvm-ffi's).
PLATFORMS = "Linux x86-64 / aarch64, macOS arm64 and Windows x64 / arm64, CPython 3.10-3.14"
OFF_WARNING = ("structured generation is off: xgrammar is not installed (it installs with radixserve on "
               f"{PLATFORMS}). Answered with a 400 naming the field: tool_choice \"required\" and named functions, "
               "response_format json_object / json_schema (Responses: text.format), /generate's regex / json_schema "
               "/ ebnf. Tools with strict: true are called unconstrained (best effort)")


def warn_if_off(structured: bool) -> None:
    """The start-up warning (once per server) when the engine has no xgrammar."""
    if not structured:
        logger.warning(OFF_WARNING)


def require(structured: bool, param: str, what: str, instead: str = "") -> None:
    """A 400 naming `param` (the client's own field) when `what` it asked for needs a grammar this server lacks;
    `instead`: what the client can send instead."""
    if not structured:
        message = (f"{what} needs structured generation, and xgrammar is not installed on this server (it installs "
                   f"with radixserve on {PLATFORMS})")
        raise bad_request(message + (f"; {instead}" if instead else ""), param, code="unsupported_parameter")
