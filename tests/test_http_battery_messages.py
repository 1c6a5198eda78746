"""The bad-input battery on the Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): each case a 400 (or
the status named) in Anthropic's error format whose message names what to fix, and after each the guard of
tests/_http_battery.py (healthy, no 5xx, no traceback, the idle KV identity). A few well-formed bodies that use every
accepted field (cache_control everywhere, thinking types, metadata, redacted_thinking) must pass.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from _http_battery import Guard, assert_answer, connect, read_until, request_bytes
from _http_battery_cases import _UNSET, Case, _case
from _http_server import main_server

MSG, COUNT = "/v1/messages", "/v1/messages/count_tokens"
HI = {"role": "user", "content": "hi"}
EPHEMERAL = {"type": "ephemeral"}
TOOL = {"name": "get_weather", "description": "the weather", "cache_control": EPHEMERAL,
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def msg(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2, "messages": list(messages) or [HI], **fields}


def blocks(*content: Any, role: str = "user") -> dict[str, Any]:
    return msg({"role": role, "content": list(content)})


def assistant(*content: Any) -> dict[str, Any]:
    """A turn that sent `content` back, and a user turn after it."""
    return msg(HI, {"role": "assistant", "content": list(content)}, HI)


def after_call(*content: Any) -> dict[str, Any]:
    return msg(HI, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": list(content)})


def _output_tokens(n: int):
    def check(body: Any) -> None:
        assert body["type"] == "message" and body["usage"]["output_tokens"] <= n, body
    return check


CASES = [
    _case("empty-body", MSG, content=b"", says="empty"),
    _case("not-json", MSG, content=b"hello", says="JSON"),
    _case("json-array", MSG, content=b"[]", says="object"),
    _case("body-over-limit", MSG, msg({"role": "user", "content": "y" * 70_000}), status=413),
    _case("unknown-model", MSG, msg(model="claude-9"), status=404, says="claude-9"),
    _case("missing-max-tokens", MSG, {"messages": [HI]}, says="max_tokens is required"),
    _case("max-tokens-string", MSG, msg(max_tokens="2"), says="max_tokens"),
    _case("max-tokens-negative", MSG, msg(max_tokens=-1), says="max_tokens"),
    _case("max-tokens-past-context", MSG, msg(max_tokens=10**6), says="max_tokens"),
    _case("messages-missing", MSG, {"max_tokens": 2}, says="messages is required"),
    _case("messages-empty", MSG, msg(messages=[]), says="messages"),
    _case("role-unknown", MSG, msg({"role": "wizard", "content": "x"}), says="messages[0].role"),
    _case("content-number", MSG, msg({"role": "user", "content": 5}), says="messages[0].content"),
    _case("content-missing", MSG, msg({"role": "user"}), says="messages[0].content"),
    _case("block-string", MSG, msg({"role": "user", "content": ["hi"]}), says="messages[0].content[0]"),
    _case("block-without-type", MSG, blocks({"text": "x"}), says="messages[0].content[0].type"),
    _case("block-unknown-type", MSG, blocks({"type": "hologram"}), says="hologram"),
    _case("block-image-unsupported", MSG, blocks({"type": "image", "source": {"type": "url", "url": "http://x"}}),
          says="image"),
    _case("text-block-without-text", MSG, blocks({"type": "text"}), says="content[0].text"),
    _case("text-block-text-number", MSG, blocks({"type": "text", "text": 5}), says="content[0].text"),
    _case("tool-use-in-user-message", MSG, blocks(CALL), says="content[0].type"),
    _case("tool-result-in-assistant", MSG, assistant({"type": "tool_result", "tool_use_id": "toolu_1"}),
          says="messages[1].content[0].type"),
    _case("thinking-in-user-message", MSG, blocks({"type": "thinking", "thinking": "t", "signature": "s"}),
          says="content[0].type"),
    _case("tool-result-without-tool-use", MSG, blocks({"type": "tool_result", "tool_use_id": "toolu_9",
                                                       "content": "r"}),
          says="tool_use_id"),
    _case("tool-result-for-another-id", MSG, after_call({"type": "tool_result", "tool_use_id": "toolu_2"}),
          says="toolu_2"),
    _case("tool-result-image-content", MSG, after_call({"type": "tool_result", "tool_use_id": "toolu_1",
                                                        "content": [{"type": "image"}]}), says="image"),
    _case("tool-result-is-error-string", MSG, after_call({"type": "tool_result", "tool_use_id": "toolu_1",
                                                          "is_error": "yes"}), says="is_error"),
    _case("tool-use-without-id", MSG, assistant(dict(CALL, id="")), says="content[0].id"),
    _case("tool-use-input-string", MSG, assistant(dict(CALL, input='{"city": "Paris"}')), says="content[0].input"),
    _case("thinking-without-signature", MSG, assistant({"type": "thinking", "thinking": "hmm"}), says="signature"),
    _case("thinking-bad-signature", MSG, assistant({"type": "thinking", "thinking": "hmm", "signature": "AAAA"}),
          says="does not verify"),
    _case("redacted-thinking-without-data", MSG, assistant({"type": "redacted_thinking"}), says="data"),
    _case("prefill-refused", MSG, msg(HI, {"role": "assistant", "content": "The answer is"}), says="prefill"),
    _case("system-number", MSG, msg(system=5), says="system"),
    _case("system-image-block", MSG, msg(system=[{"type": "image"}]), says="image"),
    _case("budget-equal-max-tokens", MSG, msg(max_tokens=16, thinking={"type": "enabled", "budget_tokens": 16}),
          says="budget_tokens"),
    _case("budget-above-max-tokens", COUNT, msg(max_tokens=16, thinking={"type": "enabled", "budget_tokens": 99}),
          status=200),  # count_tokens takes no max_tokens of its own to compare with
    _case("budget-missing", MSG, msg(thinking={"type": "enabled"}), says="budget_tokens"),
    _case("budget-zero", MSG, msg(max_tokens=16, thinking={"type": "enabled", "budget_tokens": 0}),
          says="budget_tokens"),
    _case("thinking-type-unknown", MSG, msg(thinking={"type": "sometimes"}), says="thinking.type"),
    _case("thinking-not-object", MSG, msg(thinking="enabled"), says="thinking"),
    _case("effort-unknown", MSG, msg(output_config={"effort": "extreme"}), says="effort"),
    _case("output-format-not-schema", MSG, msg(output_config={"format": {"type": "xml"}}), says="format"),
    _case("cache-control-unknown-type", MSG, msg(system=[{"type": "text", "text": "s",
                                                          "cache_control": {"type": "forever"}}]),
          says="cache_control.type"),
    _case("cache-control-bad-ttl", MSG, msg(cache_control={"type": "ephemeral", "ttl": "2h"}), says="ttl"),
    _case("tool-without-input-schema", MSG, msg(tools=[{"name": "f"}]), says="input_schema"),
    _case("tool-without-name", MSG, msg(tools=[dict(TOOL, name="")]), says="tools[0].name"),
    _case("server-tool", MSG, msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
          says="server tools"),
    _case("tool-choice-unknown-type", MSG, msg(tools=[TOOL], tool_choice={"type": "sometimes"}), says="tool_choice"),
    _case("tool-choice-without-type", MSG, msg(tools=[TOOL], tool_choice={"name": "get_weather"}),
          says="tool_choice.type"),
    _case("tool-choice-tool-without-name", MSG, msg(tools=[TOOL], tool_choice={"type": "tool"}),
          says="tool_choice.name"),
    _case("tool-choice-names-unknown-tool", MSG, msg(tools=[TOOL], tool_choice={"type": "tool", "name": "fly"}),
          says="fly"),
    _case("tool-choice-any-without-tools", MSG, msg(tool_choice={"type": "any"}), says="tool_choice"),
    _case("tool-schema-invalid-forced", MSG, msg(tools=[dict(TOOL, input_schema={"type": "object", "properties": {
        "a": {"type": "nonsense"}}})], tool_choice={"type": "any"}), says="invalid tools"),
    _case("output-format-invalid-schema", MSG, msg(output_config={"format": {"type": "json_schema",
                                                                             "schema": {"type": "bogus"}}}),
          says="invalid output_config.format"),
    _case("output-format-with-forced-tool", MSG, msg(tools=[TOOL], tool_choice={"type": "any"}, output_config={
        "format": {"type": "json_schema", "schema": {"type": "object"}}}), says="output_config.format"),
    _case("stop-sequences-number", MSG, msg(stop_sequences=5), says="stop_sequences"),
    _case("stop-sequences-empty-string", MSG, msg(stop_sequences=[""]), says="stop_sequences"),
    _case("temperature-negative", MSG, msg(temperature=-1), says="temperature"),
    _case("top-k-string", MSG, msg(top_k="5"), says="top_k"),
    _case("metadata-user-id-number", MSG, msg(metadata={"user_id": 5}), says="metadata.user_id"),
    _case("stream-string", MSG, msg(stream="yes"), says="stream"),
    _case("count-tokens-bad-block", COUNT, blocks({"type": "hologram"}), says="hologram"),
    _case("count-tokens-unknown-model", COUNT, msg(model="claude-9"), status=404),
    _case("get-on-messages", MSG, method="GET", status=405),
    _case("unknown-path-under-messages", MSG + "/batches", msg(), status=404),
    # Well-formed bodies that use every accepted field.
    _case("everything-accepted", MSG, status=200, check=_output_tokens(2), json=msg(
        HI, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                              {"type": "text", "text": "ok", "cache_control": EPHEMERAL}, CALL]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "cache_control": EPHEMERAL, "content": [{"type": "text", "text": "down"}]},
                                     {"type": "text", "text": "and now?", "citations": None}]},
        system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True}, metadata={"user_id": "u"},
        cache_control=EPHEMERAL, thinking={"type": "adaptive", "display": "summarized"},
        output_config={"effort": "xhigh"}, stop_sequences=["zz"], temperature=0.5, top_p=0.9, top_k=5,
        service_tier="auto", container=None)),
    _case("thinking-enabled-below-max", MSG, msg(max_tokens=8, thinking={"type": "enabled", "budget_tokens": 4}),
          status=200, check=_output_tokens(8)),
    _case("thinking-between-tools", MSG, msg(thinking={"type": "between_tools"}), status=200),
    _case("max-tokens-zero", MSG, msg(max_tokens=0), status=200, check=_output_tokens(0)),
    _case("system-message-role", MSG, msg({"role": "system", "content": "be brief"}, HI), status=200),
    _case("count-tokens-without-max-tokens", COUNT, {"messages": [HI], "system": "s"}, status=200,
          check=lambda body: body["input_tokens"] > 1),
]


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.mark.parametrize("case", CASES)
def test_bad_input(server, case: Case):
    guard = Guard(server)
    kwargs: dict[str, Any] = {"headers": case.headers}
    if case.json is not _UNSET:
        kwargs["json"] = case.json
    elif case.content is not None:
        kwargs["content"] = case.content
    with server.client() as http:
        response = http.request(case.method, case.path, **kwargs)
    error = assert_answer(response, case.status)  # Anthropic's format under /v1/messages
    if error is not None:
        expected = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large"}[case.status]
        assert error["type"] == expected, error
        if case.says is not None:
            assert case.says.lower() in error["message"].lower(), error
    elif case.check is not None:
        case.check(response.json())
    guard.check()


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    guard = Guard(server)
    aborted = guard.stats_before["num_requests_aborted"]
    body = msg({"role": "user", "content": "stream away"}, max_tokens=400, ignore_eos=True, stream=True)
    with connect(server.url) as sock:
        data = json.dumps(body).encode()
        sock.sendall(request_bytes("POST", MSG, data, headers={"Content-Type": "application/json"}))
        head = read_until(sock, b"event: content_block_delta", 3)
        assert head.startswith(b"HTTP/1.1 200") and b"event: message_start" in head, head[:300]
    stats = guard.check()
    assert stats["num_requests_aborted"] == aborted + 1
