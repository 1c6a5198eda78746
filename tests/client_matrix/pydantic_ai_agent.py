"""pydantic-ai against radixserve: an Agent with a function tool, through its Chat or Responses model.

Run by tests/test_client_matrix.py with a client-only venv's python: `python pydantic_ai_agent.py URL MODEL chat`
(or `responses`). Prints one JSON report as its last line: the run's output, the tool's calls, the parts of the
agent's message history, and the requests pydantic-ai sent (path, tools, and the tool result it sent back).
"""
from __future__ import annotations

import json
import sys

import httpx2
from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from _report import emit

MODELS = {"chat": OpenAIChatModel, "responses": OpenAIResponsesModel}


def main(url: str, model_name: str, kind: str) -> None:
    sent: list[dict] = []

    async def record(request: httpx2.Request) -> None:
        sent.append({"path": request.url.path, "body": json.loads(request.content)})

    http = httpx2.AsyncClient(event_hooks={"request": [record]}, timeout=120)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    model = MODELS[kind](model_name, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, model_settings={"temperature": 0.0})
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current conditions in a city."""
        calls.append(city)
        return json.dumps({"temperature": 17, "condition": "windy"})

    result = agent.run_sync("What is the weather in Paris?")
    emit({"output": result.output, "calls": calls,
          "parts": [[_part(part) for part in message.parts] for message in result.all_messages()],
          "requests": [_summary(r) for r in sent]})


def _part(part) -> list:
    """[kind, text] of a message part (text: a text part's content, else None)."""
    return [part.part_kind, part.content if part.part_kind == "text" else None]


def _summary(request: dict) -> dict:
    body = request["body"]
    tools = body.get("tools") or []
    items = body.get("messages") or body.get("input") or []
    results = [i.get("content") or i.get("output") for i in items
               if isinstance(i, dict) and (i.get("role") == "tool" or i.get("type") == "function_call_output")]
    return {"path": request["path"], "tool_names": [t.get("name") or t["function"]["name"] for t in tools],
            "strict": [t.get("strict", t.get("function", {}).get("strict")) for t in tools],
            "tool_results": results}


if __name__ == "__main__":
    main(*sys.argv[1:4])
