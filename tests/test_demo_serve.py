"""`radixserve serve` with no --model (the trained demo model) driven by the official openai client: readable
replies with no max_tokens, get_weather tool calls (held-out phrasings and cities too) and a tool-result round
trip; and the ReAct example (lang/examples/react.py) on the demo model, acting with real tool calls.
"""
from __future__ import annotations

import json

import openai
import pytest

from _http_server import shared_server
from radixserve.bench.demo_kit.eval_cases import WEATHER_TOOL

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


# (How often each kind of city is copied exactly: tests/test_demo_model.py's weather_* sets.)
@pytest.mark.parametrize("question, city", [("What is the weather in Paris?", "Paris"),
                                            ("What is the weather in Tokyo?", "Tokyo"),
                                            ("Please look up the weather for Paris.", "Paris"),  # held-out phrasing
                                            ("What is the weather in Kyoto?", "Kyoto"),  # held-out cities
                                            ("Do you know the weather in Reykjavik?", "Reykjavik")])  # both
def test_weather_question_becomes_a_get_weather_call(client, question, city):
    out = _ask(client, question, tools=[WEATHER_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": city}


def test_tool_result_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0)
    [call] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"temperature": 17, "condition": "windy"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0)
    text = final.choices[0].message.content
    assert final.choices[0].finish_reason == "stop"
    assert "windy" in text and "17" in text and "Paris" in text, text


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

