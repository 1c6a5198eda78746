"""The OpenAI Agents SDK (`openai-agents`) runs an Agent with a function tool against the real server on the
scripted checkpoint, with its Responses model, its Chat Completions model, and streamed (issue 12): the tool
is called with the scripted arguments and the run returns the scripted final message."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

agents = pytest.importorskip("agents")
from openai import AsyncOpenAI  # noqa: E402

from _http_server import SCRIPTS, TOOL_RESULT_TRIGGER, scripted_server  # noqa: E402

agents.set_tracing_disabled(True)  # otherwise the SDK uploads traces to a public service


def _run(make_model, streamed: bool = False) -> tuple[str, list[str], list[tuple[str, dict, int]]]:
    calls: list[str] = []
    sent: list[tuple[str, dict, int]] = []  # (path, body, status) of every request the SDK made

    async def record(response: httpx.Response) -> None:
        sent.append((response.request.url.path, json.loads(response.request.content), response.status_code))

    @agents.function_tool
    def get_forecast(city: str) -> str:
        """The weather forecast for a city."""
        calls.append(city)
        return json.dumps({"city": city, "sky": "clear"})

    async def main() -> str:
        http = httpx.AsyncClient(event_hooks={"response": [record]})
        client = AsyncOpenAI(base_url=scripted_server().url + "/v1", api_key="unused", max_retries=0, http_client=http)
        agent = agents.Agent(name="weather", instructions="Answer with the tools.", tools=[get_forecast],
                             model=make_model(client),
                             # The scripted checkpoint's margins are finite: at temperature 1 about one
                             # token in 500 leaves the script.
                             model_settings=agents.ModelSettings(temperature=0))
        if not streamed:
            return (await agents.Runner.run(agent, "What is the weather in Paris?")).final_output
        run = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = [event.type async for event in run.stream_events()]
        assert "raw_response_event" in kinds
        return run.final_output

    return asyncio.run(main()), calls, sent


@pytest.mark.parametrize("make_model, streamed", [
    (lambda c: agents.OpenAIResponsesModel("scripted", c), False),
    (lambda c: agents.OpenAIResponsesModel("scripted", c), True),
    (lambda c: agents.OpenAIChatCompletionsModel("scripted", c), False),
], ids=["responses", "responses-streamed", "chat-completions"])
def test_agent_calls_the_tool_and_answers(make_model, streamed):
    final, calls, sent = _run(make_model, streamed)
    assert calls == ["Paris"]
    assert final == SCRIPTS[TOOL_RESULT_TRIGGER]
    # Two model calls (the tool call, then the answer), both accepted as the SDK really sends them.
    assert len(sent) == 2 and all(status == 200 for _, _, status in sent), sent
    path, body, _ = sent[1]
    if path.endswith("/responses"):
        assert "include" in body and [i.get("type") for i in body["input"]][-2:] == ["function_call",
                                                                                     "function_call_output"]
    else:
        assert [m["role"] for m in body["messages"]][-2:] == ["assistant", "tool"]
