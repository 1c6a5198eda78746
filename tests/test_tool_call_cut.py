"""A forced tool call cut by the token limit inside its arguments (issue 34 item 9): finish_reason "length" (the
Responses API: incomplete, max_output_tokens), no tool call, and none of the call's raw `<tool_call>` markup in the
content; chat streamed and not, and the Responses API streamed and not, through the openai SDK.

The tiny random-weight model of tests/_http_server.py writes the call only because the grammar forces it
(tool_choice required / named); greedy decoding makes the cut call the first tokens of the full one.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from _http_server import main_server
from radixserve.frontend.tool_parser import TOOL_CALL_SYNTAX

pytest.importorskip("xgrammar")

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "minLength": 3, "maxLength": 8}},
          "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": PARAMS}]
QUESTION = "Weather in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
MARKUP = (TOOL_CALL_SYNTAX.open, '"arguments"', TOOL_CALL_SYNTAX.close)


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def cut_at(server):
    """(max_tokens that ends the forced call inside its arguments, the full call's arguments)."""
    body = {"model": "tiny", "messages": MESSAGES, "tools": CHAT_TOOLS, "tool_choice": "required",
            "temperature": 0, "max_tokens": 64, "return_token_ids": True}
    choice = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    ids = choice["token_ids"]
    prefix = TOOL_CALL_SYNTAX.call_prefix("get_weather")
    for k in range(1, len(ids)):
        text = httpx.post(server.url + "/detokenize", json={"tokens": ids[:k]}, timeout=30).json()["text"]
        if text.startswith(prefix) and len(text) > len(prefix) + 1:  # past the arguments' opening brace
            with pytest.raises(ValueError):
                json.loads(text[len(prefix):])  # the arguments are unfinished: the cut is inside them
            return k, choice["message"]["tool_calls"][0]["function"]["arguments"]
    raise AssertionError(f"the call's arguments are never open: {choice}")


def _no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


@pytest.mark.parametrize("which", CHOICES)
def test_chat_call_cut_by_max_tokens(client, cut_at, which):
    k, _ = cut_at
    kwargs = dict(model="tiny", messages=MESSAGES, tools=CHAT_TOOLS, tool_choice=CHOICES[which], temperature=0,
                  max_tokens=k)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls, choice
    _no_markup(choice.message.content)
    assert out.usage.completion_tokens == k
    content, calls, finishes = "", [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finishes += [c.finish_reason] if c.finish_reason else []
    assert finishes == ["length"] and not calls
    _no_markup(content)


def test_responses_call_cut_by_max_output_tokens(client, cut_at):
    k, arguments = cut_at
    kwargs = dict(model="tiny", input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required", temperature=0)
    full = client.responses.create(**kwargs, max_output_tokens=64)
    assert [item.type for item in full.output] == ["function_call"]
    assert full.output[0].arguments == arguments  # the same prompt and greedy tokens as chat's
    cut = client.responses.create(**kwargs, max_output_tokens=k)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert "function_call" not in [item.type for item in cut.output]
    _no_markup(cut.output_text)
    events = list(client.responses.create(**kwargs, max_output_tokens=k, stream=True))
    assert events[-1].type == "response.incomplete"
    assert not [e for e in events if e.type.startswith("response.function_call")]
    _no_markup("".join(e.delta for e in events if e.type == "response.output_text.delta"))
    _no_markup(events[-1].response.output_text)
