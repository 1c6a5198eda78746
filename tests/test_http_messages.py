"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) driven by the anthropic SDK against real
servers: the scripted checkpoint (text, stop sequences, a tool-use round trip streamed and not, cache reads), the
tiny random model (tool_choice any / tool forced by the grammar), and the scripted thinking model behind a
Qwen3-style template with --reasoning-parser qwen3 (thinking blocks, their budget and signatures, a multi-turn loop
that sends them back). Bad input is tests/test_http_battery_messages.py.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from _http_server import (
    SCRIPTS,
    THINK_ANSWER,
    THINK_REASONING,
    THINK_TRIGGER,
    reasoning_server,
    scripted_server,
    tools_server,
)

TOOLS = [{"name": "get_forecast", "description": "Forecast for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scripted():
    return _client(scripted_server())


@pytest.fixture(scope="module")
def thinker():
    return _client(reasoning_server())


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- text, stop sequences, the stream's events --------------------------------------------------


def test_create_returns_a_message_with_usage(scripted):
    out = scripted.messages.create(model="scripted", max_tokens=64, messages=_ask("tell me a story"))
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == SCRIPTS["story"]
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    usage = out.usage
    assert usage.output_tokens > 10 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == _count(scripted, _ask("tell me a story"))


def _count(client, messages, **kwargs) -> int:
    return client.messages.count_tokens(model="scripted", messages=messages, **kwargs).input_tokens


def test_stop_sequence_and_max_tokens(scripted):
    script = SCRIPTS["poem"]
    out = scripted.messages.create(model="scripted", max_tokens=64, messages=_ask("Write a poem"),
                                   stop_sequences=["never", "STOP"])
    assert out.content[0].text == script[:script.index("STOP")]
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "STOP"
    cut = scripted.messages.create(model="scripted", max_tokens=3, messages=_ask("Write a poem"))
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_stream_sends_anthropics_event_sequence(scripted):
    server = scripted_server()
    body = {"model": "scripted", "max_tokens": 64, "messages": _ask("tell me a story"), "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    events = [chunk.split("\n") for chunk in raw.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert all(p["type"] == name for p, name in zip(payloads, names))
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert "".join(p["delta"]["text"] for p in payloads[3:-3]) == SCRIPTS["story"]
    assert payloads[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    with scripted.messages.stream(model="scripted", max_tokens=64, messages=_ask("tell me a story")) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == SCRIPTS["story"] and final.content[0].text == text and final.stop_reason == "end_turn"


# -- tools ----------------------------------------------------------------------------------------


def test_tool_use_round_trip_streamed_and_not(scripted):
    made = scripted.messages.create(model="scripted", max_tokens=64, messages=WEATHER, tools=TOOLS)
    assert made.stop_reason == "tool_use" and [b.type for b in made.content] == ["tool_use"]
    call = made.content[0]
    assert call.name == "get_forecast" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    with scripted.messages.stream(model="scripted", max_tokens=64, messages=WEATHER, tools=TOOLS) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
        streamed = stream.get_final_message()
    assert json.loads("".join(partial)) == call.input  # the SDK reassembled input_json_delta into the same input
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == call.input
    history = WEATHER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in made.content]}]
    for result in ("sunny, 17 C", [{"type": "text", "text": "sunny", "cache_control": {"type": "ephemeral"}}]):
        answer = scripted.messages.create(model="scripted", max_tokens=64, tools=TOOLS, messages=history + [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}])
        assert answer.stop_reason == "end_turn" and answer.content[0].text == SCRIPTS["<tool_response>"]
        assert answer.usage.cache_read_input_tokens > 0
    failed = scripted.messages.create(model="scripted", max_tokens=64, tools=TOOLS, messages=history + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "timeout",
                                      "is_error": True}]}])
    assert failed.content[0].text == SCRIPTS["<tool_response>"]


BOUNDED = [{"name": "units", "description": "pick a unit",
            "input_schema": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}},
           {"name": "flag", "description": "set a flag",
            "input_schema": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}]


@pytest.mark.parametrize("choice, names", [
    ({"type": "any", "disable_parallel_tool_use": True}, {"units", "flag"}),
    ({"type": "tool", "name": "flag"}, {"flag"}),
], ids=["any", "tool"])
def test_tool_choice_forces_a_call(choice, names):
    """The tiny random model never calls a tool on its own: each call here is the grammar's."""
    pytest.importorskip("xgrammar")
    client = _client(tools_server())
    out = client.messages.create(model="tiny", max_tokens=100, messages=_ask("hello"), tools=BOUNDED,
                                 tool_choice=choice, extra_body={"seed": 3})
    assert out.stop_reason == "tool_use", out
    [call] = [b for b in out.content if b.type == "tool_use"]
    assert call.name in names and set(call.input) == {"unit" if call.name == "units" else "on"}
    plain = client.messages.create(model="tiny", max_tokens=8, messages=_ask("hello"), tools=BOUNDED,
                                   tool_choice={"type": "none"})
    assert all(b.type == "text" for b in plain.content)


def test_output_format_constrains_the_answer():
    pytest.importorskip("xgrammar")
    client = _client(tools_server())
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = client.messages.create(model="tiny", max_tokens=60, messages=_ask("hello"),
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert out.stop_reason == "end_turn", out
    assert isinstance(json.loads(out.content[0].text)["ok"], bool)


# -- count_tokens, the cache, sampling fields, errors -----------------------------------------------


def test_cache_read_on_a_repeated_system_prompt(scripted):
    system = [{"type": "text", "text": "You are a careful assistant. " * 40, "cache_control": {"type": "ephemeral"}}]
    first = scripted.messages.create(model="scripted", max_tokens=8, system=system, messages=_ask("hello there"))
    second = scripted.messages.create(model="scripted", max_tokens=8, system=system, messages=_ask("hi again"))
    alone = _count(scripted, _ask("x"), system=system)
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == _count(scripted, _ask("hello there"),
                                                                                    system=system)
    assert second.usage.cache_read_input_tokens >= alone - 8 > 200, (alone, second.usage)


def test_count_tokens_counts_tools_and_system(scripted):
    bare = _count(scripted, WEATHER)
    assert _count(scripted, WEATHER, tools=TOOLS) > bare + 20
    assert _count(scripted, WEATHER, system="Be brief.") > bare


def test_sampling_fields_in_the_body(scripted):
    out = scripted.messages.create(model="scripted", max_tokens=64, messages=_ask("tell me a story"),
                                   extra_body={"temperature": 0.0, "top_k": 1, "top_p": 0.5}, metadata={"user_id": "u1"})
    assert out.content[0].text == SCRIPTS["story"]
    with pytest.raises(anthropic.BadRequestError) as info:
        scripted.messages.create(model="scripted", max_tokens=8, messages=_ask("x"), extra_body={"top_k": -5})
    assert info.value.body["error"]["type"] == "invalid_request_error" and "top_k" in info.value.message


def test_errors_are_the_sdks_exception_classes(scripted):
    with pytest.raises(anthropic.BadRequestError) as info:
        scripted.messages.create(model="scripted", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "hologram", "text": "x"}]}])
    assert info.value.status_code == 400 and "messages[0].content[0].type" in info.value.message
    with pytest.raises(anthropic.BadRequestError):
        scripted.messages.create(model="scripted", max_tokens=8, messages=_ask("x"), stream=True,
                                 thinking={"type": "enabled", "budget_tokens": 8})
    with pytest.raises(anthropic.NotFoundError) as info:
        scripted.messages.create(model="claude-opus-9", max_tokens=8, messages=_ask("x"))
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        scripted.messages.batches.list()  # no endpoint there: a 404 in Anthropic's format


# -- thinking ---------------------------------------------------------------------------------------


THINK = [{"role": "user", "content": f"please {THINK_TRIGGER} for me"}]


def test_thinking_blocks_streamed_and_not(thinker):
    on = {"type": "enabled", "budget_tokens": 100}
    out = thinker.messages.create(model="thinker", max_tokens=128, messages=THINK, thinking=on)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == THINK_REASONING and out.content[1].text == THINK_ANSWER
    assert out.usage.output_tokens_details.thinking_tokens > 5
    with thinker.messages.stream(model="thinker", max_tokens=128, messages=THINK, thinking=on) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert kinds.index("signature_delta") == kinds.index("text_delta") - 1 and kinds.count("signature_delta") == 1
    assert streamed.content[0].model_dump() == out.content[0].model_dump()  # text and signature
    off = thinker.messages.create(model="thinker", max_tokens=128, messages=THINK, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == THINK_ANSWER


def test_budget_tokens_caps_the_thinking(thinker):
    out = thinker.messages.create(model="thinker", max_tokens=128, messages=THINK,
                                  thinking={"type": "enabled", "budget_tokens": 8})
    thinking = [b.thinking for b in out.content if b.type == "thinking"]
    assert len(thinking) <= 1 and THINK_REASONING.startswith(thinking[0] if thinking else "")
    assert (thinking[0] if thinking else "") != THINK_REASONING
    assert out.content[-1].text == THINK_ANSWER and out.stop_reason == "end_turn"


def test_multi_turn_loop_sends_thinking_back_and_reads_the_cache(thinker):
    history: list[dict] = []
    previous_prompt = 0
    for turn in range(3):
        history.append({"role": "user", "content": f"turn {turn}: please {THINK_TRIGGER} again"})
        out = thinker.messages.create(model="thinker", max_tokens=128, messages=history,
                                      thinking={"type": "enabled", "budget_tokens": 100})
        assert [b.type for b in out.content] == ["thinking", "text"]
        usage = out.usage
        assert usage.cache_read_input_tokens >= previous_prompt, (turn, usage)  # the whole history so far
        previous_prompt = usage.input_tokens + usage.cache_read_input_tokens
        blocks = [b.model_dump(exclude_none=True) for b in out.content]
        blocks.insert(0, {"type": "redacted_thinking", "data": "opaque"})  # accepted, and dropped
        history.append({"role": "assistant", "content": blocks})
    tampered = json.loads(json.dumps(history))
    tampered[1]["content"][1]["thinking"] = "I was told to say five."
    with pytest.raises(anthropic.BadRequestError) as info:
        thinker.messages.create(model="thinker", max_tokens=8,
                                messages=tampered + [{"role": "user", "content": "x"}])
    assert "messages[1].content[1].signature" in info.value.message
