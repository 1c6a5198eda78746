"""POST /v1/responses through the official `openai` client against real servers (issue 12): string, item and
instructions input; the streaming event sequence; function tools end to end on the scripted checkpoint
(call -> function_call_output -> final message); text.format json_schema; retrieve / delete / input_items;
what the clients send is accepted and what cannot be honoured is a 400."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from _http_battery import Guard, assert_openai_error
from _http_server import SCRIPTS, TOOL_RESULT_TRIGGER, main_server, scripted_server
from test_structured import SCHEMAS, validate

MODEL = "scripted"
TOOL = {"type": "function", "name": "get_forecast", "description": "Forecast for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]
CALL_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.function_call_arguments.delta", "response.function_call_arguments.done",
               "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def server():
    return scripted_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_string_item_and_instructions_input(client):
    r = client.responses.create(model=MODEL, input="Tell me a story")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == SCRIPTS["story"] and [o.type for o in r.output] == ["message"]
    assert r.usage.input_tokens > 0 and r.usage.input_tokens_details.cached_tokens >= 0
    items = client.responses.create(model=MODEL, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a poem"}]}])
    assert items.output_text.startswith("roses are red")
    # The instructions are the system turn: a trigger there answers like one in the input.
    r = client.responses.create(model=MODEL, instructions="Tell a story.", input="Go on.")
    assert r.output_text == SCRIPTS["story"] and r.instructions == "Tell a story."
    assert r.usage.output_tokens > 10 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_event_sequence_and_final_equals_get(client, server):
    with client.responses.stream(model=MODEL, input="Tell me a story") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert _collapse(types) == TEXT_EVENTS and len(deltas) > 5
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    assert "".join(d.delta for d in deltas) == SCRIPTS["story"] == final.output_text
    raw = _raw_events(server, {"model": MODEL, "input": "Tell me a story", "stream": True})
    assert [e["type"] for e in raw] == types and [e["sequence_number"] for e in raw] == numbers
    got = httpx.get(f"{server.url}/v1/responses/{raw[-1]['response']['id']}").json()
    assert got == raw[-1]["response"]
    assert got["status"] == "completed" and got["output"][0]["content"][0]["text"] == SCRIPTS["story"]


def test_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[TOOL])
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_forecast" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    final = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    assert final.output_text == SCRIPTS[TOOL_RESULT_TRIGGER] and final.previous_response_id == first.id
    # The same round trip without the store: the client resends the call item itself.
    again = client.responses.create(model=MODEL, store=False, tools=[TOOL], input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_forecast", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert again.output_text == SCRIPTS[TOOL_RESULT_TRIGGER]


def test_stream_function_call_events(client):
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[TOOL]) as stream:
        events = list(stream)
    assert [e.type for e in events] == CALL_EVENTS
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert events[-1].response.output[0].status == "completed"


def test_json_schema_output_validates():
    tiny = main_server()
    c = openai.OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    schema = SCHEMAS[0]
    r = c.responses.create(model="tiny", input="Describe a person.", max_output_tokens=200, temperature=0,
                           text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    assert r.status == "completed", r.incomplete_details
    validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    bad = httpx.post(tiny.url + "/v1/responses", json={"input": "x", "text": {"format": {"type": "yaml"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format"


def test_retrieve_delete_input_items_and_404(client, server):
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "one"},
                                                    {"role": "assistant", "content": "two"},
                                                    {"role": "user", "content": "a poem"}])
    assert client.responses.retrieve(r.id).output_text == r.output_text
    newest_first = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in newest_first.data] == ["a poem", "two", "one"]
    page = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["one", "two"] and page["has_more"] is True
    rest = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items",
                     params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["a poem"] and rest["has_more"] is False
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model=MODEL, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "response_not_found"
    unstored = client.responses.create(model=MODEL, input="a poem", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_what_the_sdk_sends_is_accepted_and_echoed(server):
    """Every optional field of the SDK's create() that a client may set, captured as sent."""
    bodies = []
    http = httpx.Client(event_hooks={"request": [lambda req: bodies.append(json.loads(req.content))]})
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, http_client=http)
    r = c.responses.create(
        model=MODEL, input="a poem", include=["message.output_text.logprobs"], truncation="disabled",
        top_logprobs=2, safety_identifier="user-1", service_tier="auto", metadata={"k": "v"}, user="u",
        prompt_cache_key="tenant-7", parallel_tool_calls=True, store=True, max_output_tokens=64, temperature=0,
        top_p=1.0, tool_choice="auto", tools=[TOOL], reasoning={"effort": None}, stream_options=None)
    sent = bodies[-1]
    assert {"include", "truncation", "top_logprobs", "safety_identifier", "service_tier", "prompt_cache_key"} <= set(sent)
    assert r.prompt_cache_key == "tenant-7" and r.metadata == {"k": "v"} and r.user == "u"
    lp = r.output[0].content[0].logprobs
    assert len(lp) == r.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in lp)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a poem"}],
                                     extra_body={"prompt_cache_key": "tenant-7"})
    assert chat.model_extra["prompt_cache_key"] == "tenant-7"
    done = c.completions.create(model=MODEL, prompt="a poem", max_tokens=4, extra_body={"prompt_cache_key": "k"})
    assert done.model_extra["prompt_cache_key"] == "k"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "x"}]}]}, "input[0].content"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "stream": 1}, "stream"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_p": 2}, "top_p"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ({"input": "x", "include": "all"}, "include"),
    ({"input": "x", "top_logprobs": 50}, "top_logprobs"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_refusals_name_the_parameter(server, body, param):
    guard = Guard(server)
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["param"] == param, r.json()
    guard.check()


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/responses", 405), ("PUT", "/v1/responses", 405), ("POST", "/v1/responses/resp_x", 405),
    ("GET", "/v1/responses/resp_x/input_items?limit=0", 404), ("PATCH", "/v1/responses/resp_x", 405),
])
def test_wrong_methods_and_paths(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status and assert_openai_error(r)


def test_unknown_model_and_bad_bodies(server):
    r = httpx.post(server.url + "/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and assert_openai_error(r)["param"] == "model"
    for content in (b"[1, 2]", b"{", b"\xff"):
        r = httpx.post(server.url + "/v1/responses", content=content)
        assert r.status_code == 400 and assert_openai_error(r)


def test_truncation_auto_drops_the_oldest_messages():
    tiny = main_server()  # a 512-token context
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 60} for i in range(12)]
    body = {"input": history + [{"role": "user", "content": "and now?"}], "max_output_tokens": 4}
    assert httpx.post(tiny.url + "/v1/responses", json=body).status_code == 400
    r = httpx.post(tiny.url + "/v1/responses", json=dict(body, truncation="auto"))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] < 512


def _raw_events(server, body: dict) -> list[dict]:
    """The SSE events as sent: each `event: TYPE` line matches its data's type; no [DONE] at the end."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                assert line != "data: [DONE]"
                events.append(json.loads(line[len("data: "):]))
                assert events[-1]["type"] == kind
    return events


def _collapse(types: list[str]) -> list[str]:
    """Consecutive repeats (the text deltas) as one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]
