"""What the client scripts share: the tool they offer and how they print their report (one JSON line)."""
from __future__ import annotations

import json
import sys
from typing import Any

# A strict tool in OpenAI's form (strict needs additionalProperties false and every property required).
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current conditions in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}


def tool_calls(calls: Any) -> list[dict[str, Any]]:
    """[{"name", "arguments" (parsed JSON)}] of an SDK message's tool_calls (None: [])."""
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls or []]


def emit(report: dict[str, Any]) -> None:
    sys.stdout.write("\n" + json.dumps(report) + "\n")
