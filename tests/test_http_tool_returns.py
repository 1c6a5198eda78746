"""A session's turn that calls a tool names the tool to the engine (frontend/sessions_api.settle_turn), on every API
that parses tool calls, streamed or not: the session's next request then counts as a return after a named tool
(`num_tool_returns`), whose own return gaps predict the next one (scheduler/return_gaps.ToolGaps)."""
from __future__ import annotations

import time
import uuid

import pytest

from _http_server import tools_server

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
ASK = "what is the weather in Paris?"


def _chat(stream: bool) -> tuple[str, dict]:
    return "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 60, "stream": stream, "messages": [{"role": "user", "content": ASK}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def _messages(stream: bool) -> tuple[str, dict]:
    return "/v1/messages", {
        "model": "tiny", "max_tokens": 60, "stream": stream, "messages": [{"role": "user", "content": ASK}],
        "tools": [{"name": "get_weather", "input_schema": PARAMS}], "tool_choice": {"type": "tool", "name": "get_weather"}}


def _responses(stream: bool) -> tuple[str, dict]:
    return "/v1/responses", {
        "model": "tiny", "max_output_tokens": 60, "stream": stream, "input": ASK, "store": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
        "tool_choice": {"type": "function", "name": "get_weather"}}


def _settled(server, timeout_s: float = 10.0) -> None:
    """Wait until the engine has nothing running or waiting (the turn's prefetch of its rewritten history done)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(0.2)
    while time.monotonic() < deadline:
        stats = server.server_info()["stats"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not settle")


@pytest.mark.parametrize("api", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_names_its_tool_to_the_engine(api, stream):
    pytest.importorskip("xgrammar")  # the tiny random model calls a tool only when tool_choice's grammar makes it
    server = tools_server()
    headers = {"x-session-id": f"tool-returns-{uuid.uuid4().hex}"}
    before = server.server_info()["stats"]["num_tool_returns"]
    path, body = api(stream)
    with server.client() as c:
        r = c.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert "get_weather" in r.text  # the call, whole or in the stream's events
        _settled(server)  # the name goes to the engine beside the reply; a history prefetch may follow
        assert server.server_info()["stats"]["num_tool_returns"] == before  # neither is the agent coming back
        nxt = c.post("/v1/chat/completions", headers=headers,
                     json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "ok"}]})
        assert nxt.status_code == 200, nxt.text
    assert server.server_info()["stats"]["num_tool_returns"] == before + 1
    without = {"x-session-id": f"tool-returns-{uuid.uuid4().hex}"}
    with server.client() as c:  # a final answer (tool_choice none) names nothing
        plain = dict(api(False)[1], tool_choice="none" if api is not _messages else {"type": "none"})
        assert c.post(path, json=plain, headers=without).status_code == 200
        c.post("/v1/chat/completions", headers=without,
               json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "ok"}]})
    assert server.server_info()["stats"]["num_tool_returns"] == before + 1
