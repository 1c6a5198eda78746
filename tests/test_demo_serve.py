"""`radixserve serve` with no --model (the trained demo model) driven by the official openai client: readable
replies with no max_tokens, get_weather tool calls (a held-out city too) and a tool-result round trip; and the
ReAct example (lang/examples/react.py) on the demo model, acting with real tool calls.
"""
from __future__ import annotations

import json

import openai
import pytest

from _http_server import shared_server
from radixserve.kernels import demo_data
from radixserve.kernels.demo_eval import WEATHER_TOOL

MODEL = "radixserve-demo"


@pytest.fixture(scope="module")
def client():
    server = shared_server("demo", [])  # no --model: the built-in demo model
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kwargs)


def test_first_reply_is_readable_and_short_without_max_tokens(client):
    out = _ask(client, "Hello! What is the capital of France?")
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 64


@pytest.mark.parametrize("city", ["Paris", demo_data.HELDOUT_CITIES[0], demo_data.HELDOUT_CITIES[1]])
def test_weather_question_becomes_a_get_weather_call(client, city):
    assert city == "Paris" or city not in demo_data.WEATHER_CITIES  # the others never in a weather conversation
    out = _ask(client, f"What is the weather in {city}?", tools=[WEATHER_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": city}


def test_tool_result_round_trip(client):
    messages = [{"role": "user", "content": f"What is the weather in {demo_data.HELDOUT_CITIES[2]}?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0)
    [call] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"temperature": 17, "condition": "windy"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0)
    text = final.choices[0].message.content
    assert final.choices[0].finish_reason == "stop"
    assert "windy" in text and "17" in text and demo_data.HELDOUT_CITIES[2] in text, text


def test_no_tool_needed_gets_a_plain_answer_with_tools_offered(client):
    out = _ask(client, "What is the capital of Japan?", tools=[WEATHER_TOOL])
    assert out.choices[0].message.tool_calls is None and "Tokyo" in out.choices[0].message.content


def test_react_example_acts_with_real_tool_calls():
    from radixserve.lang import Runtime
    from radixserve.lang.examples.react import QUESTIONS, run_agents, tool_calls

    runtime = Runtime(None, num_threads=1)
    try:
        states, report = run_agents(runtime, num_agents=len(QUESTIONS))
    finally:
        runtime.shutdown()
    calls = [call for state in states for call in tool_calls(state)]
    real = [(tool, arg, result) for tool, arg, result in calls
            if not result.startswith("error") and result != "unknown key"]
    assert len(real) >= len(QUESTIONS), calls  # about one real call per agent at least
    answered = [s for s in states if s["answer"].strip()]
    assert len(answered) == len(states)
    # "How many seconds are in a day?" is answered from its calculator call.
    assert states[0]["answer"].strip() == "86400", [tool_calls(states[0]), states[0]["answer"]]
    assert report.hit_rate > 0.5


def test_react_agent_on_a_question_outside_its_corpus():
    """n = 41 is outside the corpus's 2..30: the model must copy it into the calculator's input."""
    from radixserve.lang import Runtime
    from radixserve.lang.examples.react import react_agent, tool_calls

    runtime = Runtime(None, num_threads=1)
    try:
        state = react_agent.run(question="How many minutes are in 41 hours?", backend=runtime, temperature=0.0)
    finally:
        runtime.shutdown()
    assert tool_calls(state) == [("calculator", "41 * 60", "2460")]
    assert state["answer"].strip() == "2460"
